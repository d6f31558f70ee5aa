//! Integer expressions of both text formats.
//!
//! Both levels share one syntax: integer literals (a `-` directly before a literal makes a
//! negative literal), names, `my(MESH, PT)`, `min(a, b)`, `max(a, b)`, parentheses and
//! `+ - * / %` with the usual precedence, left-associative. The parser builds a [`PExpr`] tree; level 1 evaluates it
//! against its parameters ([`Params`]), the host parser converts it to an [`Expr`].

use super::cursor::{error_at, numbered, Cursor, NameTable, MAX_DEPTH};
use super::lexer::{Pos, Tok};
use super::ParseError;
use crate::host::{BinOp, Expr, LoopVar};
use crate::mesh::ParallelType;
use crate::program::MeshId;

/// A parsed expression, before evaluation or conversion.
#[derive(Clone, Debug)]
pub(crate) struct PExpr {
    pub kind: PKind,
    /// Where the expression starts (for a binary operation: where its operator is).
    pub pos: Pos,
    /// Nodes in the tree (bounded by [`MAX_TERMS`]).
    pub size: usize,
}

/// The most operators and operands one expression may have. Trees are walked recursively
/// (printing, evaluation, dropping), so their size is bounded as well as their nesting.
pub(crate) const MAX_TERMS: usize = 1024;

#[derive(Clone, Debug)]
pub(crate) enum PKind {
    /// A literal (negative when written `-N`).
    Lit(i128),
    /// A name: a parameter (level 1), a loop variable or `rank` (host).
    Name(String),
    /// `my(MESH, PT)`.
    My {
        mesh: String,
        mesh_pos: Pos,
        pt: ParallelType,
    },
    /// `-(e)`: a negation of something other than a literal.
    Neg(Box<PExpr>),
    Bin(BinOp, Box<PExpr>, Box<PExpr>),
}

impl PExpr {
    /// The position of the expression's first token.
    pub fn start(&self) -> Pos {
        match &self.kind {
            PKind::Bin(_, a, _) => a.start(),
            _ => self.pos,
        }
    }

    /// Names read by the expression, in order of first appearance.
    pub fn names(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let mut stack = vec![self];
        while let Some(e) = stack.pop() {
            match &e.kind {
                PKind::Name(n) => {
                    if !out.contains(n) {
                        out.push(n.clone());
                    }
                }
                PKind::Neg(a) => stack.push(a),
                PKind::Bin(_, a, b) => {
                    stack.push(b);
                    stack.push(a);
                }
                PKind::Lit(_) | PKind::My { .. } => {}
            }
        }
        out
    }
}

/// Parses an expression at the cursor.
pub(crate) fn parse_expr(cur: &mut Cursor) -> Result<PExpr, ParseError> {
    parse_sum(cur, 0)
}

fn bin_op(cur: &Cursor, ops: &[(&str, BinOp)]) -> Option<BinOp> {
    ops.iter().find(|(s, _)| cur.is_punct(s)).map(|&(_, op)| op)
}

fn make_bin(op: BinOp, a: PExpr, b: PExpr, pos: Pos) -> Result<PExpr, ParseError> {
    // Nesting (parentheses, negations) is capped where it is parsed; the size cap keeps a
    // long flat sum's left-deep tree small enough for recursive printing, evaluation and
    // dropping.
    let size = a.size + b.size + 1;
    if size > MAX_TERMS {
        return Err(error_at(
            pos,
            format!("expression is too long (more than {MAX_TERMS} operators and operands)"),
        ));
    }
    Ok(PExpr {
        kind: PKind::Bin(op, Box::new(a), Box::new(b)),
        pos,
        size,
    })
}

fn parse_sum(cur: &mut Cursor, depth: usize) -> Result<PExpr, ParseError> {
    let mut lhs = parse_product(cur, depth)?;
    while let Some(op) = bin_op(cur, &[("+", BinOp::Add), ("-", BinOp::Sub)]) {
        let pos = cur.bump().pos;
        let rhs = parse_product(cur, depth)?;
        lhs = make_bin(op, lhs, rhs, pos)?;
    }
    Ok(lhs)
}

fn parse_product(cur: &mut Cursor, depth: usize) -> Result<PExpr, ParseError> {
    let mut lhs = parse_primary(cur, depth)?;
    while let Some(op) = bin_op(
        cur,
        &[("*", BinOp::Mul), ("/", BinOp::Div), ("%", BinOp::Mod)],
    ) {
        let pos = cur.bump().pos;
        let rhs = parse_primary(cur, depth)?;
        lhs = make_bin(op, lhs, rhs, pos)?;
    }
    Ok(lhs)
}

fn parse_primary(cur: &mut Cursor, depth: usize) -> Result<PExpr, ParseError> {
    let pos = cur.pos();
    if depth >= MAX_DEPTH {
        return Err(error_at(
            pos,
            format!("expression is nested too deeply (more than {MAX_DEPTH} levels)"),
        ));
    }
    match cur.peek().tok.clone() {
        Tok::Int(v) => {
            cur.bump();
            Ok(PExpr {
                kind: PKind::Lit(i128::from(v)),
                pos,
                size: 1,
            })
        }
        Tok::Punct("-") => {
            cur.bump();
            if let Tok::Int(v) = cur.peek().tok {
                cur.bump();
                return Ok(PExpr {
                    kind: PKind::Lit(-i128::from(v)),
                    pos,
                    size: 1,
                });
            }
            let inner = parse_primary(cur, depth + 1)?;
            Ok(PExpr {
                size: inner.size + 1,
                kind: PKind::Neg(Box::new(inner)),
                pos,
            })
        }
        Tok::Punct("(") => {
            cur.bump();
            let inner = parse_sum(cur, depth + 1)?;
            cur.expect_punct(")")?;
            Ok(inner)
        }
        Tok::Ident(name) if (name == "min" || name == "max") && cur.is_punct_at(1, "(") => {
            let op = if name == "min" {
                BinOp::Min
            } else {
                BinOp::Max
            };
            cur.bump();
            cur.bump();
            let a = parse_sum(cur, depth + 1)?;
            cur.expect_punct(",")?;
            let b = parse_sum(cur, depth + 1)?;
            cur.expect_punct(")")?;
            make_bin(op, a, b, pos)
        }
        Tok::Ident(name) if name == "my" && cur.is_punct_at(1, "(") => {
            cur.bump();
            cur.bump();
            let (mesh, mesh_pos) = cur.expect_ident("a mesh name")?;
            cur.expect_punct(",")?;
            let pt = parse_parallel_type(cur)?;
            cur.expect_punct(")")?;
            Ok(PExpr {
                kind: PKind::My { mesh, mesh_pos, pt },
                pos,
                size: 1,
            })
        }
        Tok::Ident(name) => {
            cur.bump();
            Ok(PExpr {
                kind: PKind::Name(name),
                pos,
                size: 1,
            })
        }
        _ => Err(cur.unexpected("an integer expression")),
    }
}

/// Parses a parallel type name (`DIDx`, ..., `Serial`).
pub(crate) fn parse_parallel_type(cur: &mut Cursor) -> Result<ParallelType, ParseError> {
    let (name, pos) = cur.expect_ident("a parallel type")?;
    name.parse::<ParallelType>()
        .map_err(|e| error_at(pos, e.to_string()))
}

/// Level-1 parameter values in declaration order.
pub(crate) type ParamValues = Vec<(String, i128)>;

fn param_value(params: &ParamValues, name: &str) -> Option<i128> {
    params.iter().find(|(n, _)| n == name).map(|&(_, v)| v)
}

/// " (d = 0, tp = 2)" for the parameters `e` reads, or "" when it reads none.
pub(crate) fn param_note(e: &PExpr, params: &ParamValues) -> String {
    let parts: Vec<String> = e
        .names()
        .iter()
        .filter_map(|n| param_value(params, n).map(|v| format!("{n} = {v}")))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

/// Evaluates a level-1 expression against the parameters declared so far.
pub(crate) fn eval(e: &PExpr, params: &ParamValues) -> Result<i128, ParseError> {
    match &e.kind {
        PKind::Lit(v) => Ok(*v),
        PKind::Name(n) => param_value(params, n).ok_or_else(|| {
            error_at(
                e.pos,
                if params.is_empty() {
                    format!("unknown parameter `{n}` (no parameters are declared)")
                } else {
                    let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
                    format!("unknown parameter `{n}` (declared: {})", names.join(", "))
                },
            )
        }),
        PKind::My { .. } => Err(error_at(
            e.pos,
            "`my(...)` is only allowed in host programs",
        )),
        PKind::Neg(a) => eval(a, params)?
            .checked_neg()
            .ok_or_else(|| error_at(e.pos, "integer overflow")),
        PKind::Bin(op, a, b) => {
            let (x, y) = (eval(a, params)?, eval(b, params)?);
            let v = match op {
                BinOp::Add => x.checked_add(y),
                BinOp::Sub => x.checked_sub(y),
                BinOp::Mul => x.checked_mul(y),
                BinOp::Div | BinOp::Mod if y == 0 => {
                    return Err(error_at(
                        e.pos,
                        format!("division by zero{}", param_note(b, params)),
                    ));
                }
                BinOp::Div => x.checked_div_euclid(y),
                BinOp::Mod => x.checked_rem_euclid(y),
                BinOp::Min => Some(x.min(y)),
                BinOp::Max => Some(x.max(y)),
            };
            v.filter(|v| v.unsigned_abs() <= u128::from(u64::MAX))
                .ok_or_else(|| {
                    error_at(e.pos, format!("integer overflow{}", param_note(e, params)))
                })
        }
    }
}

/// Converts a parsed expression to a host [`Expr`], resolving mesh names.
pub(crate) fn to_host_expr(e: &PExpr, meshes: &NameTable<MeshId>) -> Result<Expr, ParseError> {
    match &e.kind {
        PKind::Lit(v) => i64::try_from(*v)
            .map(Expr::Const)
            .map_err(|_| error_at(e.pos, format!("integer {v} does not fit in 64 bits"))),
        PKind::Name(n) if n == "rank" => Ok(Expr::Rank),
        PKind::Name(n) => match numbered(n, 'i') {
            Some(Ok(k)) => Ok(Expr::Loop(LoopVar(k))),
            Some(Err(())) => Err(error_at(e.pos, format!("loop variable `{n}` is too large"))),
            None => Err(error_at(
                e.pos,
                format!(
                    "unknown name `{n}` in an expression (expected a loop variable such as \
                     `i0`, `rank` or `my(mesh, pt)`)"
                ),
            )),
        },
        PKind::My { mesh, mesh_pos, pt } => Ok(Expr::MyIndex {
            mesh: meshes.get(mesh, *mesh_pos)?,
            pt: *pt,
        }),
        PKind::Neg(_) => Err(error_at(
            e.pos,
            "unary minus applies only to integer literals in host expressions",
        )),
        PKind::Bin(op, a, b) => Ok(Expr::Bin(
            *op,
            Box::new(to_host_expr(a, meshes)?),
            Box::new(to_host_expr(b, meshes)?),
        )),
    }
}
