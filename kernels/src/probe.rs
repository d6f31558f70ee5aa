//! Non-panicking probes for the dynamically loaded CUDA libraries.
//!
//! cudarc's dynamic loading panics when a library is missing; these probes run first so that a
//! machine without a driver, NVRTC or cuBLAS gets a [`KernelError`] instead.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use crate::error::{KernelError, Result};

/// Runs `f`, turning a panic (cudarc's reaction to a missing library or symbol) into an error.
pub(crate) fn no_panic<T>(library: &'static str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let detail = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "the loader panicked".to_owned());
        KernelError::LibraryMissing { library, detail }
    })
}

/// Checks (once per process) that libcuda can be loaded and `cuInit` succeeds.
pub(crate) fn driver() -> Result<()> {
    static STATE: OnceLock<Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: only dlopens candidate library names and drops the handles again.
            let present = unsafe { cudarc::driver::sys::is_culib_present() };
            if !present {
                return Err(
                    "the CUDA driver library (libcuda.so.1) is not installed or not on \
                            the loader path"
                        .to_owned(),
                );
            }
            match no_panic("cuda", cudarc::driver::result::init) {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("cuInit failed: {e}")),
                Err(e) => Err(e.to_string()),
            }
        })
        .clone()
        .map_err(KernelError::NoDevice)
}

/// Checks (once per process) that libnvrtc can be loaded.
pub(crate) fn nvrtc() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only dlopens candidate library names and drops the handles again.
    let present = *PRESENT.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() });
    present.then_some(()).ok_or(KernelError::LibraryMissing {
        library: "nvrtc",
        detail: "libnvrtc.so.13 (or another candidate name) is not on the loader path; put the \
                 CUDA 13 NVRTC library directory on LD_LIBRARY_PATH"
            .to_owned(),
    })
}

/// Checks (once per process) that libcublas can be loaded.
pub(crate) fn cublas() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only dlopens candidate library names and drops the handles again.
    let present = *PRESENT.get_or_init(|| unsafe { cudarc::cublas::sys::is_culib_present() });
    present.then_some(()).ok_or(KernelError::LibraryMissing {
        library: "cublas",
        detail: "libcublas.so.13 (or another candidate name) is not on the loader path; put the \
                 CUDA 13 cuBLAS library directory on LD_LIBRARY_PATH"
            .to_owned(),
    })
}
