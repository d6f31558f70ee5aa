//! The exception hierarchy: every meshflow error becomes one of these, with the message the
//! Rust API gives (`str(e)` is the Rust error's text).
//!
//! ```text
//! MeshflowError
//! ├── ProgramError        parse, verify and builder errors
//! │   ├── ParseError
//! │   ├── VerifyError
//! │   └── BuildError
//! ├── CompileError        a pass failed, options are wrong, the job is too small
//! ├── CheckError          the static cross-rank check rejects the host program
//! ├── ExecutionError      a rank's run failed
//! │   ├── BindingError    a tensor bound to an executor is missing, unknown or of the wrong type
//! │   └── DeviceError     CUDA, NCCL or the rendezvous failed
//! └── MoeError            the MoE ops (shapes, transports, device status)
//! ```

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    meshflow,
    MeshflowError,
    PyException,
    "Base class of every meshflow error."
);
create_exception!(
    meshflow,
    ProgramError,
    MeshflowError,
    "A program cannot be read or built."
);
create_exception!(
    meshflow,
    ParseError,
    ProgramError,
    "Program text does not parse (the message gives the line and column)."
);
create_exception!(
    meshflow,
    VerifyError,
    ProgramError,
    "A program does not verify (the message lists every problem)."
);
create_exception!(
    meshflow,
    BuildError,
    ProgramError,
    "A builder call failed (a duplicate name, operands that do not fit, a malformed mesh)."
);
create_exception!(
    meshflow,
    CompileError,
    MeshflowError,
    "Lowering failed: a pass, an option, or a job too small for the program."
);
create_exception!(
    meshflow,
    CheckError,
    MeshflowError,
    "The static cross-rank check rejects the host program."
);
create_exception!(
    meshflow,
    ExecutionError,
    MeshflowError,
    "A rank's run failed (the message names the rank and the instruction)."
);
create_exception!(
    meshflow,
    BindingError,
    ExecutionError,
    "A tensor bound to an executor is missing, unknown, or of the wrong type or shape."
);
create_exception!(
    meshflow,
    DeviceError,
    ExecutionError,
    "A CUDA, NCCL or rendezvous call failed."
);
create_exception!(
    meshflow,
    MoeError,
    MeshflowError,
    "A MoE dispatch or combine cannot be set up or run."
);

/// The exception of a meshflow error, with its message.
pub fn error(e: meshflow::Error) -> PyErr {
    use meshflow::Error as E;
    let message = e.to_string();
    match e {
        E::Parse(_) => ParseError::new_err(message),
        E::Verify(_) => VerifyError::new_err(message),
        E::Build(_) | E::Mesh(_) => BuildError::new_err(message),
        E::Compile(_) | E::WorldSize { .. } | E::NoProgram { .. } | E::UnknownTensor(_) => {
            CompileError::new_err(message)
        }
        E::Check(_) => CheckError::new_err(message),
        E::Binding { .. } | E::Data(_) | E::Shard(_) => BindingError::new_err(message),
        #[cfg(feature = "cuda")]
        E::Device(_) | E::Cuda { .. } => DeviceError::new_err(message),
        _ => ExecutionError::new_err(message),
    }
}

/// The exception of a kernels-crate error (CUDA, NCCL, DLPack).
#[cfg(feature = "cuda")]
pub fn device_error(e: meshflow::kernels::KernelError) -> PyErr {
    DeviceError::new_err(e.to_string())
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("MeshflowError", py.get_type::<MeshflowError>())?;
    m.add("ProgramError", py.get_type::<ProgramError>())?;
    m.add("ParseError", py.get_type::<ParseError>())?;
    m.add("VerifyError", py.get_type::<VerifyError>())?;
    m.add("BuildError", py.get_type::<BuildError>())?;
    m.add("CompileError", py.get_type::<CompileError>())?;
    m.add("CheckError", py.get_type::<CheckError>())?;
    m.add("ExecutionError", py.get_type::<ExecutionError>())?;
    m.add("BindingError", py.get_type::<BindingError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("MoeError", py.get_type::<MoeError>())?;
    Ok(())
}
