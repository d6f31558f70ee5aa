//! Parsers for both text formats. Every error carries a line and column.
//!
//! The parsers accept everything the printers ([`crate::text`]) print and rebuild an equal
//! program. They also accept non-canonical text: comments (`#` to the end of the line), any
//! whitespace, and in level-1 text `param`s and integer expressions wherever a number goes.
//! Keywords are contextual: a tensor may be called `input` or `wait` (the verifier reports
//! names that are keywords). Every entity parsed gets the location of its line's first token.
//! Parsing never panics: expression, mesh and loop nesting are capped.

mod cursor;
mod expr;
mod host;
mod host_calls;
mod lexer;
mod mesh;
mod moe_wire;
mod program;

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::host::HostProgram;
use crate::program::Program;

/// Integer parameter values that override a level-1 program's `param` defaults.
pub type Params = BTreeMap<String, i64>;

/// A parse error at a line and column (both 1-based).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ParseError {
    /// 1-based line.
    pub line: u32,
    /// 1-based column.
    pub col: u32,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let message = crate::text::clip_tokens(&self.message);
        write!(f, "{}:{}: {message}", self.line, self.col)
    }
}

/// Parses a level-1 program, with parameters at their defaults.
pub fn parse_program(text: &str) -> Result<Program, ParseError> {
    parse_program_with(text, &Params::new())
}

/// Parses a level-1 program, overriding parameter defaults with `params`.
///
/// Later parameters are computed from overridden earlier ones (`param d = ranks / 2` follows
/// an override of `ranks`). Overriding a parameter the program does not declare is an error
/// that lists the declared ones.
pub fn parse_program_with(text: &str, params: &Params) -> Result<Program, ParseError> {
    program::parse(text, params)
}

/// Parses a host program.
pub fn parse_host(text: &str) -> Result<HostProgram, ParseError> {
    host::parse(text)
}

impl FromStr for Program {
    type Err = ParseError;
    /// Parses a level-1 program with parameters at their defaults ([`parse_program`]).
    fn from_str(text: &str) -> Result<Program, ParseError> {
        parse_program(text)
    }
}

impl FromStr for HostProgram {
    type Err = ParseError;
    /// Parses a host program ([`parse_host`]).
    fn from_str(text: &str) -> Result<HostProgram, ParseError> {
        parse_host(text)
    }
}
