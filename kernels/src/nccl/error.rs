//! NCCL errors with the code, NCCL's description and its last-error text.

use std::fmt;

/// A failed NCCL call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclError {
    /// The NCCL function that failed (e.g. `ncclAllReduce`).
    pub call: &'static str,
    /// The `ncclResult_t` code.
    pub code: u32,
    /// `ncclGetErrorString(code)`.
    pub message: String,
    /// `ncclGetLastError(comm)`: NCCL's detailed text for the last failure (may be empty).
    pub last_error: String,
}

impl NcclError {
    /// Symbolic name of the code (`ncclInvalidArgument`, ...).
    pub fn code_name(&self) -> &'static str {
        result_name(self.code)
    }
}

/// Symbolic name of an `ncclResult_t` code.
pub fn result_name(code: u32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "unknown ncclResult_t",
    }
}

impl fmt::Display for NcclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} failed: {} ({})",
            self.call,
            self.code_name(),
            self.code
        )?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        if !self.last_error.is_empty() {
            write!(f, "; last NCCL error: {}", self.last_error)?;
        }
        Ok(())
    }
}

impl std::error::Error for NcclError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_carries_code_and_texts() {
        let e = NcclError {
            call: "ncclAllReduce",
            code: 4,
            message: "invalid argument".into(),
            last_error: "Invalid buffer".into(),
        };
        assert_eq!(
            e.to_string(),
            "ncclAllReduce failed: ncclInvalidArgument (4): invalid argument; last NCCL error: \
             Invalid buffer"
        );
        assert_eq!(result_name(99), "unknown ncclResult_t");
    }
}
