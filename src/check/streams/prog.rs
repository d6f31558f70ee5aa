//! The host program prepared once for every rank's stream-order walk: the instructions that
//! matter to ordering, with labels, tensors and streams resolved to indices.

use std::collections::{BTreeSet, HashMap};

use meshflow_ir::{
    Arena, CommId, CommKind, EntityRef, Expr, HostProgram, Inst, InstKind, LoopVar, MeshId,
    ParallelType, StreamRef, Team,
};

use super::fold::{classify, Dep};
use crate::runtime::backend::PreorderIndex;

/// A stream operand: a saved variable or a worker number.
pub(super) enum Sel<'h> {
    Var(usize),
    Worker(&'h Expr),
}

/// An instruction the walk executes (`ord` is its position in program pre-order, numbered as
/// the runtime numbers it).
pub(super) enum Item<'h> {
    Loop {
        ord: PreorderIndex,
        var: LoopVar,
        start: &'h Expr,
        stop: &'h Expr,
        body: Vec<Item<'h>>,
        /// The moduli of a loop that may be folded; `None` when it may not (see `fold`).
        fold: Option<Vec<&'h Expr>>,
    },
    Alloc {
        tensor: usize,
    },
    Dealloc {
        tensor: usize,
    },
    GetStream {
        var: usize,
    },
    SetStream {
        ord: PreorderIndex,
        stream: Sel<'h>,
    },
    Sync {
        ord: PreorderIndex,
        stream: Sel<'h>,
    },
    Shard {
        ord: PreorderIndex,
        out: usize,
        input: usize,
        axis: usize,
        chunks: u64,
        index: &'h Expr,
    },
    /// Elements `[start, start + length)` of `input` along `axis`.
    Narrow {
        ord: PreorderIndex,
        out: usize,
        input: usize,
        axis: usize,
        start: &'h Expr,
        length: &'h Expr,
    },
    /// A communication: taken by team members; reads and writes the buffers they hold
    /// (`strict`: MoE ops, skipped unless every buffer is held).
    Comm {
        ord: PreorderIndex,
        label: usize,
        team: &'h Team,
        /// The kind and root of a collective (which buffers each member touches).
        collective: Option<(CommKind, Option<&'h Expr>)>,
        reads: Vec<usize>,
        writes: Vec<usize>,
        strict: bool,
    },
    Wait {
        label: usize,
    },
    BeginGroup,
    EndGroup {
        label: usize,
    },
    /// A compute op or kernel launch: runs when every tensor is held.
    Compute {
        ord: PreorderIndex,
        reads: Vec<usize>,
        writes: Vec<usize>,
    },
}

/// The prepared program.
pub(super) struct Prog<'h> {
    pub host: &'h HostProgram,
    pub items: Vec<Item<'h>>,
    /// Instructions by `ord`.
    pub insts: Arena<PreorderIndex, &'h Inst>,
    /// Labels by index.
    pub labels: Vec<CommId>,
    /// Per label, the coalescing group's label it was posted in.
    pub group_of: Vec<Option<usize>>,
    pub loop_vars: usize,
    pub stream_vars: usize,
    /// The `my(mesh, pt)` values that stream choices, chunk indices, roots and loop bounds
    /// read.
    pub my_used: Vec<(MeshId, ParallelType)>,
    /// Whether any of them reads `rank` (then every rank walks on its own).
    pub uses_rank: bool,
}

struct Builder<'h> {
    insts: Arena<PreorderIndex, &'h Inst>,
    label_of: HashMap<CommId, usize>,
    labels: Vec<CommId>,
    group_of: Vec<Option<usize>>,
    open_group: Option<Vec<usize>>,
    loop_vars: usize,
    stream_vars: usize,
    my_used: BTreeSet<(MeshId, ParallelType)>,
    uses_rank: bool,
}

/// True when `e` reads `rank`.
fn reads_rank(e: &Expr) -> bool {
    match e {
        Expr::Rank => true,
        Expr::Bin(_, a, b) => reads_rank(a) || reads_rank(b),
        _ => false,
    }
}

fn idx(t: meshflow_ir::HostTensorId) -> usize {
    t.index()
}

impl<'h> Builder<'h> {
    fn label(&mut self, c: CommId) -> usize {
        let next = self.labels.len();
        let l = *self.label_of.entry(c).or_insert(next);
        if l == next {
            self.labels.push(c);
            self.group_of.push(None);
        }
        l
    }

    fn post(&mut self, c: CommId) -> usize {
        let l = self.label(c);
        if let Some(g) = self.open_group.as_mut() {
            g.push(l);
        }
        l
    }

    fn uses(&mut self, e: &Expr) {
        e.for_each_mesh(&mut |m, pt| {
            self.my_used.insert((m, pt));
        });
        self.uses_rank |= reads_rank(e);
    }

    fn sel(&mut self, s: &'h StreamRef) -> Sel<'h> {
        match s {
            StreamRef::Var(v) => {
                self.stream_vars = self.stream_vars.max(v.0 as usize + 1);
                Sel::Var(v.0 as usize)
            }
            StreamRef::Worker(e) => {
                self.uses(e);
                Sel::Worker(e)
            }
        }
    }

    fn block(&mut self, block: &'h [Inst]) -> Vec<Item<'h>> {
        let mut items = Vec::new();
        for inst in block {
            let ord = self.insts.push(inst);
            let item = match &inst.kind {
                InstKind::ForLoop {
                    index,
                    start,
                    stop,
                    body,
                } => {
                    self.loop_vars = self.loop_vars.max(index.0 as usize + 1);
                    self.uses(start);
                    self.uses(stop);
                    let body = self.block(body);
                    let fold = foldable(&body, *index);
                    Item::Loop {
                        ord,
                        var: *index,
                        start,
                        stop,
                        body,
                        fold,
                    }
                }
                InstKind::Allocate { tensor } => Item::Alloc {
                    tensor: idx(*tensor),
                },
                InstKind::Deallocate { tensor } => Item::Dealloc {
                    tensor: idx(*tensor),
                },
                InstKind::GetCurrentStream { dst } => {
                    self.stream_vars = self.stream_vars.max(dst.0 as usize + 1);
                    Item::GetStream {
                        var: dst.0 as usize,
                    }
                }
                InstKind::SetCurrentStream { stream } => Item::SetStream {
                    ord,
                    stream: self.sel(stream),
                },
                InstKind::Synchronize { stream } => Item::Sync {
                    ord,
                    stream: self.sel(stream),
                },
                InstKind::ShardByStream {
                    out,
                    input,
                    axis,
                    chunks,
                    index,
                } => {
                    self.uses(index);
                    Item::Shard {
                        ord,
                        out: idx(*out),
                        input: idx(*input),
                        axis: *axis,
                        chunks: *chunks,
                        index,
                    }
                }
                InstKind::Narrow {
                    out,
                    input,
                    axis,
                    start,
                    length,
                } => {
                    self.uses(start);
                    self.uses(length);
                    Item::Narrow {
                        ord,
                        out: idx(*out),
                        input: idx(*input),
                        axis: *axis,
                        start,
                        length,
                    }
                }
                InstKind::Wait { comm } => Item::Wait {
                    label: self.label(*comm),
                },
                InstKind::StartCoalescing => {
                    self.open_group = Some(Vec::new());
                    Item::BeginGroup
                }
                InstKind::EndCoalescing { id } => {
                    let members = self.open_group.take().unwrap_or_default();
                    let label = self.label(*id);
                    for m in members {
                        if let Some(g) = self.group_of.get_mut(m) {
                            *g = Some(label);
                        }
                    }
                    Item::EndGroup { label }
                }
                kind @ (InstKind::Compute { .. } | InstKind::CallKernel { .. }) => Item::Compute {
                    ord,
                    reads: kind.reads().into_iter().map(idx).collect(),
                    writes: kind.writes().into_iter().map(idx).collect(),
                },
                kind @ (InstKind::Communication { .. }
                | InstKind::CollectivePermute { .. }
                | InstKind::MoeDispatch { .. }
                | InstKind::MoeCombine { .. }) => {
                    let (Some(id), Some(team)) = (kind.comm_id(), kind.team()) else {
                        continue;
                    };
                    let collective = match kind {
                        InstKind::Communication { kind, root, .. } => {
                            if let Some(r) = root {
                                self.uses(r);
                            }
                            Some((*kind, root.as_ref()))
                        }
                        _ => None,
                    };
                    Item::Comm {
                        ord,
                        label: self.post(id),
                        team,
                        collective,
                        reads: kind.reads().into_iter().map(idx).collect(),
                        writes: kind.writes().into_iter().map(idx).collect(),
                        strict: matches!(
                            kind,
                            InstKind::MoeDispatch { .. } | InstKind::MoeCombine { .. }
                        ),
                    }
                }
            };
            items.push(item);
        }
        items
    }
}

/// The moduli of a loop over `var` whose body may be folded: no inner loop, worker streams
/// periodic in `var`, chunk indices periodic or translating (see `fold`).
fn foldable<'h>(body: &[Item<'h>], var: LoopVar) -> Option<Vec<&'h Expr>> {
    let mut moduli = Vec::new();
    for item in body {
        let dep = match item {
            Item::Loop { .. } => return None,
            Item::SetStream {
                stream: Sel::Worker(e),
                ..
            }
            | Item::Sync {
                stream: Sel::Worker(e),
                ..
            } => match classify(e, var) {
                d if d.is_periodic() => d,
                _ => return None,
            },
            Item::Shard { index, .. } => classify(index, var),
            Item::Narrow { start, length, .. } => {
                for e in [start, length] {
                    match classify(e, var) {
                        Dep::Regular { moduli: m, .. } => moduli.extend(m),
                        Dep::Irregular => return None,
                    }
                }
                continue;
            }
            _ => continue,
        };
        match dep {
            Dep::Regular { moduli: m, .. } => moduli.extend(m),
            Dep::Irregular => return None,
        }
    }
    Some(moduli)
}

impl<'h> Prog<'h> {
    /// Prepares `host`.
    pub fn new(host: &'h HostProgram) -> Prog<'h> {
        let mut b = Builder {
            insts: Arena::new(),
            label_of: HashMap::new(),
            labels: Vec::new(),
            group_of: Vec::new(),
            open_group: None,
            loop_vars: 0,
            stream_vars: 0,
            my_used: BTreeSet::new(),
            uses_rank: false,
        };
        let items = b.block(&host.body);
        Prog {
            host,
            items,
            insts: b.insts,
            labels: b.labels,
            group_of: b.group_of,
            loop_vars: b.loop_vars,
            stream_vars: b.stream_vars,
            my_used: b.my_used.into_iter().collect(),
            uses_rank: b.uses_rank,
        }
    }
}
