//! The lexer shared by both text formats.
//!
//! Tokens are identifiers (keywords are ordinary identifiers: the parsers decide by context),
//! unsigned decimal integers, unsigned float literals (`0.5`, `1e-6`, `2.5E+3`: digits with a
//! fraction or an exponent), string literals and punctuation. `#` starts a comment that runs
//! to the end of the line. Lines and columns are 1-based; columns count characters.
//!
//! Lexing never fails as such: an invalid character ends the token stream with an
//! [`Tok::Error`] token at that position, so a parser reports the earliest problem, whether it
//! is a syntax error before the bad character or the bad character itself.

use std::fmt;

use crate::text::{clip, MAX_NAME_LEN};

/// The longest string literal (a kernel name), in bytes.
pub(crate) const MAX_STRING_LEN: usize = 4096;

/// A position in the text: 1-based line and column (in characters).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Pos {
    pub line: u32,
    pub col: u32,
}

/// What a token is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Tok {
    /// `[A-Za-z_][A-Za-z0-9_]*`.
    Ident(String),
    /// An unsigned decimal integer literal.
    Int(u64),
    /// An unsigned float literal, as written (digits with a fraction or an exponent).
    Float(String),
    /// A string literal (escapes resolved).
    Str(String),
    /// Punctuation: `{ } ( ) [ ] , : = + - * / % -> ..`.
    Punct(&'static str),
    /// The end of the text.
    Eof,
    /// Text that is not a token; the message says why. Always the last token.
    Error(String),
}

impl fmt::Display for Tok {
    /// How a token is named in "expected X, found Y" messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Ident(s) => write!(f, "`{}`", clip(s)),
            Tok::Int(v) => write!(f, "`{v}`"),
            Tok::Float(v) => write!(f, "`{v}`"),
            Tok::Str(_) => f.write_str("a string literal"),
            Tok::Punct(p) => write!(f, "`{p}`"),
            Tok::Eof => f.write_str("end of input"),
            Tok::Error(_) => f.write_str("invalid text"),
        }
    }
}

/// A token and where it starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Token {
    pub tok: Tok,
    pub pos: Pos,
}

const PUNCT2: [&str; 2] = ["->", ".."];
const PUNCT1: [&str; 14] = [
    "{", "}", "(", ")", "[", "]", ",", ":", "=", "+", "-", "*", "/", "%",
];

struct Lexer<'a> {
    chars: std::iter::Peekable<std::str::Chars<'a>>,
    line: u32,
    col: u32,
}

impl Lexer<'_> {
    fn pos(&self) -> Pos {
        Pos {
            line: self.line,
            col: self.col,
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.chars.peek().copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.chars.next()?;
        if c == '\n' {
            self.line = self.line.saturating_add(1);
            self.col = 1;
        } else {
            self.col = self.col.saturating_add(1);
        }
        Some(c)
    }

    /// Skips whitespace and comments.
    fn skip_trivia(&mut self) {
        while let Some(c) = self.peek() {
            if c == '#' {
                while self.peek().is_some_and(|c| c != '\n') {
                    self.bump();
                }
            } else if c.is_whitespace() {
                self.bump();
            } else {
                break;
            }
        }
    }

    fn ident(&mut self) -> Tok {
        let mut s = String::new();
        while let Some(c) = self
            .peek()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        {
            s.push(c);
            self.bump();
        }
        if s.len() > MAX_NAME_LEN {
            return Tok::Error(format!(
                "identifier `{}` is {} characters long; names have at most {MAX_NAME_LEN}",
                clip(&s),
                s.len()
            ));
        }
        Tok::Ident(s)
    }

    fn int(&mut self) -> Tok {
        let mut value: Option<u64> = Some(0);
        let mut digits = String::new();
        while let Some(c) = self.peek().filter(char::is_ascii_digit) {
            digits.push(c);
            let d = u64::from(c as u8 - b'0');
            value = value
                .and_then(|v| v.checked_mul(10))
                .and_then(|v| v.checked_add(d));
            self.bump();
        }
        if let Some(float) = self.float_tail(&digits) {
            return float;
        }
        match value {
            Some(v) => Tok::Int(v),
            None => Tok::Error(format!(
                "integer literal {} is too large (the largest is {})",
                shorten(&digits),
                u64::MAX
            )),
        }
    }

    /// The fraction and exponent of a float literal whose integer digits were `digits`, if
    /// the text goes on with `.DIGIT` or `e[+-]DIGIT` (so `0..4` stays a range).
    fn float_tail(&mut self, digits: &str) -> Option<Tok> {
        let digit_at = |n: usize, chars: &std::iter::Peekable<std::str::Chars<'_>>| {
            chars.clone().nth(n).is_some_and(|c| c.is_ascii_digit())
        };
        let exponent_ahead = |chars: &std::iter::Peekable<std::str::Chars<'_>>| {
            let mut it = chars.clone();
            match (it.next(), it.next(), it.next()) {
                (Some('e' | 'E'), Some(c), _) if c.is_ascii_digit() => true,
                (Some('e' | 'E'), Some('+' | '-'), Some(c)) => c.is_ascii_digit(),
                _ => false,
            }
        };
        let fraction = self.peek() == Some('.') && digit_at(1, &self.chars);
        if !fraction && !exponent_ahead(&self.chars) {
            return None;
        }
        let mut text = digits.to_string();
        if fraction {
            text.push('.');
            self.bump();
            while let Some(c) = self.peek().filter(char::is_ascii_digit) {
                text.push(c);
                self.bump();
            }
        }
        if exponent_ahead(&self.chars) {
            for _ in 0..2 {
                if let Some(c) = self.bump() {
                    text.push(c);
                }
            }
            while let Some(c) = self.peek().filter(char::is_ascii_digit) {
                text.push(c);
                self.bump();
            }
        }
        Some(Tok::Float(text))
    }

    /// A string literal; the opening quote is the current character.
    fn string(&mut self) -> Result<Tok, (Pos, String)> {
        let start = self.pos();
        self.bump();
        let mut s = String::new();
        loop {
            let here = self.pos();
            match self.bump() {
                None | Some('\n') => {
                    return Err((start, "unterminated string literal".to_string()));
                }
                Some('"') => return Ok(Tok::Str(s)),
                Some('\\') => s.push(self.escape(here)?),
                Some(c) => s.push(c),
            }
            if s.len() > MAX_STRING_LEN {
                return Err((
                    start,
                    format!("string literal is longer than {MAX_STRING_LEN} characters"),
                ));
            }
        }
    }

    /// One escape sequence after a backslash at `at` (those `str::escape_default` writes,
    /// plus `\0`).
    fn escape(&mut self, at: Pos) -> Result<char, (Pos, String)> {
        let bad = |what: String| (at, what);
        match self.bump() {
            Some('n') => Ok('\n'),
            Some('t') => Ok('\t'),
            Some('r') => Ok('\r'),
            Some('0') => Ok('\0'),
            Some(c @ ('\\' | '"' | '\'')) => Ok(c),
            Some('u') => {
                if self.bump() != Some('{') {
                    return Err(bad("expected `{` after `\\u`".into()));
                }
                let mut hex = String::new();
                loop {
                    match self.bump() {
                        Some('}') => break,
                        Some(c) if c.is_ascii_hexdigit() && hex.len() < 6 => hex.push(c),
                        _ => {
                            return Err(bad(
                                "invalid unicode escape (expected `\\u{` 1 to 6 hex digits `}`)"
                                    .into(),
                            ))
                        }
                    }
                }
                u32::from_str_radix(&hex, 16)
                    .ok()
                    .and_then(char::from_u32)
                    .ok_or_else(|| bad(format!("`\\u{{{hex}}}` is not a unicode scalar value")))
            }
            Some(c) => Err(bad(format!(
                "unknown escape `\\{}` in string literal",
                c.escape_debug()
            ))),
            None => Err(bad("unterminated string literal".into())),
        }
    }

    fn punct(&mut self, c: char) -> Option<&'static str> {
        self.bump();
        if let Some(next) = self.peek() {
            let two: String = [c, next].iter().collect();
            if let Some(p) = PUNCT2.iter().find(|p| **p == two) {
                self.bump();
                return Some(p);
            }
        }
        PUNCT1.iter().find(|p| p.starts_with(c)).copied()
    }
}

/// A long digit string cut for a message.
fn shorten(digits: &str) -> String {
    if digits.len() > 30 {
        format!("`{}...` ({} digits)", &digits[..20], digits.len())
    } else {
        format!("`{digits}`")
    }
}

/// Splits `text` into tokens. The result always ends with [`Tok::Eof`] or [`Tok::Error`].
pub(crate) fn lex(text: &str) -> Vec<Token> {
    let mut lx = Lexer {
        chars: text.chars().peekable(),
        line: 1,
        col: 1,
    };
    let mut out = Vec::new();
    loop {
        lx.skip_trivia();
        let pos = lx.pos();
        let Some(c) = lx.peek() else {
            out.push(Token { tok: Tok::Eof, pos });
            return out;
        };
        let tok = if c.is_ascii_alphabetic() || c == '_' {
            lx.ident()
        } else if c.is_ascii_digit() {
            lx.int()
        } else if c == '"' {
            match lx.string() {
                Ok(t) => t,
                Err((pos, message)) => {
                    out.push(Token {
                        tok: Tok::Error(message),
                        pos,
                    });
                    return out;
                }
            }
        } else {
            match lx.punct(c) {
                Some(p) => Tok::Punct(p),
                None => Tok::Error(format!("unexpected character `{}`", c.escape_debug())),
            }
        };
        let stop = matches!(tok, Tok::Error(_));
        out.push(Token { tok, pos });
        if stop {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(text: &str) -> Vec<Tok> {
        lex(text).into_iter().map(|t| t.tok).collect()
    }

    #[test]
    fn lexes_ranges_arrows_and_comments() {
        assert_eq!(
            toks("for i0 in 0..4 # c\n a -> b"),
            vec![
                Tok::Ident("for".into()),
                Tok::Ident("i0".into()),
                Tok::Ident("in".into()),
                Tok::Int(0),
                Tok::Punct(".."),
                Tok::Int(4),
                Tok::Ident("a".into()),
                Tok::Punct("->"),
                Tok::Ident("b".into()),
                Tok::Eof,
            ]
        );
    }

    #[test]
    fn strings_and_errors() {
        assert_eq!(
            toks(r#""a\"\u{e9}\n""#),
            vec![Tok::Str("a\"\u{e9}\n".into()), Tok::Eof]
        );
        let t = lex("x\n  @");
        assert_eq!(t[1].pos, Pos { line: 2, col: 3 });
        assert!(matches!(t[1].tok, Tok::Error(_)));
        assert!(matches!(
            lex("99999999999999999999999")[0].tok,
            Tok::Error(_)
        ));
        assert!(matches!(lex(". x")[0].tok, Tok::Error(_)));
    }

    #[test]
    fn floats_need_a_fraction_or_an_exponent() {
        assert_eq!(
            toks("1e-6 0.5 2.5E+3 3 0..2 4e x"),
            vec![
                Tok::Float("1e-6".into()),
                Tok::Float("0.5".into()),
                Tok::Float("2.5E+3".into()),
                Tok::Int(3),
                Tok::Int(0),
                Tok::Punct(".."),
                Tok::Int(2),
                Tok::Int(4),
                Tok::Ident("e".into()),
                Tok::Ident("x".into()),
                Tok::Eof,
            ]
        );
    }
}
