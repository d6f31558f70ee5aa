//! The error type of every pass.

use meshflow_ir::program::{LayoutError, ScheduleError};
use meshflow_ir::VerifyErrors;

/// Why a pass (or the pass manager) failed. Every variant names what it is about: the tensor,
/// the op or the pass, and the reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PassError {
    /// A tensor whose sharding (or use) the passes cannot handle.
    #[error("tensor `{tensor}`: {reason}")]
    UnsupportedTensor {
        /// The tensor's name.
        tensor: String,
        /// Why.
        reason: String,
    },
    /// An op the passes cannot handle.
    #[error("op #{index} `{text}`: {reason}")]
    UnsupportedOp {
        /// Index of the op in the level-1 program.
        index: usize,
        /// The op printed as `y = linear(x, w)`.
        text: String,
        /// Why.
        reason: String,
    },
    /// A tensor's schedule cannot be replayed.
    #[error("tensor `{tensor}`: {source}")]
    Schedule {
        /// The tensor's name.
        tensor: String,
        /// The replay error.
        source: ScheduleError,
    },
    /// A tensor's schedule has no supported layout.
    #[error("tensor `{tensor}`: {source}")]
    Layout {
        /// The tensor's name.
        tensor: String,
        /// The layout error.
        source: LayoutError,
    },
    /// The IR did not verify after a pass.
    #[error("the IR does not verify after pass `{pass}`:\n{errors}")]
    Verify {
        /// The pass that ran last.
        pass: String,
        /// The verifier's diagnostics.
        errors: VerifyErrors,
    },
    /// A pass name that is not in the pipeline.
    #[error("unknown pass `{name}`; valid passes: {valid}")]
    UnknownPass {
        /// The name given.
        name: String,
        /// The valid names, comma separated.
        valid: String,
    },
    /// A pass that must always run was asked to be disabled.
    #[error("pass `{name}` cannot be disabled: {reason}")]
    CannotDisable {
        /// The pass.
        name: String,
        /// Why it must run.
        reason: String,
    },
    /// An invalid option value.
    #[error("invalid option: {0}")]
    Options(String),
    /// A broken internal invariant (a bug in a pass, never the user's input).
    #[error("internal error in pass `{pass}`: {message}")]
    Internal {
        /// The pass.
        pass: &'static str,
        /// What went wrong.
        message: String,
    },
}

impl PassError {
    /// An [`PassError::UnsupportedTensor`].
    pub fn tensor(tensor: impl Into<String>, reason: impl Into<String>) -> PassError {
        PassError::UnsupportedTensor {
            tensor: tensor.into(),
            reason: reason.into(),
        }
    }

    /// An [`PassError::UnsupportedOp`] for op `index` of `program`.
    pub fn op(
        program: &meshflow_ir::Program,
        index: usize,
        reason: impl Into<String>,
    ) -> PassError {
        PassError::UnsupportedOp {
            index,
            text: program
                .ops
                .get(index)
                .map_or_else(|| format!("#{index}"), |op| op_text(program, op)),
            reason: reason.into(),
        }
    }

    /// An [`PassError::Internal`].
    pub fn internal(pass: &'static str, message: impl Into<String>) -> PassError {
        PassError::Internal {
            pass,
            message: message.into(),
        }
    }
}

/// Prints an op as `y = linear(x, w)` (names resolved in `program`).
pub fn op_text(program: &meshflow_ir::Program, op: &meshflow_ir::Op) -> String {
    let name = |t: meshflow_ir::TensorId| {
        program
            .tensors
            .get(t)
            .map_or_else(|| format!("{t:?}"), |d| d.name.clone())
    };
    let outs: Vec<String> = op.outputs.iter().map(|&t| name(t)).collect();
    let ins: Vec<String> = op.inputs.iter().map(|&t| name(t)).collect();
    let attrs = op.kind.attributes();
    let extra = if attrs.is_empty() {
        String::new()
    } else {
        format!(", {attrs}")
    };
    format!(
        "{} = {}({}{extra})",
        outs.join(", "),
        op.kind.name(),
        ins.join(", ")
    )
}
