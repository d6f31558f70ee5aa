//! The text formats of both IR levels: printers and parsers.
//!
//! See the crate documentation for the grammar. Printing is canonical: parsing printed text and
//! printing it again gives the same bytes, and `parse(print(p)) == p`.

mod print_host;
mod print_program;

pub use print_host::{inst_to_string, write_host};
pub use print_program::write_program;

/// Words that cannot be used as names of meshes, tensors or programs.
pub const KEYWORDS: &[&str] = &[
    "program",
    "host",
    "mesh",
    "input",
    "tensor",
    "output",
    "param",
    "in",
    "out",
    "on",
    "for",
    "rank",
    "my",
    "worker",
    "slice",
    "devices",
    "iota",
    "wait",
    "allocate",
    "deallocate",
    "synchronize",
    "set_current_stream",
    "get_current_stream",
    "start_coalescing",
    "end_coalescing",
];

/// True when `name` can name a mesh, tensor or program: an identifier
/// (`[A-Za-z_][A-Za-z0-9_]*`) that is not a keyword.
pub fn is_valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_') && !KEYWORDS.contains(&name)
}
