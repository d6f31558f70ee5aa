//! The front door: [`compile`] a level-1 program with [`Options`] into a [`Compiled`] host
//! program, or load host IR text ([`Compiled::from_host_text`]). The command line and the
//! embedding API both come in here, with the same options.
//!
//! - [`options`]: [`Options`] (the job size, parameters, the pass options that
//!   [`PassContext`](meshflow_passes::PassContext) borrows, the cross-rank check) and
//!   [`parse`].
//! - [`compiled`]: [`compile`] and what it produces.
//! - [`load`]: level-1 or host IR text, recognised by its content ([`format_of`]).
//! - [`agree`]: ranks in separate processes agree on the machine profile before lowering and
//!   check that they lowered the same program before the first step.

pub mod agree;
pub mod compiled;
pub mod options;

pub use compiled::{compile, Compiled, TensorInfo};
pub use options::{parse, Options};

use crate::error::Error;

/// The two text formats of programs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Format {
    /// A level-1 program (`program NAME { ... }`, usually `.mf`).
    Program,
    /// A host program (`host NAME { ... }`, usually `.mfh`: what `meshflow lower` prints).
    Host,
}

/// The format of program text, from its first word after blank lines and `#` comments:
/// `program` or `host`; `None` for anything else (the file extension plays no part).
pub fn format_of(text: &str) -> Option<Format> {
    let first = text
        .lines()
        .map(str::trim_start)
        .find(|l| !l.is_empty() && !l.starts_with('#'))?;
    let word: String = first
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    match word.as_str() {
        "program" => Some(Format::Program),
        "host" => Some(Format::Host),
        _ => None,
    }
}

/// Compiles level-1 program text, or loads host IR text ([`Compiled::from_host_text`]), as
/// [`format_of`] recognises it (text in neither format is parsed as level 1, whose parser
/// then says what it expected). Host IR has no parameters: [`Options::param`]s are refused
/// for it ([`Error::HostParams`]); its job size comes from [`Options::for_ranks`] or its
/// meshes, and the pass options do not apply (nothing is lowered).
pub fn load(text: &str, options: &Options) -> Result<Compiled, Error> {
    match format_of(text) {
        Some(Format::Host) => {
            if !options.params().is_empty() {
                return Err(Error::HostParams {
                    params: options.params().keys().cloned().collect(),
                });
            }
            Compiled::from_host_text(text, options)
        }
        Some(Format::Program) | None => {
            let program = parse(text, options)?;
            meshflow_ir::verify_program(&program)?;
            compile(&program, options)
        }
    }
}
