//! [`run_and_compare_cuda`]: seeded inputs, a GPU run, the level-1 reference and a per-output
//! comparison (the CUDA counterpart of [`run_and_compare`](crate::runtime::run_and_compare)).

use meshflow_ir::{HostProgram, Program};

use super::ranks::{run_cuda, CudaOptions, CudaRunError};
use crate::runtime::compare::{compare_with_reference, CompareError, Comparison};
use crate::runtime::cpu::CpuKernels;
use crate::runtime::ranks::RunInputs;

/// Why a GPU comparison could not be made.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CudaCompareError {
    /// The GPU run failed.
    #[error(transparent)]
    Run(#[from] CudaRunError),
    /// Inputs, gathering, the reference or an output.
    #[error(transparent)]
    Compare(#[from] CompareError),
}

/// Generates seeded inputs for `level1`, runs `host` on `ranks` GPUs, gathers the outputs and
/// compares them with the level-1 reference (f32 rel err < 1e-5, bf16/f16 < 1e-2).
pub fn run_and_compare_cuda(
    level1: &Program,
    host: &HostProgram,
    ranks: usize,
    seed: u64,
    options: &CudaOptions,
) -> Result<Comparison, CudaCompareError> {
    let mut options = options.clone();
    options.ranks = Some(ranks);
    compare_with_reference(level1, seed, &CpuKernels::new(), |inputs| {
        let outcome = run_cuda(
            host,
            RunInputs::Full {
                program: level1,
                inputs,
            },
            &options,
        )?;
        Ok(outcome.gather(level1).map_err(CompareError::from)?)
    })
}
