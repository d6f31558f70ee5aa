//! Index arithmetic with egg: canonicalization to the affine-mod form
//! `(c0 + c1*my + c2*i) % d`, constant folding, and equality proofs.
//!
//! Host scalar expressions are translated into [`IndexLang`] (atoms `i<n>` for loop indices,
//! `my.<mesh>.<pt>` for team indices, `rank`). The e-class analysis [`IndexAnalysis`] computes
//! each class's [`Form`] and interval (see [`form`]) and, like egg's constant folding, unions
//! every class with its canonical term. The named rewrite rules of [`rules`] handle what the
//! analysis cannot see through, chiefly nested remainders: `((a % d) + b) % d = (a + b) % d`.
//! The runner is bounded (iterations, nodes, time); egg's logging goes through `log` and is
//! silent unless a logger is installed (the CLI filters it to `warn`).

pub mod form;
pub mod rules;

use std::collections::HashMap;
use std::time::Duration;

use egg::{Analysis, DidMerge, EGraph, Extractor, Id, RecExpr, Runner, Symbol};
use meshflow_ir::host::BinOp;
use meshflow_ir::{EntityRef, Expr, LoopVar, MeshId, ParallelType};

pub use form::{Facts, Form, IndexData, Lin};

pub use lang::IndexLang;

mod lang {
    // egg's macro cannot document variants: `+ - * / %` (Euclidean), `min`, `max`, `Num` constants and
    // `Atom`s (`i<n>` loop indices, `my.<mesh>.<pt>` team indices, `rank`).
    #![allow(missing_docs)]
    use egg::{define_language, Id, Symbol};

    define_language! {
    /// Integer index expressions.
    pub enum IndexLang {
        "+" = Add([Id; 2]),
        "-" = Sub([Id; 2]),
        "*" = Mul([Id; 2]),
        "/" = Div([Id; 2]),
        "%" = Mod([Id; 2]),
        "min" = Min([Id; 2]),
        "max" = Max([Id; 2]),
        Num(i64),
        Atom(Symbol),
    }
    }
}

/// The e-class analysis: affine-mod form and interval per class (see [`form`]).
#[derive(Clone, Debug, Default)]
pub struct IndexAnalysis {
    /// Atom intervals.
    pub facts: Facts,
}

impl Analysis<IndexLang> for IndexAnalysis {
    type Data = IndexData;

    fn make(egraph: &mut EGraph<IndexLang, Self>, enode: &IndexLang, _id: Id) -> IndexData {
        let facts = &egraph.analysis.facts;
        let d = |i: &Id| &egraph[*i].data;
        let bin = |op, [a, b]: &[Id; 2]| form::combine(op, d(a), d(b), facts);
        match enode {
            IndexLang::Num(n) => IndexData::constant(*n),
            IndexLang::Atom(s) => IndexData::atom(*s, facts),
            IndexLang::Add(x) => bin(form::Op::Add, x),
            IndexLang::Sub(x) => bin(form::Op::Sub, x),
            IndexLang::Mul(x) => bin(form::Op::Mul, x),
            IndexLang::Div(x) => bin(form::Op::Div, x),
            IndexLang::Mod(x) => bin(form::Op::Mod, x),
            IndexLang::Min(x) => bin(form::Op::Min, x),
            IndexLang::Max(x) => bin(form::Op::Max, x),
        }
    }

    fn merge(&mut self, to: &mut IndexData, from: IndexData) -> DidMerge {
        let (a, b) = to.merge(from);
        DidMerge(a, b)
    }

    fn modify(egraph: &mut EGraph<IndexLang, Self>, id: Id) {
        if let Some(expr) = canonical_recexpr(&egraph[id].data.form) {
            let new = egraph.add_expr(&expr);
            egraph.union(id, new);
        }
    }
}

/// Appends the canonical term of an affine combination to `expr`.
fn push_lin(expr: &mut RecExpr<IndexLang>, lin: &Lin) -> Id {
    let term = |expr: &mut RecExpr<IndexLang>, atom: Symbol, k: i64| {
        let a = expr.add(IndexLang::Atom(atom));
        if k == 1 {
            a
        } else {
            let n = expr.add(IndexLang::Num(k));
            expr.add(IndexLang::Mul([n, a]))
        }
    };
    let mut acc: Option<Id> = None;
    for (a, &k) in lin.terms.iter().filter(|(_, &k)| k > 0) {
        let t = term(expr, a.symbol(), k);
        acc = Some(match acc {
            None => t,
            Some(x) => expr.add(IndexLang::Add([x, t])),
        });
    }
    if lin.c > 0 || (acc.is_none() && lin.c != 0 && lin.terms.is_empty()) {
        let n = expr.add(IndexLang::Num(lin.c));
        acc = Some(match acc {
            None => n,
            Some(x) => expr.add(IndexLang::Add([x, n])),
        });
    }
    for (a, &k) in lin.terms.iter().filter(|(_, &k)| k < 0) {
        let t = term(expr, a.symbol(), -k);
        let x = acc.unwrap_or_else(|| expr.add(IndexLang::Num(0)));
        acc = Some(expr.add(IndexLang::Sub([x, t])));
    }
    if lin.c < 0 && !lin.terms.is_empty() {
        let n = expr.add(IndexLang::Num(-lin.c));
        let x = acc.unwrap_or_else(|| expr.add(IndexLang::Num(0)));
        acc = Some(expr.add(IndexLang::Sub([x, n])));
    }
    acc.unwrap_or_else(|| expr.add(IndexLang::Num(0)))
}

/// The canonical term of a form (`None` for [`Form::Opaque`]). For `(lin) % d` whose
/// leading term would be negative, `d` is added to the constant: `(4 - i0) % 4`.
pub fn canonical_recexpr(form: &Form) -> Option<RecExpr<IndexLang>> {
    let mut expr = RecExpr::default();
    match form {
        Form::Affine(lin) => {
            push_lin(&mut expr, lin);
        }
        Form::Mod(lin, m) => {
            let mut lin = lin.clone();
            if lin.c == 0 && !lin.terms.values().any(|&k| k > 0) {
                lin.c = *m;
            }
            let a = push_lin(&mut expr, &lin);
            let n = expr.add(IndexLang::Num(*m));
            expr.add(IndexLang::Mod([a, n]));
        }
        Form::Opaque => return None,
    }
    Some(expr)
}

/// The atom of a loop index.
pub fn loop_atom(v: LoopVar) -> Symbol {
    Symbol::from(format!("i{}", v.0))
}

/// The atom of `my(mesh, pt)`.
pub fn my_atom(mesh: MeshId, pt: ParallelType) -> Symbol {
    Symbol::from(format!("my.{}.{}", mesh.index(), pt.name()))
}

/// The atom of `rank`.
pub fn rank_atom() -> Symbol {
    Symbol::from("rank")
}

/// Translates host expressions to [`IndexLang`] and back.
#[derive(Clone, Debug, Default)]
struct Atoms {
    back: HashMap<Symbol, Expr>,
}

impl Atoms {
    fn encode(&mut self, e: &Expr, out: &mut RecExpr<IndexLang>) -> Id {
        match e {
            Expr::Const(v) => out.add(IndexLang::Num(*v)),
            Expr::Loop(v) => self.atom(loop_atom(*v), e, out),
            Expr::MyIndex { mesh, pt } => self.atom(my_atom(*mesh, *pt), e, out),
            Expr::Rank => self.atom(rank_atom(), e, out),
            Expr::Bin(op, a, b) => {
                let a = self.encode(a, out);
                let b = self.encode(b, out);
                out.add(match op {
                    BinOp::Add => IndexLang::Add([a, b]),
                    BinOp::Sub => IndexLang::Sub([a, b]),
                    BinOp::Mul => IndexLang::Mul([a, b]),
                    BinOp::Div => IndexLang::Div([a, b]),
                    BinOp::Mod => IndexLang::Mod([a, b]),
                    BinOp::Min => IndexLang::Min([a, b]),
                    BinOp::Max => IndexLang::Max([a, b]),
                })
            }
        }
    }

    fn atom(&mut self, s: Symbol, e: &Expr, out: &mut RecExpr<IndexLang>) -> Id {
        self.back.insert(s, e.clone());
        out.add(IndexLang::Atom(s))
    }

    fn decode(&self, expr: &RecExpr<IndexLang>, id: Id) -> Option<Expr> {
        let bin = |op, [a, b]: &[Id; 2]| {
            Some(Expr::Bin(
                op,
                Box::new(self.decode(expr, *a)?),
                Box::new(self.decode(expr, *b)?),
            ))
        };
        match &expr[id] {
            IndexLang::Num(n) => Some(Expr::Const(*n)),
            IndexLang::Atom(s) => self.back.get(s).cloned(),
            IndexLang::Add(x) => bin(BinOp::Add, x),
            IndexLang::Sub(x) => bin(BinOp::Sub, x),
            IndexLang::Mul(x) => bin(BinOp::Mul, x),
            IndexLang::Div(x) => bin(BinOp::Div, x),
            IndexLang::Mod(x) => bin(BinOp::Mod, x),
            IndexLang::Min(x) => bin(BinOp::Min, x),
            IndexLang::Max(x) => bin(BinOp::Max, x),
        }
    }
}

/// Bounds of one equality saturation run. The iteration and node limits bound the work; the
/// wall-time limit is only a safety net, far above what they allow, so that what is proven
/// never depends on how loaded the machine is (a compilation is deterministic).
#[derive(Copy, Clone, Debug)]
pub struct Limits {
    /// Maximum iterations.
    pub iterations: usize,
    /// Maximum e-nodes.
    pub nodes: usize,
    /// Maximum wall time (a safety net).
    pub time: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            iterations: 8,
            nodes: 5_000,
            time: Duration::from_secs(10),
        }
    }
}

/// Simplifies and compares index expressions under a set of [`Facts`] (with a cache).
#[derive(Clone, Debug)]
pub struct Simplifier {
    facts: Facts,
    limits: Limits,
    cache: HashMap<Expr, Expr>,
}

impl Simplifier {
    /// A simplifier using `facts`.
    pub fn new(facts: Facts) -> Simplifier {
        Simplifier {
            facts,
            limits: Limits::default(),
            cache: HashMap::new(),
        }
    }

    /// Replaces the runner's bounds.
    pub fn with_limits(mut self, limits: Limits) -> Simplifier {
        self.limits = limits;
        self
    }

    fn run(&self, exprs: &[&Expr]) -> (EGraph<IndexLang, IndexAnalysis>, Vec<Id>, Atoms) {
        let mut atoms = Atoms::default();
        let mut runner = Runner::<IndexLang, IndexAnalysis, ()>::new(IndexAnalysis {
            facts: self.facts.clone(),
        })
        .with_iter_limit(self.limits.iterations)
        .with_node_limit(self.limits.nodes)
        .with_time_limit(self.limits.time);
        for e in exprs {
            let mut rec = RecExpr::default();
            atoms.encode(e, &mut rec);
            runner = runner.with_expr(&rec);
        }
        let runner = runner.run(&rules::rules());
        let roots = runner.roots.clone();
        (runner.egraph, roots, atoms)
    }

    /// The canonical form of `e`: affine-mod where possible, constants folded, subterms
    /// simplified otherwise.
    pub fn simplify(&mut self, e: &Expr) -> Expr {
        if let Some(s) = self.cache.get(e) {
            return s.clone();
        }
        let (egraph, roots, atoms) = self.run(&[e]);
        let out = roots
            .first()
            .and_then(|&root| {
                let extractor = Extractor::new(&egraph, egg::AstSize);
                best(&egraph, &extractor, &atoms, root)
            })
            .unwrap_or_else(|| e.clone());
        self.cache.insert(e.clone(), out.clone());
        out
    }

    /// True when `a == b` is proven for every value of the atoms allowed by the facts.
    pub fn prove_equal(&mut self, a: &Expr, b: &Expr) -> bool {
        if a == b {
            return true;
        }
        let (fa, fb) = (form_of(a, &self.facts), form_of(b, &self.facts));
        if fa.form != Form::Opaque && fa.form == fb.form {
            return true;
        }
        let (egraph, roots, _) = self.run(&[a, b]);
        match roots.as_slice() {
            [x, y] => {
                egraph.find(*x) == egraph.find(*y) || {
                    let (dx, dy) = (&egraph[*x].data.form, &egraph[*y].data.form);
                    *dx != Form::Opaque && dx == dy
                }
            }
            _ => false,
        }
    }

    /// Proves that `send` and `recv` peer expressions (over the atom `my`) are inverse
    /// permutations of a team: the member at team index `send(my)` receives from `my`, i.e.
    /// `recv[my := send] == my`.
    pub fn prove_peer_inverse(&mut self, send: &Expr, recv: &Expr, my: &Expr) -> bool {
        let composed = substitute(recv, my, send);
        self.prove_equal(&composed, my)
    }
}

/// The best term of class `id`: the canonical form when the analysis knows one, else the
/// smallest node with its children simplified the same way.
fn best(
    egraph: &EGraph<IndexLang, IndexAnalysis>,
    extractor: &Extractor<egg::AstSize, IndexLang, IndexAnalysis>,
    atoms: &Atoms,
    id: Id,
) -> Option<Expr> {
    if let Some(rec) = canonical_recexpr(&egraph[id].data.form) {
        let root = Id::from(rec.as_ref().len() - 1);
        return atoms.decode(&rec, root);
    }
    let node = extractor.find_best_node(id);
    let kid = |i: &Id| best(egraph, extractor, atoms, *i).map(Box::new);
    Some(match node {
        IndexLang::Num(n) => Expr::Const(*n),
        IndexLang::Atom(s) => atoms.back.get(s)?.clone(),
        IndexLang::Add([a, b]) => Expr::Bin(BinOp::Add, kid(a)?, kid(b)?),
        IndexLang::Sub([a, b]) => Expr::Bin(BinOp::Sub, kid(a)?, kid(b)?),
        IndexLang::Mul([a, b]) => Expr::Bin(BinOp::Mul, kid(a)?, kid(b)?),
        IndexLang::Div([a, b]) => Expr::Bin(BinOp::Div, kid(a)?, kid(b)?),
        IndexLang::Mod([a, b]) => Expr::Bin(BinOp::Mod, kid(a)?, kid(b)?),
        IndexLang::Min([a, b]) => Expr::Bin(BinOp::Min, kid(a)?, kid(b)?),
        IndexLang::Max([a, b]) => Expr::Bin(BinOp::Max, kid(a)?, kid(b)?),
    })
}

/// Replaces every occurrence of `atom` in `e` by `by`.
pub fn substitute(e: &Expr, atom: &Expr, by: &Expr) -> Expr {
    if e == atom {
        return by.clone();
    }
    match e {
        Expr::Bin(op, a, b) => Expr::Bin(
            *op,
            Box::new(substitute(a, atom, by)),
            Box::new(substitute(b, atom, by)),
        ),
        _ => e.clone(),
    }
}

/// The analysis data of `e` computed directly (no saturation): enough to decide equality of
/// affine-mod expressions quickly.
pub fn form_of(e: &Expr, facts: &Facts) -> IndexData {
    match e {
        Expr::Const(v) => IndexData::constant(*v),
        Expr::Loop(v) => IndexData::atom(loop_atom(*v), facts),
        Expr::MyIndex { mesh, pt } => IndexData::atom(my_atom(*mesh, *pt), facts),
        Expr::Rank => IndexData::atom(rank_atom(), facts),
        Expr::Bin(op, a, b) => {
            let op = match op {
                BinOp::Add => form::Op::Add,
                BinOp::Sub => form::Op::Sub,
                BinOp::Mul => form::Op::Mul,
                BinOp::Div => form::Op::Div,
                BinOp::Mod => form::Op::Mod,
                BinOp::Min => form::Op::Min,
                BinOp::Max => form::Op::Max,
            };
            form::combine(op, &form_of(a, facts), &form_of(b, facts), facts)
        }
    }
}

/// Convenience: facts for loop `v` over `[start, stop)`.
pub fn loop_fact(facts: &mut Facts, v: LoopVar, start: i64, stop: i64) {
    facts.set(loop_atom(v), start, stop - 1);
}

/// Convenience: facts for `my(mesh, pt)` with a team of `size` members.
pub fn my_fact(facts: &mut Facts, mesh: MeshId, pt: ParallelType, size: usize) {
    facts.set(my_atom(mesh, pt), 0, size as i64 - 1);
}

/// The facts every expression of `host` may use: `my(m, pt)` in `[0, team size)` for every
/// mesh and device parallel type, `rank` in `[0, world size)`.
pub fn host_facts(host: &meshflow_ir::HostProgram) -> Facts {
    let mut facts = Facts::new();
    for (id, m) in host.meshes.iter() {
        for pt in ParallelType::DEVICE {
            if let Some(size) = m.mesh.size_of(pt) {
                my_fact(&mut facts, id, pt, size);
            }
        }
    }
    let world = host.world_size() as i64;
    if world > 0 {
        facts.set(rank_atom(), 0, world - 1);
    }
    facts
}
