//! Source locations of IR entities parsed from text.

use std::fmt;

/// A line and column (both 1-based) in a text program.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Span {
    /// 1-based line.
    pub line: u32,
    /// 1-based column, counted in characters.
    pub col: u32,
}

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.col)
    }
}

/// Where an entity came from: a [`Span`] when it was parsed from text, `None` when it was built
/// by the API or created by a pass.
///
/// `SourceLoc` is metadata, not part of a program's meaning: **any two `SourceLoc`s compare
/// equal**, so structural equality of programs (`parse(print(p)) == p`) ignores where the text
/// came from.
#[derive(Copy, Clone, Debug, Default, Eq)]
pub struct SourceLoc(pub Option<Span>);

impl SourceLoc {
    /// No location (built by the API or a pass).
    pub const NONE: SourceLoc = SourceLoc(None);

    /// A location at `line:col`.
    pub fn at(line: u32, col: u32) -> SourceLoc {
        SourceLoc(Some(Span { line, col }))
    }

    /// The span, if any.
    pub fn span(self) -> Option<Span> {
        self.0
    }
}

impl PartialEq for SourceLoc {
    fn eq(&self, _other: &SourceLoc) -> bool {
        true
    }
}

impl std::hash::Hash for SourceLoc {
    /// Hashes nothing, consistent with [`PartialEq`]: all locations are equal.
    fn hash<H: std::hash::Hasher>(&self, _state: &mut H) {}
}

impl fmt::Display for SourceLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(span) => write!(f, "{span}"),
            None => f.write_str("<built>"),
        }
    }
}
