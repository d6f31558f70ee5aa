//! Pure scalar expressions of the host IR.
//!
//! Expressions are trees over integer constants, loop indices, `my(mesh, pt)` (this device's
//! team index along `pt` in `mesh`) and `rank` (this device's id), combined with `+ - * / %`
//! and `min(a, b)`, `max(a, b)` (the per-rank sizes of uneven shards need them).
//! They have no side effects and are evaluated afresh at every use, per rank and per loop
//! iteration, so there is no stale loop-carried state.
//!
//! `/` and `%` are Euclidean division and remainder (`a == b * (a / b) + a % b` with
//! `0 <= a % b < |b|`), so the remainder is never negative and `(d + my - i) % d` equals
//! `(my - i) % d`.

use std::fmt;

use crate::mesh::{DeviceId, ParallelType};
use crate::program::MeshId;

/// A host loop variable, printed `i0`, `i1`, ...
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LoopVar(pub u32);

impl fmt::Display for LoopVar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "i{}", self.0)
    }
}

/// A binary operator.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum BinOp {
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/` (Euclidean division)
    Div,
    /// `%` (Euclidean remainder)
    Mod,
    /// `min(a, b)`
    Min,
    /// `max(a, b)`
    Max,
}

impl BinOp {
    /// The operator's symbol (the function name of `min` and `max`).
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Mod => "%",
            BinOp::Min => "min",
            BinOp::Max => "max",
        }
    }

    /// True for `min` and `max`, written as calls `min(a, b)`.
    pub fn is_call(self) -> bool {
        matches!(self, BinOp::Min | BinOp::Max)
    }

    /// Binding strength: calls bind tightest, then `* / %`, then `+ -`.
    pub fn precedence(self) -> u8 {
        match self {
            BinOp::Add | BinOp::Sub => 1,
            BinOp::Mul | BinOp::Div | BinOp::Mod => 2,
            BinOp::Min | BinOp::Max => 3,
        }
    }
}

/// A pure integer expression.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expr {
    /// A constant.
    Const(i64),
    /// The current value of a loop variable.
    Loop(LoopVar),
    /// This device's team index along `pt` in `mesh`.
    MyIndex {
        /// The mesh.
        mesh: MeshId,
        /// A device parallel type.
        pt: ParallelType,
    },
    /// This device's id.
    Rank,
    /// A binary operation.
    Bin(BinOp, Box<Expr>, Box<Expr>),
}

/// Why an expression could not be evaluated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    /// A loop variable with no current value.
    #[error("loop variable {0} is used outside its loop")]
    UnboundLoop(LoopVar),
    /// `my(mesh, pt)` on a device outside the mesh, or a mesh without that axis.
    #[error("my({mesh:?}, {pt}) is undefined on device {device}")]
    NoTeamIndex {
        /// The mesh.
        mesh: MeshId,
        /// The parallel type.
        pt: ParallelType,
        /// The device.
        device: DeviceId,
    },
    /// Division or remainder by zero.
    #[error("division by zero in `{0}`")]
    DivByZero(String),
    /// Arithmetic overflow.
    #[error("integer overflow in `{0}`")]
    Overflow(String),
}

/// What an expression is evaluated against.
pub trait ExprEnv {
    /// The value of a loop variable.
    fn loop_value(&self, var: LoopVar) -> Option<i64>;
    /// This device's team index along `pt` in `mesh`.
    fn my_index(&self, mesh: MeshId, pt: ParallelType) -> Option<i64>;
    /// This device's id.
    fn rank(&self) -> DeviceId;
}

#[allow(clippy::should_implement_trait)]
impl Expr {
    /// A constant.
    pub fn c(v: i64) -> Expr {
        Expr::Const(v)
    }

    /// A loop variable.
    pub fn var(v: LoopVar) -> Expr {
        Expr::Loop(v)
    }

    /// `my(mesh, pt)`.
    pub fn my(mesh: MeshId, pt: ParallelType) -> Expr {
        Expr::MyIndex { mesh, pt }
    }

    fn bin(op: BinOp, a: Expr, b: Expr) -> Expr {
        Expr::Bin(op, Box::new(a), Box::new(b))
    }

    /// `self + rhs`.
    pub fn add(self, rhs: Expr) -> Expr {
        Expr::bin(BinOp::Add, self, rhs)
    }

    /// `self - rhs`.
    pub fn sub(self, rhs: Expr) -> Expr {
        Expr::bin(BinOp::Sub, self, rhs)
    }

    /// `self * rhs`.
    pub fn mul(self, rhs: Expr) -> Expr {
        Expr::bin(BinOp::Mul, self, rhs)
    }

    /// `self / rhs`.
    pub fn div(self, rhs: Expr) -> Expr {
        Expr::bin(BinOp::Div, self, rhs)
    }

    /// `self % rhs`.
    pub fn rem(self, rhs: Expr) -> Expr {
        Expr::bin(BinOp::Mod, self, rhs)
    }

    /// `min(self, rhs)`.
    pub fn min(self, rhs: Expr) -> Expr {
        Expr::bin(BinOp::Min, self, rhs)
    }

    /// `max(self, rhs)`.
    pub fn max(self, rhs: Expr) -> Expr {
        Expr::bin(BinOp::Max, self, rhs)
    }

    /// The constant value, when the expression is a constant.
    pub fn as_const(&self) -> Option<i64> {
        match self {
            Expr::Const(v) => Some(*v),
            _ => None,
        }
    }

    /// Evaluates the expression.
    pub fn eval(&self, env: &dyn ExprEnv) -> Result<i64, EvalError> {
        match self {
            Expr::Const(v) => Ok(*v),
            Expr::Loop(v) => env.loop_value(*v).ok_or(EvalError::UnboundLoop(*v)),
            Expr::MyIndex { mesh, pt } => env.my_index(*mesh, *pt).ok_or(EvalError::NoTeamIndex {
                mesh: *mesh,
                pt: *pt,
                device: env.rank(),
            }),
            Expr::Rank => {
                i64::try_from(env.rank()).map_err(|_| EvalError::Overflow(self.to_string()))
            }
            Expr::Bin(op, a, b) => {
                let (a, b) = (a.eval(env)?, b.eval(env)?);
                let overflow = || EvalError::Overflow(self.to_string());
                match op {
                    BinOp::Add => a.checked_add(b).ok_or_else(overflow),
                    BinOp::Sub => a.checked_sub(b).ok_or_else(overflow),
                    BinOp::Mul => a.checked_mul(b).ok_or_else(overflow),
                    BinOp::Div | BinOp::Mod if b == 0 => {
                        Err(EvalError::DivByZero(self.to_string()))
                    }
                    BinOp::Div => a.checked_div_euclid(b).ok_or_else(overflow),
                    BinOp::Mod => a.checked_rem_euclid(b).ok_or_else(overflow),
                    BinOp::Min => Ok(a.min(b)),
                    BinOp::Max => Ok(a.max(b)),
                }
            }
        }
    }

    /// Calls `f` on every loop variable the expression reads.
    pub fn for_each_loop_var(&self, f: &mut impl FnMut(LoopVar)) {
        match self {
            Expr::Loop(v) => f(*v),
            Expr::Bin(_, a, b) => {
                a.for_each_loop_var(f);
                b.for_each_loop_var(f);
            }
            Expr::Const(_) | Expr::MyIndex { .. } | Expr::Rank => {}
        }
    }

    /// Calls `f` on every mesh the expression names.
    pub fn for_each_mesh(&self, f: &mut impl FnMut(MeshId, ParallelType)) {
        match self {
            Expr::MyIndex { mesh, pt } => f(*mesh, *pt),
            Expr::Bin(_, a, b) => {
                a.for_each_mesh(f);
                b.for_each_mesh(f);
            }
            Expr::Const(_) | Expr::Loop(_) | Expr::Rank => {}
        }
    }

    /// Prints with mesh names resolved by `mesh_name`.
    pub fn display<'a>(&'a self, mesh_name: &'a dyn Fn(MeshId) -> String) -> DisplayExpr<'a> {
        DisplayExpr {
            expr: self,
            mesh_name,
        }
    }
}

/// An expression printed with mesh names (see [`Expr::display`]).
pub struct DisplayExpr<'a> {
    expr: &'a Expr,
    mesh_name: &'a dyn Fn(MeshId) -> String,
}

impl DisplayExpr<'_> {
    fn write(&self, e: &Expr, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match e {
            Expr::Const(v) => write!(f, "{v}"),
            Expr::Loop(v) => write!(f, "{v}"),
            Expr::MyIndex { mesh, pt } => write!(f, "my({}, {pt})", (self.mesh_name)(*mesh)),
            Expr::Rank => f.write_str("rank"),
            Expr::Bin(op, a, b) if op.is_call() => {
                write!(f, "{}(", op.symbol())?;
                self.write(a, f)?;
                f.write_str(", ")?;
                self.write(b, f)?;
                f.write_str(")")
            }
            Expr::Bin(op, a, b) => {
                let p = op.precedence();
                // Left operands need parentheses only when they bind looser; right operands
                // also when they bind equally (all operators are left-associative).
                let left_paren =
                    matches!(**a, Expr::Bin(o, ..) if !o.is_call() && o.precedence() < p);
                let right_paren =
                    matches!(**b, Expr::Bin(o, ..) if !o.is_call() && o.precedence() <= p);
                if left_paren {
                    f.write_str("(")?;
                }
                self.write(a, f)?;
                if left_paren {
                    f.write_str(")")?;
                }
                write!(f, " {} ", op.symbol())?;
                if right_paren {
                    f.write_str("(")?;
                }
                self.write(b, f)?;
                if right_paren {
                    f.write_str(")")?;
                }
                Ok(())
            }
        }
    }
}

impl fmt::Display for DisplayExpr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(self.expr, f)
    }
}

impl fmt::Display for Expr {
    /// Prints with meshes as handles (`m0`); programs print mesh names instead.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = |m: MeshId| format!("{m:?}");
        DisplayExpr {
            expr: self,
            mesh_name: &name,
        }
        .fmt(f)
    }
}
