//! The host verifier: names, handles, scoping (loops, views, streams, waits, coalescing) and
//! buffer lifetimes. Shape rules of single instructions live in `host_ops.rs`.
//!
//! Lifetimes are checked along program order with each loop body visited once: inputs are
//! bound by the caller; an output that the program never allocates is bound by the caller
//! too; every other buffer must be allocated before use and not used after its deallocate.
//! An allocation inside a loop body must be deallocated in the same body, and a view (the
//! `out` of `shard_by_stream`) lives until the end of the block of its `shard_by_stream`.

use std::collections::{HashMap, HashSet};

use super::names::{axes_word, check_names, name_problem};
use super::{Diagnostic, Location};
use crate::host::{
    Block, CommId, Expr, HostProgram, HostTensorId, Inst, InstKind, LoopVar, StreamRef, StreamVar,
    Team, TensorUse,
};
use crate::mesh::ParallelType;
use crate::span::SourceLoc;
use crate::text::inst_to_string;

/// The state of a buffer along program order.
#[derive(Clone)]
pub(super) enum Alloc {
    /// Allocated in the block at depth `depth` by the instruction at `location`.
    Live { depth: usize, location: Location },
    /// Deallocated.
    Freed,
}

pub(super) struct HostChecker<'a> {
    pub p: &'a HostProgram,
    pub diags: Vec<Diagnostic>,
    /// Tensors that are the `out` of some `shard_by_stream`.
    pub views: HashSet<HostTensorId>,
    /// Tensors named by some `allocate`.
    pub allocated_somewhere: HashSet<HostTensorId>,
    pub alloc: HashMap<HostTensorId, Alloc>,
    /// Views whose `shard_by_stream` has run, with the depth of its block.
    pub live_views: HashMap<HostTensorId, usize>,
    pub seen_views: HashSet<HostTensorId>,
    loop_vars: Vec<LoopVar>,
    streams: HashSet<StreamVar>,
    comm_defs: HashMap<CommId, SourceLoc>,
    /// Labels defined in each enclosing block, innermost last.
    comm_scopes: Vec<Vec<CommId>>,
}

/// Every error of `p`, in program order.
pub(super) fn check(p: &HostProgram) -> Vec<Diagnostic> {
    let mut views = HashSet::new();
    let mut allocated_somewhere = HashSet::new();
    p.walk(&mut |inst, _| {
        for (how, t) in inst.kind.operands() {
            match how {
                TensorUse::View => {
                    views.insert(t);
                }
                TensorUse::Allocated => {
                    allocated_somewhere.insert(t);
                }
                TensorUse::Read
                | TensorUse::Written
                | TensorUse::Updated
                | TensorUse::Deallocated
                | TensorUse::Viewed => {}
            }
        }
    });
    let mut c = HostChecker {
        p,
        diags: Vec::new(),
        views,
        allocated_somewhere,
        alloc: HashMap::new(),
        live_views: HashMap::new(),
        seen_views: HashSet::new(),
        loop_vars: Vec::new(),
        streams: HashSet::new(),
        comm_defs: HashMap::new(),
        comm_scopes: Vec::new(),
    };
    c.declarations();
    let mut path = Vec::new();
    c.block(&p.body, &mut path, None);
    c.diags
}

impl HostChecker<'_> {
    pub fn push(&mut self, location: &Location, message: String) {
        self.diags.push(Diagnostic {
            location: location.clone(),
            message,
        });
    }

    pub fn name(&self, t: HostTensorId) -> String {
        self.p
            .tensors
            .get(t)
            .map_or_else(|| format!("{t:?}"), |d| d.name.clone())
    }

    fn declarations(&mut self) {
        if let Some(message) = name_problem(&self.p.name, "program") {
            self.diags.push(Diagnostic {
                location: Location::Program,
                message,
            });
        }
        let mut entities: Vec<(&str, &str, Location)> = Vec::new();
        for m in self.p.meshes.values() {
            let location = Location::Mesh {
                name: m.name.clone(),
                loc: m.loc,
            };
            entities.push(("mesh", &m.name, location));
        }
        for t in self.p.tensors.values() {
            let location = Location::Tensor {
                name: t.name.clone(),
                loc: t.loc,
            };
            entities.push(("tensor", &t.name, location));
        }
        check_names(&entities, &mut self.diags);
        for t in self.p.tensors.values() {
            if !self.p.meshes.contains(t.mesh) {
                self.diags.push(Diagnostic {
                    location: Location::Tensor {
                        name: t.name.clone(),
                        loc: t.loc,
                    },
                    message: format!(
                        "mesh handle {:?} of `{}` is out of range (the program has {} meshes)",
                        t.mesh,
                        t.name,
                        self.p.meshes.len()
                    ),
                });
            }
        }
    }

    fn block(&mut self, block: &Block, path: &mut Vec<usize>, in_loop: Option<&Location>) {
        let depth = self.comm_scopes.len();
        self.comm_scopes.push(Vec::new());
        let mut group: Option<Location> = None;
        for (i, inst) in block.iter().enumerate() {
            path.push(i);
            let here = Location::Inst {
                path: path.clone(),
                text: inst_to_string(self.p, inst),
                loc: inst.loc,
            };
            self.coalescing(inst, &here, &mut group);
            self.inst(inst, &here, depth, path);
            path.pop();
        }
        if let Some(start) = group {
            self.push(
                &start,
                "`start_coalescing` has no `end_coalescing` in the same block".to_string(),
            );
        }
        // Allocations of this loop body that are still live.
        if let Some(for_loc) = in_loop {
            let leaked: Vec<(HostTensorId, Location)> = self
                .alloc
                .iter()
                .filter_map(|(&t, a)| match a {
                    Alloc::Live { depth: d, location } if *d == depth => {
                        Some((t, location.clone()))
                    }
                    _ => None,
                })
                .collect();
            let mut leaked = leaked;
            leaked.sort_by_key(|(t, _)| *t);
            let loop_text = match for_loc {
                Location::Inst { text, .. } => text.clone(),
                _ => String::new(),
            };
            for (t, location) in leaked {
                let message = format!(
                    "`{}` is allocated in the body of `{loop_text}` but not deallocated in it",
                    self.name(t)
                );
                self.push(&location, message);
                // Treat it as allocated outside to avoid cascading errors.
                self.alloc.insert(
                    t,
                    Alloc::Live {
                        depth: depth.saturating_sub(1),
                        location,
                    },
                );
            }
        }
        self.live_views.retain(|_, d| *d < depth);
        self.comm_scopes.pop();
    }

    fn coalescing(&mut self, inst: &Inst, here: &Location, group: &mut Option<Location>) {
        match &inst.kind {
            InstKind::StartCoalescing => {
                if group.is_some() {
                    self.push(
                        here,
                        "nested `start_coalescing`: a coalescing group is already open".to_string(),
                    );
                } else {
                    *group = Some(here.clone());
                }
            }
            InstKind::EndCoalescing { .. } => {
                let open = group.take();
                if open.is_none() {
                    self.push(
                        here,
                        "`end_coalescing` without a `start_coalescing` in the same block"
                            .to_string(),
                    );
                }
            }
            kind if group.is_some() && !kind.is_communication() => {
                let text = match here {
                    Location::Inst { text, .. } => text.clone(),
                    _ => String::new(),
                };
                self.push(
                    here,
                    format!("`{text}` is inside a coalescing group; only communications may be"),
                );
            }
            _ => {}
        }
    }

    fn inst(&mut self, inst: &Inst, here: &Location, depth: usize, path: &mut Vec<usize>) {
        let kind = &inst.kind;
        let text = match here {
            Location::Inst { text, .. } => text.clone(),
            _ => String::new(),
        };
        for e in kind.exprs() {
            self.expr(e, here);
        }
        let mut handles_ok = true;
        for t in kind.tensors() {
            if !self.p.tensors.contains(t) {
                handles_ok = false;
                self.push(
                    here,
                    format!(
                        "tensor handle {t:?} is out of range (the program has {} tensors)",
                        self.p.tensors.len()
                    ),
                );
            }
        }
        let team_size = kind.team().and_then(|team| self.team(team, here));
        if let Some(id) = kind.comm_id() {
            self.define_comm(id, inst.loc, here);
        }
        match kind {
            InstKind::Allocate { tensor } if handles_ok => self.allocate(*tensor, depth, here),
            InstKind::Deallocate { tensor } if handles_ok => self.deallocate(*tensor, depth, here),
            InstKind::ForLoop { index, body, .. } => {
                if self.loop_vars.contains(index) {
                    self.push(
                        here,
                        format!("loop variable `{index}` shadows an enclosing loop's variable"),
                    );
                }
                self.loop_vars.push(*index);
                self.block(body, path, Some(here));
                self.loop_vars.pop();
            }
            InstKind::GetCurrentStream { dst } => {
                self.streams.insert(*dst);
            }
            InstKind::SetCurrentStream { stream } | InstKind::Synchronize { stream } => {
                if let StreamRef::Var(v) = stream {
                    if !self.streams.contains(v) {
                        self.push(
                            here,
                            format!("stream `{v}` is used before `{v} = get_current_stream`"),
                        );
                    }
                }
            }
            InstKind::ShardByStream { out, input, .. } | InstKind::Narrow { out, input, .. }
                if handles_ok =>
            {
                self.use_tensor(*input, "viewed", &text, here);
                self.shard_by_stream(kind, here);
                self.narrow(kind, here);
                self.live_views.insert(*out, depth);
                self.seen_views.insert(*out);
            }
            InstKind::Wait { comm } if !self.comm_scopes.iter().any(|s| s.contains(comm)) => {
                self.push(
                    here,
                    format!(
                        "a Wait without its communication: `{comm}` is not defined earlier in \
                         this block or an enclosing one"
                    ),
                );
            }
            InstKind::Wait { .. } => {}
            _ if handles_ok => {
                for t in kind.reads() {
                    self.use_tensor(t, "read", &text, here);
                }
                for t in kind.writes() {
                    self.use_tensor(t, "written", &text, here);
                }
                self.shapes(kind, team_size, here);
            }
            _ => {}
        }
    }

    fn define_comm(&mut self, id: CommId, loc: SourceLoc, here: &Location) {
        if let Some(first) = self.comm_defs.get(&id) {
            let at = first
                .span()
                .map(|s| format!(" (at {s})"))
                .unwrap_or_default();
            self.push(
                here,
                format!("communication label `{id}` is already defined{at}"),
            );
        } else {
            self.comm_defs.insert(id, loc);
        }
        if let Some(scope) = self.comm_scopes.last_mut() {
            scope.push(id);
        }
    }

    /// Checks loop variables and `my(...)` in `e`.
    fn expr(&mut self, e: &Expr, here: &Location) {
        let mut unbound = Vec::new();
        e.for_each_loop_var(&mut |v| {
            if !self.loop_vars.contains(&v) && !unbound.contains(&v) {
                unbound.push(v);
            }
        });
        for v in unbound {
            self.push(
                here,
                format!("loop variable `{v}` is used outside its loop"),
            );
        }
        let mut mys = Vec::new();
        e.for_each_mesh(&mut |m, pt| mys.push((m, pt)));
        for (m, pt) in mys {
            let Some(decl) = self.p.meshes.get(m) else {
                self.push(
                    here,
                    format!(
                        "`my({m:?}, {pt})` names mesh handle {m:?}, out of range (the program \
                         has {} meshes)",
                        self.p.meshes.len()
                    ),
                );
                continue;
            };
            if !pt.is_device() {
                self.push(
                    here,
                    format!(
                        "`my({}, {pt})`: {pt} is not a device parallel type",
                        decl.name
                    ),
                );
            } else if decl.mesh.size_of(pt).is_none() {
                self.push(
                    here,
                    format!(
                        "`my({0}, {pt})`: mesh `{0}` has {1}, so it has no {pt}",
                        decl.name,
                        axes_word(decl.mesh.ndims())
                    ),
                );
            }
        }
    }

    /// Checks a team; returns its size when it is statically known.
    fn team(&mut self, team: &Team, here: &Location) -> Option<usize> {
        match team {
            Team::Slice { mesh, pt } => {
                let Some(decl) = self.p.meshes.get(*mesh) else {
                    self.push(
                        here,
                        format!("team names mesh handle {mesh:?}, out of range"),
                    );
                    return None;
                };
                if !pt.is_device() {
                    self.push(
                        here,
                        format!(
                            "team `slice({}, {pt})`: {pt} is not a device parallel type",
                            decl.name
                        ),
                    );
                    return None;
                }
                let size = decl.mesh.size_of(*pt);
                if size.is_none() {
                    self.push(
                        here,
                        format!(
                            "team `slice({0}, {pt})`: mesh `{0}` has {1}, so it has no {pt}",
                            decl.name,
                            axes_word(decl.mesh.ndims())
                        ),
                    );
                }
                size
            }
            Team::Flattened { mesh, pts } => {
                let Some(decl) = self.p.meshes.get(*mesh) else {
                    self.push(
                        here,
                        format!("team names mesh handle {mesh:?}, out of range"),
                    );
                    return None;
                };
                let names: Vec<&str> = pts.iter().map(|p| p.name()).collect();
                let text = format!("flattened({}, {})", decl.name, names.join(", "));
                if pts.len() < 2 {
                    self.push(
                        here,
                        format!(
                            "team `{text}` flattens {} parallel type(s); it needs at least two \
                             (one is `slice(mesh, pt)`)",
                            pts.len()
                        ),
                    );
                    return None;
                }
                if let Some(pt) = pts.iter().find(|pt| !pt.is_device()) {
                    self.push(
                        here,
                        format!("team `{text}`: {pt} is not a device parallel type"),
                    );
                    return None;
                }
                let axes: Option<Vec<usize>> =
                    pts.iter().map(|&pt| decl.mesh.axis_of(pt)).collect();
                let Some(axes) = axes else {
                    let pt = pts
                        .iter()
                        .find(|&&pt| decl.mesh.axis_of(pt).is_none())
                        .copied()
                        .unwrap_or(ParallelType::DIDx);
                    self.push(
                        here,
                        format!(
                            "team `{text}`: mesh `{}` has {}, so it has no {pt}",
                            decl.name,
                            axes_word(decl.mesh.ndims())
                        ),
                    );
                    return None;
                };
                if axes.windows(2).any(|w| w[0] >= w[1]) {
                    self.push(
                        here,
                        format!(
                            "team `{text}`: the parallel types must be distinct and listed \
                             outermost mesh axis first (DIDz, DIDy, DIDx)"
                        ),
                    );
                    return None;
                }
                team.size(&self.p.meshes)
            }
            Team::Mesh(mesh) => match self.p.meshes.get(*mesh) {
                Some(decl) => Some(decl.mesh.size()),
                None => {
                    self.push(
                        here,
                        format!("team names mesh handle {mesh:?}, out of range"),
                    );
                    None
                }
            },
            Team::Devices(devices) => {
                if devices.is_empty() {
                    self.push(here, "team `devices()` is empty".to_string());
                    return None;
                }
                let mut seen = HashSet::new();
                for d in devices {
                    if !seen.insert(*d) {
                        self.push(here, format!("device {d} appears twice in the team"));
                        return None;
                    }
                }
                Some(devices.len())
            }
        }
    }
}
