//! The affine-mod normal form of index expressions, and interval facts.
//!
//! A value is [`Form::Affine`] `c0 + c1*a1 + ...` over atoms (loop indices, `my(mesh, pt)`,
//! `rank`), [`Form::Mod`] `(affine) % d` with coefficients reduced modulo `d` (the constant in
//! `[0, d)`, other coefficients in `(-d/2, d/2]`), or [`Form::Opaque`]. Intervals of atoms
//! (a loop index lies in `[start, stop)`, `my` in `[0, team size)`) let `x % d` drop the `%`
//! when `0 <= x < d`. All arithmetic is checked: an overflow makes the form opaque.

use std::collections::{BTreeMap, HashMap};

use egg::Symbol;

/// The sort key of an atom: loop indices first, then team indices, then `rank`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AtomKey {
    kind: u8,
    name: String,
}

impl AtomKey {
    /// The key of atom `s`.
    pub fn of(s: Symbol) -> AtomKey {
        let name = s.as_str().to_string();
        let kind = if name.starts_with('i') {
            0
        } else if name.starts_with("my.") {
            1
        } else if name == "rank" {
            2
        } else {
            3
        };
        AtomKey { kind, name }
    }

    /// The atom's symbol.
    pub fn symbol(&self) -> Symbol {
        Symbol::from(self.name.as_str())
    }
}

/// A linear combination of atoms plus a constant.
#[derive(Clone, Debug, PartialEq, Eq, Default, Hash)]
pub struct Lin {
    /// The constant term.
    pub c: i64,
    /// Coefficients of atoms (never zero).
    pub terms: BTreeMap<AtomKey, i64>,
}

impl Lin {
    /// A constant.
    pub fn constant(c: i64) -> Lin {
        Lin {
            c,
            terms: BTreeMap::new(),
        }
    }

    /// One atom.
    pub fn atom(s: Symbol) -> Lin {
        let mut terms = BTreeMap::new();
        terms.insert(AtomKey::of(s), 1);
        Lin { c: 0, terms }
    }

    /// The constant value, when there are no atoms.
    pub fn as_const(&self) -> Option<i64> {
        self.terms.is_empty().then_some(self.c)
    }

    fn combine(&self, other: &Lin, sign: i64) -> Option<Lin> {
        let mut out = self.clone();
        out.c = out.c.checked_add(other.c.checked_mul(sign)?)?;
        for (k, &v) in &other.terms {
            let e = out.terms.entry(k.clone()).or_insert(0);
            *e = e.checked_add(v.checked_mul(sign)?)?;
            if *e == 0 {
                out.terms.remove(k);
            }
        }
        Some(out)
    }

    /// `self + other`.
    pub fn add(&self, other: &Lin) -> Option<Lin> {
        self.combine(other, 1)
    }

    /// `self - other`.
    pub fn sub(&self, other: &Lin) -> Option<Lin> {
        self.combine(other, -1)
    }

    /// `self * k`.
    pub fn scale(&self, k: i64) -> Option<Lin> {
        if k == 0 {
            return Some(Lin::constant(0));
        }
        let mut out = Lin::constant(self.c.checked_mul(k)?);
        for (a, &v) in &self.terms {
            out.terms.insert(a.clone(), v.checked_mul(k)?);
        }
        Some(out)
    }

    /// Coefficients reduced modulo `m`: the constant into `[0, m)`, the others into
    /// `(-m/2, m/2]`; zero coefficients are dropped.
    pub fn reduce_mod(&self, m: i64) -> Lin {
        let mut out = Lin::constant(self.c.rem_euclid(m));
        for (a, &v) in &self.terms {
            let mut r = v.rem_euclid(m);
            if r > m / 2 {
                r -= m;
            }
            if r != 0 {
                out.terms.insert(a.clone(), r);
            }
        }
        out
    }

    /// The interval of the value given atom intervals, if every atom has one.
    pub fn range(&self, facts: &Facts) -> Option<(i64, i64)> {
        let mut lo = self.c;
        let mut hi = self.c;
        for (a, &k) in &self.terms {
            let (alo, ahi) = facts.range(a.symbol())?;
            let (x, y) = (alo.checked_mul(k)?, ahi.checked_mul(k)?);
            lo = lo.checked_add(x.min(y))?;
            hi = hi.checked_add(x.max(y))?;
        }
        Some((lo, hi))
    }
}

/// What is known about an index value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Form {
    /// An affine combination.
    Affine(Lin),
    /// `(lin) % m` with `lin` reduced modulo `m` (`m > 0`).
    Mod(Lin, i64),
    /// Nothing structural (a division, a product of atoms, ...).
    Opaque,
}

impl Form {
    fn rank(&self) -> u8 {
        match self {
            Form::Affine(_) => 2,
            Form::Mod(..) => 1,
            Form::Opaque => 0,
        }
    }
}

/// The analysis data of an e-class: its form and interval (inclusive).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexData {
    /// The normal form.
    pub form: Form,
    /// Inclusive bounds, when known.
    pub range: Option<(i64, i64)>,
}

impl IndexData {
    /// A constant.
    pub fn constant(n: i64) -> IndexData {
        IndexData {
            form: Form::Affine(Lin::constant(n)),
            range: Some((n, n)),
        }
    }

    /// An atom with the interval `facts` gives it.
    pub fn atom(s: Symbol, facts: &Facts) -> IndexData {
        IndexData {
            form: Form::Affine(Lin::atom(s)),
            range: facts.range(s),
        }
        .pinned()
    }

    /// A value whose interval is a single point is that constant.
    fn pinned(self) -> IndexData {
        match self.range {
            Some((lo, hi)) if lo == hi => IndexData::constant(lo),
            _ => self,
        }
    }

    fn opaque(range: Option<(i64, i64)>) -> IndexData {
        IndexData {
            form: Form::Opaque,
            range,
        }
    }

    /// The constant value, if known.
    pub fn as_const(&self) -> Option<i64> {
        match &self.form {
            Form::Affine(l) => l.as_const(),
            _ => None,
        }
    }

    /// Merges what two equal classes know; returns whether `self` changed and whether the
    /// result differs from `other`.
    pub fn merge(&mut self, other: IndexData) -> (bool, bool) {
        let mut changed_self = false;
        let mut differs_other = false;
        match self.form.rank().cmp(&other.form.rank()) {
            std::cmp::Ordering::Less => {
                self.form = other.form.clone();
                changed_self = true;
            }
            std::cmp::Ordering::Greater => differs_other = true,
            std::cmp::Ordering::Equal => differs_other |= self.form != other.form,
        }
        let range = match (self.range, other.range) {
            (Some((a, b)), Some((c, d))) => Some((a.max(c), b.min(d))),
            (r, None) | (None, r) => r,
        };
        changed_self |= range != self.range;
        differs_other |= range != other.range;
        self.range = range;
        (changed_self, differs_other)
    }
}

fn add_range(a: Option<(i64, i64)>, b: Option<(i64, i64)>, sign: i64) -> Option<(i64, i64)> {
    let ((alo, ahi), (blo, bhi)) = (a?, b?);
    if sign > 0 {
        Some((alo.checked_add(blo)?, ahi.checked_add(bhi)?))
    } else {
        Some((alo.checked_sub(bhi)?, ahi.checked_sub(blo)?))
    }
}

fn mul_range(a: Option<(i64, i64)>, b: Option<(i64, i64)>) -> Option<(i64, i64)> {
    let ((alo, ahi), (blo, bhi)) = (a?, b?);
    let c = [
        alo.checked_mul(blo)?,
        alo.checked_mul(bhi)?,
        ahi.checked_mul(blo)?,
        ahi.checked_mul(bhi)?,
    ];
    Some((*c.iter().min()?, *c.iter().max()?))
}

/// `lin % m` in normal form.
fn mod_form(lin: &Lin, m: i64, facts: &Facts) -> Form {
    let r = lin.reduce_mod(m);
    match r.range(facts) {
        Some((lo, hi)) if lo >= 0 && hi < m => Form::Affine(r),
        _ => Form::Mod(r, m),
    }
}

/// The binary operators of index expressions.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// Euclidean `/`
    Div,
    /// Euclidean `%`
    Mod,
    /// `min`
    Min,
    /// `max`
    Max,
}

/// The data of `a op b` from the data of `a` and `b`.
pub fn combine(op: Op, a: &IndexData, b: &IndexData, facts: &Facts) -> IndexData {
    combine_raw(op, a, b, facts).pinned()
}

fn combine_raw(op: Op, a: &IndexData, b: &IndexData, facts: &Facts) -> IndexData {
    let lin = |d: &IndexData| match &d.form {
        Form::Affine(l) => Some(l.clone()),
        _ => None,
    };
    match op {
        Op::Add | Op::Sub => {
            let sign = if op == Op::Add { 1 } else { -1 };
            let range = add_range(a.range, b.range, sign);
            let form = match (lin(a), lin(b)) {
                (Some(x), Some(y)) => {
                    let r = if sign > 0 { x.add(&y) } else { x.sub(&y) };
                    r.map_or(Form::Opaque, Form::Affine)
                }
                _ => Form::Opaque,
            };
            IndexData { form, range }
        }
        Op::Mul => {
            let range = mul_range(a.range, b.range);
            let form = match (lin(a), lin(b)) {
                (Some(x), Some(y)) => match (x.as_const(), y.as_const()) {
                    (Some(k), _) => y.scale(k).map_or(Form::Opaque, Form::Affine),
                    (_, Some(k)) => x.scale(k).map_or(Form::Opaque, Form::Affine),
                    _ => Form::Opaque,
                },
                _ => Form::Opaque,
            };
            IndexData { form, range }
        }
        Op::Div => match (a.as_const(), b.as_const()) {
            (Some(x), Some(y)) if y != 0 => x
                .checked_div_euclid(y)
                .map_or(IndexData::opaque(None), IndexData::constant),
            (_, Some(y)) if y > 0 => {
                IndexData::opaque(a.range.map(|(lo, hi)| (lo.div_euclid(y), hi.div_euclid(y))))
            }
            _ => IndexData::opaque(None),
        },
        Op::Min | Op::Max => {
            let min = op == Op::Min;
            if let (Some(x), Some(y)) = (a.as_const(), b.as_const()) {
                return IndexData::constant(if min { x.min(y) } else { x.max(y) });
            }
            // One side always wins when the intervals do not overlap.
            if let (Some((alo, ahi)), Some((blo, bhi))) = (a.range, b.range) {
                if ahi <= blo {
                    return if min { a.clone() } else { b.clone() };
                }
                if bhi <= alo {
                    return if min { b.clone() } else { a.clone() };
                }
            }
            let range = match (a.range, b.range) {
                (Some((alo, ahi)), Some((blo, bhi))) => Some(if min {
                    (alo.min(blo), ahi.min(bhi))
                } else {
                    (alo.max(blo), ahi.max(bhi))
                }),
                _ => None,
            };
            IndexData::opaque(range)
        }
        Op::Mod => {
            let Some(m) = b.as_const().filter(|&m| m > 0) else {
                return IndexData::opaque(None);
            };
            if let Some((lo, hi)) = a.range {
                if lo >= 0 && hi < m {
                    return a.clone();
                }
            }
            let form = match &a.form {
                Form::Affine(l) => mod_form(l, m, facts),
                Form::Mod(l, m2) if m2 % m == 0 => mod_form(l, m, facts),
                _ => Form::Opaque,
            };
            IndexData {
                form,
                range: Some((0, m - 1)),
            }
        }
    }
}

/// Interval facts about atoms: inclusive bounds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    ranges: HashMap<Symbol, (i64, i64)>,
}

impl Facts {
    /// No facts.
    pub fn new() -> Facts {
        Facts::default()
    }

    /// Atom `s` lies in `[lo, hi]` (inclusive).
    pub fn set(&mut self, s: Symbol, lo: i64, hi: i64) {
        self.ranges.insert(s, (lo, hi));
    }

    /// The bounds of atom `s`.
    pub fn range(&self, s: Symbol) -> Option<(i64, i64)> {
        self.ranges.get(&s).copied()
    }
}
