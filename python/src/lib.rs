//! The native module of the Python package `meshflow` (`meshflow._native`): programs, the
//! builder, lowering, the cross-rank check, runs on the CPU backend and executors on numpy
//! arrays; with feature `cuda`, executors on torch CUDA tensors and the MoE ops.
//!
//! The Python package (`python/meshflow/`) re-exports these classes and adds the torch
//! integration (`meshflow.torch`); its docs and stubs (`_native.pyi`) describe the API.
//!
//! Everything here goes through meshflow's public embed API (`compile`, `Options`, `Compiled`,
//! `Executor`, `Bindings`, `CpuJob`, `CudaJob`, `CudaTensor`) and, for raw CUDA handles, the
//! constructors of `meshflow_kernels::python`: this crate has no unsafe code.
#![forbid(unsafe_code)]

use pyo3::prelude::*;

mod builder;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod data;
mod errors;
#[cfg(feature = "cuda")]
mod moe;
mod options;
mod program;
mod run;
mod store;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<program::Program>()?;
    m.add_class::<program::HostProgram>()?;
    m.add_class::<program::CheckReport>()?;
    m.add_class::<program::TensorSpec>()?;
    m.add_class::<run::RunResult>()?;
    m.add_class::<builder::Builder>()?;
    m.add_class::<builder::Schedule>()?;
    m.add_class::<builder::Tensor>()?;
    m.add_class::<builder::Mesh>()?;
    m.add_class::<cpu::CpuJob>()?;
    m.add_class::<cpu::CpuExecutor>()?;
    m.add_function(wrap_pyfunction!(program::parse, m)?)?;
    m.add_function(wrap_pyfunction!(program::load, m)?)?;
    m.add("HAS_CUDA", cfg!(feature = "cuda"))?;
    m.add("OPTION_NAMES", options::NAMES.to_vec())?;
    #[cfg(feature = "cuda")]
    {
        m.add_class::<cuda::CudaExecutor>()?;
        m.add_class::<moe::AllToAll>()?;
    }
    Ok(())
}
