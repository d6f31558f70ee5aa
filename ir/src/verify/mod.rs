//! Verifiers for both IR levels. Each collects **every** error it finds, with its location.

mod host;
mod host_compute;
mod host_compute_ops;
mod host_lifetimes;
mod host_ops;
mod names;
mod program;

use std::fmt;

use crate::span::SourceLoc;

/// What a diagnostic is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// The program as a whole.
    Program,
    /// A mesh declaration.
    Mesh {
        /// The mesh's name.
        name: String,
        /// Where it was declared.
        loc: SourceLoc,
    },
    /// A tensor declaration.
    Tensor {
        /// The tensor's name.
        name: String,
        /// Where it was declared.
        loc: SourceLoc,
    },
    /// A level-1 op.
    Op {
        /// Index in [`crate::Program::ops`].
        index: usize,
        /// The op's name.
        name: &'static str,
        /// Where it was written.
        loc: SourceLoc,
    },
    /// A host instruction.
    Inst {
        /// Indices from the top-level block down to the instruction (through loop bodies).
        path: Vec<usize>,
        /// The instruction printed on one line.
        text: String,
        /// Where it was written.
        loc: SourceLoc,
    },
}

impl Location {
    /// The source location, when the entity was parsed from text.
    pub fn loc(&self) -> SourceLoc {
        match self {
            Location::Program => SourceLoc::NONE,
            Location::Mesh { loc, .. }
            | Location::Tensor { loc, .. }
            | Location::Op { loc, .. }
            | Location::Inst { loc, .. } => *loc,
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(span) = self.loc().span() {
            write!(f, "{span}: ")?;
        }
        match self {
            Location::Program => f.write_str("program"),
            Location::Mesh { name, .. } => write!(f, "mesh `{name}`"),
            Location::Tensor { name, .. } => write!(f, "tensor `{name}`"),
            Location::Op { index, name, .. } => write!(f, "op #{index} `{name}`"),
            Location::Inst { text, .. } => write!(f, "`{text}`"),
        }
    }
}

/// One verifier error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// Where.
    pub location: Location,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = format!("{}: {}", self.location, self.message);
        f.write_str(&crate::text::clip_tokens(&text))
    }
}

/// Every error a verifier found (never empty when returned as an error).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct VerifyErrors(pub Vec<Diagnostic>);

impl fmt::Display for VerifyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

fn result(diags: Vec<Diagnostic>) -> Result<(), VerifyErrors> {
    if diags.is_empty() {
        Ok(())
    } else {
        Err(VerifyErrors(diags))
    }
}

/// Verifies a level-1 program and reports every error found.
///
/// Checks names (valid, not keywords, unique across meshes and tensors), handles, that every
/// non-input tensor is defined by exactly one op before it is read, op arity and declared
/// types against [`crate::program::infer_output_types`], schedules (replay, layout, device
/// parallel types against the mesh, swizzles), that an op's outputs share one mesh (its
/// inputs may live elsewhere: the passes insert the transfers), and the output list.
pub fn verify_program(program: &crate::Program) -> Result<(), VerifyErrors> {
    result(program::check(program))
}

/// Verifies a host program and reports every error found.
///
/// Checks names and handles; buffer lifetimes (`allocate` before use, no use after
/// `deallocate`, allocations inside a loop body freed in it); views (`shard_by_stream` shapes,
/// used only after their `shard_by_stream` and inside its block); loop, stream and
/// communication variables (scoping, unique labels, every `wait` after its communication in
/// the same or an enclosing block); coalescing groups; teams, roots, reduction operators and
/// buffer sizes of communications; MoE and compute op shapes and dtypes; and `my(mesh, pt)`.
pub fn verify_host(program: &crate::HostProgram) -> Result<(), VerifyErrors> {
    result(host::check(program))
}
