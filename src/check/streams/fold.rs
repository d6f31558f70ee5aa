//! Folding long loops: which loops may be analysed on a few iterations, and which ones.
//!
//! The body of a loop over `i` is straight-line code whose stream choices, chunk indices and
//! inner loop bounds are integer expressions of `i`. When each of them either ignores `i`, is
//! *periodic* in `i` (every use of `i` sits under a `% m` with `m` free of `i`: the
//! double-buffer slot `i % 2`, the worker `worker(i % 2)`, the ring chunk `(i + my) % d`) or
//! *translates* with `i` (`a * i + b` plus periodic terms: the chunk `i` of an output), then
//! with `P` the least common multiple of the moduli every iteration `j + P` does what
//! iteration `j` did, up to a fixed shift of the translated chunks. [`classify`] decides this
//! from the expressions' structure, per loop variable.
//!
//! What the analysis does with it is described in the parent module.

use meshflow_ir::host::BinOp;
use meshflow_ir::{Expr, LoopVar};

/// How an expression depends on one loop variable `i`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Dep<'e> {
    /// It translates with `i`: `e(i + P) - e(i)` is the same for every `i` once `P` is a
    /// multiple of the moduli. `affine` when `i` appears outside every `%` (the translation
    /// may be non-zero); `moduli` are the right operands of the `%`s `i` appears under.
    Regular { affine: bool, moduli: Vec<&'e Expr> },
    /// Anything else (`i * i`, `i / 2`, a modulus that depends on `i`).
    Irregular,
}

impl<'e> Dep<'e> {
    const CONST: Dep<'static> = Dep::Regular {
        affine: false,
        moduli: Vec::new(),
    };

    /// True when the expression is periodic in `i` (or ignores it).
    pub fn is_periodic(&self) -> bool {
        matches!(self, Dep::Regular { affine: false, .. })
    }

    fn combine(self, other: Dep<'e>) -> Dep<'e> {
        match (self, other) {
            (
                Dep::Regular {
                    affine: a1,
                    moduli: mut m1,
                },
                Dep::Regular {
                    affine: a2,
                    moduli: m2,
                },
            ) => {
                m1.extend(m2);
                Dep::Regular {
                    affine: a1 || a2,
                    moduli: m1,
                }
            }
            _ => Dep::Irregular,
        }
    }
}

fn mentions(e: &Expr, v: LoopVar) -> bool {
    let mut found = false;
    e.for_each_loop_var(&mut |w| found |= w == v);
    found
}

/// How `e` depends on loop variable `v` (other loop variables, `my(..)` and `rank` are
/// constants here).
pub(super) fn classify(e: &Expr, v: LoopVar) -> Dep<'_> {
    if !mentions(e, v) {
        return Dep::CONST;
    }
    match e {
        Expr::Loop(_) => Dep::Regular {
            affine: true,
            moduli: Vec::new(),
        },
        Expr::Bin(BinOp::Add | BinOp::Sub, a, b) => classify(a, v).combine(classify(b, v)),
        Expr::Bin(BinOp::Mul, a, b) => match (mentions(a, v), mentions(b, v)) {
            (true, true) => Dep::Irregular,
            (true, false) => classify(a, v),
            _ => classify(b, v),
        },
        // A periodic value divided by a constant stays periodic; a translating one does not
        // translate evenly.
        Expr::Bin(BinOp::Div, a, b) if !mentions(b, v) => match classify(a, v) {
            d if d.is_periodic() => d,
            _ => Dep::Irregular,
        },
        Expr::Bin(BinOp::Mod, a, b) if !mentions(b, v) => match classify(a, v) {
            Dep::Regular { mut moduli, .. } => {
                moduli.push(b);
                Dep::Regular {
                    affine: false,
                    moduli,
                }
            }
            Dep::Irregular => Dep::Irregular,
        },
        _ => Dep::Irregular,
    }
}

/// Greatest common divisor.
fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The least common multiple of `values`, or `None` past `cap` (or for a zero).
pub(super) fn lcm(values: impl IntoIterator<Item = i64>, cap: u64) -> Option<u64> {
    let mut p = 1u64;
    for v in values {
        let v = v.unsigned_abs();
        if v == 0 {
            return None;
        }
        p = p / gcd(p, v) * v;
        if p > cap {
            return None;
        }
    }
    Some(p)
}

/// The iterations of a folded loop of `n` iterations from `start`: the first `front`
/// iterations are analysed, the next `gap` only move the clocks, the middle is skipped, and
/// the last `back` are analysed again.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Window {
    pub start: i64,
    pub stop: i64,
    pub period: i64,
    pub front: i64,
    pub gap: i64,
    pub back: i64,
}

impl Window {
    /// The window for a loop `start..stop` with period `period`, `streams` streams and
    /// translated chunks that can meet `reach` iterations apart; `None` when the loop is too
    /// short to gain anything (it is then unrolled).
    pub fn plan(start: i64, stop: i64, period: i64, streams: i64, reach: i64) -> Option<Window> {
        let settle = (streams + 2).checked_mul(period)?;
        let front = settle.checked_add(period)?.checked_add(reach)?;
        let back = settle.checked_add(period)?;
        let n = stop.checked_sub(start)?;
        let skipped = n.checked_sub(front + settle + back)?;
        if skipped < 2 * period {
            return None;
        }
        // The skipped middle is a whole number of periods: the gap absorbs the rest.
        let gap = settle + skipped % period;
        Some(Window {
            start,
            stop,
            period,
            front,
            gap,
            back,
        })
    }

    /// The first iteration of the back window.
    pub fn back_start(&self) -> i64 {
        self.stop - self.back
    }

    /// The iterations neither window records (`front` end .. `back` start).
    pub fn unrecorded(&self) -> (i64, i64) {
        (self.start + self.front, self.back_start())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow_ir::{EntityRef, MeshId, ParallelType};

    fn i() -> Expr {
        Expr::var(LoopVar(0))
    }

    #[test]
    fn chunk_and_stream_indices_are_regular() {
        let my = Expr::my(MeshId::new(0), ParallelType::DIDx);
        let slot = i().rem(Expr::c(2));
        assert!(
            matches!(classify(&slot, LoopVar(0)), Dep::Regular { affine: false, ref moduli } if moduli.len() == 1)
        );
        let ring = i().add(my.clone()).rem(Expr::c(4));
        assert!(classify(&ring, LoopVar(0)).is_periodic());
        let chunk = i().mul(Expr::c(3)).add(my.clone());
        assert!(matches!(
            classify(&chunk, LoopVar(0)),
            Dep::Regular { affine: true, .. }
        ));
        assert!(classify(&my, LoopVar(0)).is_periodic());
        assert_eq!(classify(&i().mul(i()), LoopVar(0)), Dep::Irregular);
        assert_eq!(classify(&i().div(Expr::c(2)), LoopVar(0)), Dep::Irregular);
        assert!(classify(&i().rem(Expr::c(4)).div(Expr::c(2)), LoopVar(0)).is_periodic());
        assert_eq!(classify(&Expr::c(4).rem(i()), LoopVar(0)), Dep::Irregular);
        assert_eq!(lcm([2, 3, 4], 64), Some(12));
        assert_eq!(lcm([0], 64), None);
    }

    #[test]
    fn windows_skip_whole_periods() {
        assert_eq!(Window::plan(0, 30, 2, 3, 0), None);
        let w = Window::plan(0, 40_000, 2, 3, 2).expect("folds");
        assert_eq!((w.front, w.back), (14, 12));
        let (lo, hi) = w.unrecorded();
        assert_eq!((hi - lo - w.gap) % 2, 0);
        assert!(w.gap >= 10);
    }
}
