//! A token cursor with the helpers both parsers share: lookahead, `expect_*`, error building
//! and name tables.

use std::collections::HashMap;

use super::lexer::{lex, Pos, Tok, Token};
use super::ParseError;

/// The deepest nesting of expressions, mesh lists and loops the parsers accept.
pub(crate) const MAX_DEPTH: usize = 64;

/// Builds a parse error at `pos`.
pub(crate) fn error_at(pos: Pos, message: impl Into<String>) -> ParseError {
    ParseError {
        line: pos.line,
        col: pos.col,
        message: message.into(),
    }
}

/// A cursor over the tokens of one text.
pub(crate) struct Cursor {
    toks: Vec<Token>,
    at: usize,
    eof: Token,
}

impl Cursor {
    pub fn new(text: &str) -> Cursor {
        let toks = lex(text);
        let eof = toks.last().cloned().unwrap_or(Token {
            tok: Tok::Eof,
            pos: Pos { line: 1, col: 1 },
        });
        Cursor { toks, at: 0, eof }
    }

    /// The token `n` places ahead (the last token when past the end).
    pub fn peek_at(&self, n: usize) -> &Token {
        self.toks
            .get(self.at.saturating_add(n))
            .unwrap_or(&self.eof)
    }

    /// The current token.
    pub fn peek(&self) -> &Token {
        self.peek_at(0)
    }

    /// The current token's position.
    pub fn pos(&self) -> Pos {
        self.peek().pos
    }

    /// Moves past the current token and returns it (stays on the final token).
    pub fn bump(&mut self) -> Token {
        let t = self.peek().clone();
        if self.at < self.toks.len().saturating_sub(1) {
            self.at += 1;
        }
        t
    }

    /// True when the token `n` places ahead is the punctuation `p`.
    pub fn is_punct_at(&self, n: usize, p: &str) -> bool {
        matches!(&self.peek_at(n).tok, Tok::Punct(q) if *q == p)
    }

    /// True when the current token is the punctuation `p`.
    pub fn is_punct(&self, p: &str) -> bool {
        self.is_punct_at(0, p)
    }

    /// True when the token `n` places ahead is the identifier `word`.
    pub fn is_word_at(&self, n: usize, word: &str) -> bool {
        matches!(&self.peek_at(n).tok, Tok::Ident(s) if s == word)
    }

    /// True when the current token is the identifier `word`.
    pub fn is_word(&self, word: &str) -> bool {
        self.is_word_at(0, word)
    }

    /// The current identifier, if the current token is one.
    pub fn ident(&self) -> Option<&str> {
        match &self.peek().tok {
            Tok::Ident(s) => Some(s),
            _ => None,
        }
    }

    /// True when the current token is the keyword `word` used as a keyword: not followed by
    /// `=`, `,` or `(` (then it is an ordinary name starting an assignment or a call).
    pub fn is_keyword(&self, word: &str) -> bool {
        self.is_word(word)
            && !self.is_punct_at(1, "=")
            && !self.is_punct_at(1, ",")
            && !self.is_punct_at(1, "(")
    }

    /// Consumes the punctuation `p` if it is next.
    pub fn eat_punct(&mut self, p: &str) -> bool {
        let yes = self.is_punct(p);
        if yes {
            self.bump();
        }
        yes
    }

    /// "expected {what}, found {current token}" at the current token (or the lexer's message
    /// when the current token is invalid text).
    pub fn unexpected(&self, what: &str) -> ParseError {
        let t = self.peek();
        match &t.tok {
            Tok::Error(message) => error_at(t.pos, message.clone()),
            tok => error_at(t.pos, format!("expected {what}, found {tok}")),
        }
    }

    /// Consumes the punctuation `p` or fails.
    pub fn expect_punct(&mut self, p: &str) -> Result<Pos, ParseError> {
        if self.is_punct(p) {
            Ok(self.bump().pos)
        } else {
            Err(self.unexpected(&format!("`{p}`")))
        }
    }

    /// Consumes the identifier `word` or fails.
    pub fn expect_word(&mut self, word: &str) -> Result<Pos, ParseError> {
        if self.is_word(word) {
            Ok(self.bump().pos)
        } else {
            Err(self.unexpected(&format!("`{word}`")))
        }
    }

    /// Consumes an identifier; `what` describes it for the error ("a tensor name").
    pub fn expect_ident(&mut self, what: &str) -> Result<(String, Pos), ParseError> {
        match &self.peek().tok {
            Tok::Ident(s) => {
                let s = s.clone();
                Ok((s, self.bump().pos))
            }
            _ => Err(self.unexpected(what)),
        }
    }

    /// Consumes an unsigned integer literal.
    pub fn expect_int(&mut self, what: &str) -> Result<(u64, Pos), ParseError> {
        match self.peek().tok {
            Tok::Int(v) => Ok((v, self.bump().pos)),
            _ => Err(self.unexpected(what)),
        }
    }

    /// Consumes an unsigned integer literal that must fit a `usize`.
    pub fn expect_usize(&mut self, what: &str) -> Result<(usize, Pos), ParseError> {
        let (v, pos) = self.expect_int(what)?;
        let v = usize::try_from(v)
            .map_err(|_| error_at(pos, format!("{v} is too large for {what}")))?;
        Ok((v, pos))
    }

    /// Consumes a positive, finite float literal (an integer literal is taken as a float)
    /// that fits an `f32`: an `eps` attribute.
    pub fn expect_epsilon(&mut self) -> Result<crate::program::Epsilon, ParseError> {
        let pos = self.pos();
        let value: Option<f32> = match &self.peek().tok {
            Tok::Float(text) => text.parse().ok(),
            Tok::Int(v) => Some(*v as f32),
            _ => return Err(self.unexpected("a float literal such as `1e-6`")),
        };
        self.bump();
        value
            .and_then(crate::program::Epsilon::new)
            .ok_or_else(|| error_at(pos, "`eps` must be a positive, finite float (in f32 range)"))
    }

    /// Consumes a string literal.
    pub fn expect_str(&mut self, what: &str) -> Result<(String, Pos), ParseError> {
        match &self.peek().tok {
            Tok::Str(s) => {
                let s = s.clone();
                Ok((s, self.bump().pos))
            }
            _ => Err(self.unexpected(what)),
        }
    }

    /// Fails unless the text is over.
    pub fn expect_eof(&self) -> Result<(), ParseError> {
        if matches!(self.peek().tok, Tok::Eof) {
            Ok(())
        } else {
            Err(self.unexpected("end of input"))
        }
    }

    /// Consumes a `{prefix}N` identifier (`s0`, `c3`, `i1`) and returns `N`.
    pub fn expect_numbered(&mut self, prefix: char, what: &str) -> Result<(u32, Pos), ParseError> {
        let pos = self.pos();
        match self.ident().and_then(|s| numbered(s, prefix)) {
            Some(Ok(n)) => {
                self.bump();
                Ok((n, pos))
            }
            Some(Err(())) => Err(error_at(pos, format!("{what} number is too large"))),
            None => Err(self.unexpected(what)),
        }
    }
}

/// `Some(Ok(N))` when `s` is `{prefix}` followed by decimal digits that fit a `u32`,
/// `Some(Err(()))` when the digits overflow, `None` when `s` has another form.
pub(crate) fn numbered(s: &str, prefix: char) -> Option<Result<u32, ()>> {
    let digits = s.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(digits.parse::<u32>().map_err(|_| ()))
}

/// Names declared so far, for one kind of entity.
pub(crate) struct NameTable<Id> {
    kind: &'static str,
    names: HashMap<String, (Id, Pos)>,
}

impl<Id: Copy> NameTable<Id> {
    /// An empty table; `kind` names the entity in messages ("tensor").
    pub fn new(kind: &'static str) -> NameTable<Id> {
        NameTable {
            kind,
            names: HashMap::new(),
        }
    }

    /// Fails when `name` is already declared.
    pub fn check_new(&self, name: &str, pos: Pos) -> Result<(), ParseError> {
        match self.names.get(name) {
            Some((_, first)) => Err(error_at(
                pos,
                format!(
                    "duplicate {} `{name}` (first declared at {}:{})",
                    self.kind, first.line, first.col
                ),
            )),
            None => Ok(()),
        }
    }

    /// Records `name` (after [`NameTable::check_new`]).
    pub fn insert(&mut self, name: &str, id: Id, pos: Pos) {
        self.names.insert(name.to_string(), (id, pos));
    }

    /// The entity called `name`, or an "unknown ..." error at `pos`.
    pub fn get(&self, name: &str, pos: Pos) -> Result<Id, ParseError> {
        self.names
            .get(name)
            .map(|(id, _)| *id)
            .ok_or_else(|| error_at(pos, format!("unknown {} `{name}`", self.kind)))
    }

    /// Reads an identifier from `cur` and resolves it.
    pub fn expect(&self, cur: &mut Cursor) -> Result<(Id, Pos), ParseError> {
        let (name, pos) = cur.expect_ident(&format!("a {} name", self.kind))?;
        Ok((self.get(&name, pos)?, pos))
    }
}
