//! The crate's one error type.

use std::fmt;

/// Everything that can go wrong in `meshflow-kernels`. A missing GPU, driver or library is a value of
/// this type, never a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// No usable CUDA device: no driver library, no GPU, or an ordinal out of range.
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// A CUDA library (NVRTC, cuBLAS) could not be loaded.
    #[error("the {library} library could not be loaded: {detail}")]
    LibraryMissing {
        /// Which library (`nvrtc`, `cublas`).
        library: &'static str,
        /// What was tried and what failed.
        detail: String,
    },
    /// A CUDA driver call failed.
    #[cfg(feature = "cuda")]
    #[error("CUDA driver call {call} failed: {source}")]
    Driver {
        /// The operation that failed (e.g. `cuMemAlloc`).
        call: &'static str,
        /// The driver's error code and text.
        source: cudarc::driver::DriverError,
    },
    /// NVRTC could not compile a kernel source; `log` is NVRTC's program log.
    #[error("NVRTC failed to compile {unit} for {arch} ({code}):\n{log}")]
    Nvrtc {
        /// The compile unit: a kernel source file (`elementwise.cu`), or one typed kernel of it
        /// (`moe.cu: moe_combine_recv_bf16`).
        unit: String,
        /// The target architecture option (e.g. `sm_90`).
        arch: String,
        /// NVRTC's result code, as text.
        code: String,
        /// NVRTC's program log (compiler diagnostics).
        log: String,
    },
    /// A cuBLAS call failed.
    #[cfg(feature = "cuda")]
    #[error("cuBLAS call {call} failed: {source}")]
    Cublas {
        /// The cuBLAS function.
        call: &'static str,
        /// The cuBLAS status.
        source: cudarc::cublas::result::CublasError,
    },
    /// An NCCL call failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Nccl(#[from] crate::nccl::NcclError),
    /// No NCCL library could be loaded; lists every candidate tried with its loader error.
    #[error("the NCCL library could not be loaded; tried: {}", TriedList(.tried))]
    NcclNotFound {
        /// `(candidate, why it failed)` for each candidate, in order.
        tried: Vec<(String, String)>,
    },
    /// The operation or combination of arguments is not supported (e.g. a dtype a kernel lacks).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The arguments do not fit together (buffer sizes, shapes, devices).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A transfer through the inter-node host proxy failed (a lost peer, an abort, a timeout).
    #[error("host proxy: {0}")]
    Proxy(#[from] crate::proxy::ProxyError),
}

struct TriedList<'a>(&'a [(String, String)]);

impl fmt::Display for TriedList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(no candidates)");
        }
        for (i, (path, why)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{path} ({why})")?;
        }
        Ok(())
    }
}

/// Result alias of this crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_not_found_lists_every_candidate() {
        let e = KernelError::NcclNotFound {
            tried: vec![
                ("/a/libnccl.so.2".into(), "no such file".into()),
                ("libnccl.so".into(), "cannot open".into()),
            ],
        };
        assert_eq!(
            e.to_string(),
            "the NCCL library could not be loaded; tried: /a/libnccl.so.2 (no such file); \
             libnccl.so (cannot open)"
        );
    }
}
