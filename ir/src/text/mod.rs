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

/// The longest name (identifier) the text formats and the verifiers accept, in characters.
pub const MAX_NAME_LEN: usize = 256;

/// Tokens of error messages longer than this many characters are shortened by [`clip`].
pub const MAX_SHOWN_LEN: usize = 64;

/// `text` as an error message shows it: unchanged when short, else its first characters,
/// `...` and its length (so a 10 MB identifier is never echoed whole).
pub fn clip(text: &str) -> std::borrow::Cow<'_, str> {
    let n = text.chars().count();
    if n <= MAX_SHOWN_LEN {
        return std::borrow::Cow::Borrowed(text);
    }
    let head: String = text.chars().take(MAX_SHOWN_LEN / 2).collect();
    std::borrow::Cow::Owned(format!("{head}... ({n} characters)"))
}

/// `message` with every whitespace-separated token longer than [`MAX_SHOWN_LEN`]
/// characters shortened by [`clip`]: the last line of defence of the error types, whatever
/// an embedder named its tensors.
pub fn clip_tokens(message: &str) -> std::borrow::Cow<'_, str> {
    let long = message
        .split_whitespace()
        .any(|t| t.len() > MAX_SHOWN_LEN && t.chars().count() > MAX_SHOWN_LEN);
    if !long {
        return std::borrow::Cow::Borrowed(message);
    }
    let mut out = String::with_capacity(message.len().min(4096));
    let mut token = String::new();
    let flush = |token: &mut String, out: &mut String| {
        out.push_str(&clip(token));
        token.clear();
    };
    for c in message.chars() {
        if c.is_whitespace() {
            flush(&mut token, &mut out);
            out.push(c);
        } else {
            token.push(c);
        }
    }
    flush(&mut token, &mut out);
    std::borrow::Cow::Owned(out)
}

/// True when `name` can name a mesh, tensor or program: an identifier
/// (`[A-Za-z_][A-Za-z0-9_]*`) that is not a keyword.
pub fn is_valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_') && !KEYWORDS.contains(&name)
}
