//! One rank's walk: streams, events and waits as vector clocks, buffer accesses checked
//! against each buffer's shadow, long loops folded (see the parent module).

use std::collections::HashMap;
use std::sync::Arc;

use meshflow_ir::host::ExprEnv;
use meshflow_ir::{
    CommKind, DeviceId, EntityRef, Expr, HostTensorId, LoopVar, MeshId, ParallelType, Role, Team,
};

mod plan;

use super::fold::Window;
use super::prog::{Item, Prog, Sel};
use super::{Findings, Rank};
use crate::ordering::{collective_accesses, Access, Clocks, Region, Scope, Shadow, Span};
use crate::runtime::backend::PreorderIndex;

/// Loops with more iterations than this may be folded.
pub(super) const UNROLL: i64 = 64;
/// The largest period a folded loop may have.
const MAX_PERIOD: u64 = 64;
/// The farthest apart (in iterations) two translated chunks of a folded loop may meet.
const MAX_REACH: i64 = 4096;

/// Per access (instruction, operand), how it moves from one period to the next: the axis
/// and the step in elements (only accesses that move).
type Shifts = HashMap<(PreorderIndex, u8), (usize, i64)>;

/// Per access (instruction, operand), its buffer and region.
type Seen = HashMap<(PreorderIndex, u8), (usize, Vec<Span>)>;

/// Who made an access, for reports.
#[derive(Clone, Debug)]
pub(super) struct At {
    pub ord: PreorderIndex,
    pub iteration: Arc<[(LoopVar, i64)]>,
    /// The worker number of the stream it ran on or was posted from (`None`: main).
    pub stream: Option<i64>,
    /// The communication label, for a communication.
    pub label: Option<usize>,
    pub write: bool,
    pub tensor: usize,
    /// It stands for the iterations a folded loop skips (one period apart up to this one).
    pub stands_for: Option<(LoopVar, i64, i64)>,
}

#[derive(Clone, Debug)]
struct View {
    buffer: usize,
    spans: Vec<Span>,
}

struct Buf {
    shape: Vec<u64>,
    tensor: usize,
    shadow: Shadow<At>,
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Mode {
    /// Check and record accesses.
    Record,
    /// Only move the clocks (a folded loop's gap).
    Clocks,
}

/// A folded loop's boundary iteration: its translated accesses also stand for the skipped
/// iterations of their class (`+1`: checked against what came before the loop; `-1`:
/// recorded for what comes after it).
struct Boundary {
    loop_id: u64,
    entry_seq: u64,
    dir: i64,
    var: LoopVar,
    value: i64,
    window: Window,
    shifts: Shifts,
}

pub(super) struct Walker<'p, 'h, 'f> {
    prog: &'p Prog<'h>,
    pub rank: DeviceId,
    my: Vec<[Option<i64>; 3]>,
    flat: Vec<Option<usize>>,
    in_mesh: Vec<bool>,
    held: Vec<bool>,
    loops: Vec<Option<i64>>,
    iteration: Vec<(LoopVar, i64)>,
    iter_arc: Arc<[(LoopVar, i64)]>,
    clocks: Clocks,
    /// Worker numbers by stream index (`None`: the main stream, index 0).
    streams: Vec<Option<i64>>,
    stream_of: HashMap<i64, usize>,
    saved: Vec<Option<usize>>,
    current: usize,
    pending: Vec<Option<Arc<[u32]>>>,
    group: Option<Vec<Arc<[u32]>>>,
    views: Vec<Option<View>>,
    bufs: Vec<Buf>,
    active: Vec<u64>,
    next_loop: u64,
    seq: u64,
    mode: Mode,
    boundary: Option<Boundary>,
    out: &'f mut Findings,
}

struct Env<'a> {
    loops: &'a [Option<i64>],
    my: &'a [[Option<i64>; 3]],
    rank: DeviceId,
}

impl ExprEnv for Env<'_> {
    fn loop_value(&self, var: LoopVar) -> Option<i64> {
        self.loops.get(var.0 as usize).copied().flatten()
    }

    fn my_index(&self, mesh: MeshId, pt: ParallelType) -> Option<i64> {
        self.my.get(mesh.index())?[pt.device_rank()?]
    }

    fn rank(&self) -> DeviceId {
        self.rank
    }
}

/// A flat (row-major) view of the whole of a buffer of `shape`.
fn whole(shape: &[u64]) -> Vec<Span> {
    shape.iter().map(|&e| Span::new(0, e)).collect()
}

impl<'p, 'h, 'f> Walker<'p, 'h, 'f> {
    pub fn new(prog: &'p Prog<'h>, rank: &Rank, out: &'f mut Findings) -> Walker<'p, 'h, 'f> {
        let host = prog.host;
        let mut w = Walker {
            prog,
            rank: rank.device,
            my: rank.my.clone(),
            flat: rank.flat.clone(),
            in_mesh: rank.in_mesh.clone(),
            held: rank.held.clone(),
            loops: vec![None; prog.loop_vars],
            iteration: Vec::new(),
            iter_arc: Arc::from(Vec::new()),
            clocks: Clocks::new(prog.labels.len()),
            streams: vec![None],
            stream_of: HashMap::new(),
            saved: vec![None; prog.stream_vars],
            current: 0,
            pending: vec![None; prog.labels.len()],
            group: None,
            views: vec![None; host.tensors.len()],
            bufs: Vec::new(),
            active: Vec::new(),
            next_loop: 0,
            seq: 0,
            mode: Mode::Record,
            boundary: None,
            out,
        };
        for (id, t) in host.tensors.iter() {
            let i = id.index();
            if t.role != Role::Internal && w.held.get(i).copied().unwrap_or(false) {
                w.bind(i);
            }
        }
        w
    }

    /// Gives `tensor` a fresh buffer.
    fn bind(&mut self, tensor: usize) {
        let Some(t) = self.prog.host.tensors.get(HostTensorId::new(tensor)) else {
            return;
        };
        self.bufs.push(Buf {
            shape: t.shape.clone(),
            tensor,
            shadow: Shadow::new(),
        });
        self.views[tensor] = Some(View {
            buffer: self.bufs.len() - 1,
            spans: whole(&t.shape),
        });
    }

    fn eval(&mut self, ord: PreorderIndex, what: &'static str, e: &Expr) -> Option<i64> {
        let env = Env {
            loops: &self.loops,
            my: &self.my,
            rank: self.rank,
        };
        match e.eval(&env) {
            Ok(v) => Some(v),
            Err(error) => {
                let at = self.iter_arc.clone();
                self.out.eval_error(self.rank, ord, what, at, error);
                None
            }
        }
    }

    fn quiet_eval(&self, e: &Expr) -> Option<i64> {
        let env = Env {
            loops: &self.loops,
            my: &self.my,
            rank: self.rank,
        };
        e.eval(&env).ok()
    }

    fn stream_index(&mut self, worker: i64) -> usize {
        if let Some(&s) = self.stream_of.get(&worker) {
            return s;
        }
        self.streams.push(Some(worker));
        let s = self.streams.len() - 1;
        self.stream_of.insert(worker, s);
        s
    }

    fn stream_key(&self) -> Option<i64> {
        self.streams.get(self.current).copied().flatten()
    }

    fn stream(&mut self, ord: PreorderIndex, sel: &Sel<'_>) -> Option<usize> {
        match sel {
            Sel::Var(v) => self.saved.get(*v).copied().flatten(),
            Sel::Worker(e) => {
                let w = self.eval(ord, "worker stream", e)?;
                Some(self.stream_index(w))
            }
        }
    }

    fn in_team(&self, team: &Team) -> bool {
        match team {
            Team::Devices(d) => d.contains(&self.rank),
            Team::Mesh(m) => self.rank_in_mesh(*m),
            Team::Flattened { mesh, pts } => {
                self.rank_in_mesh(*mesh)
                    && self.prog.host.meshes.get(*mesh).is_some_and(|d| {
                        !pts.is_empty() && pts.iter().all(|&pt| d.mesh.axis_of(pt).is_some())
                    })
            }
            Team::Slice { mesh, pt } => {
                self.rank_in_mesh(*mesh)
                    && self
                        .prog
                        .host
                        .meshes
                        .get(*mesh)
                        .is_some_and(|d| d.mesh.axis_of(*pt).is_some())
            }
        }
    }

    /// This rank's index in `team`.
    fn team_index(&self, team: &Team) -> Option<i64> {
        super::team_index(self.prog.host, self.rank, &self.my, &self.flat, team)
    }

    /// The buffers this member of a communication touches (a rooted collective's members
    /// touch one side each; see [`collective_accesses`]).
    fn roles<'a>(
        &self,
        collective: Option<(CommKind, Option<&Expr>)>,
        team: &Team,
        reads: &'a [usize],
        writes: &'a [usize],
    ) -> (&'a [usize], &'a [usize]) {
        let Some((kind, root)) = collective else {
            return (reads, writes);
        };
        let is_root = match root {
            Some(r) => self
                .quiet_eval(r)
                .is_some_and(|r| Some(r) == self.team_index(team)),
            None => false,
        };
        let (r, w) = collective_accesses(kind, is_root);
        (if r { reads } else { &[] }, if w { writes } else { &[] })
    }

    fn rank_in_mesh(&self, m: MeshId) -> bool {
        self.in_mesh.get(m.index()).copied().unwrap_or(false)
    }

    fn held(&self, t: usize) -> bool {
        self.held.get(t).copied().unwrap_or(false)
    }

    /// Runs the program.
    pub fn run(&mut self) -> Result<(), super::TooLarge> {
        let prog = self.prog;
        self.block(&prog.items)
    }

    fn block(&mut self, items: &[Item<'_>]) -> Result<(), super::TooLarge> {
        for item in items {
            self.out.spend()?;
            self.item(item)?;
        }
        Ok(())
    }

    fn item(&mut self, item: &Item<'_>) -> Result<(), super::TooLarge> {
        match item {
            Item::Loop {
                ord,
                var,
                start,
                stop,
                body,
                fold,
            } => self.run_loop(*ord, *var, start, stop, body, fold.as_deref())?,
            Item::Alloc { tensor } => self.allocate(*tensor),
            Item::Dealloc { tensor } => {
                if let Some(v) = self.views.get_mut(*tensor) {
                    *v = None;
                }
            }
            Item::GetStream { var } => {
                if let Some(s) = self.saved.get_mut(*var) {
                    *s = Some(self.current);
                }
            }
            Item::SetStream { ord, stream } => {
                if let Some(s) = self.stream(*ord, stream) {
                    self.current = s;
                }
            }
            Item::Sync { ord, stream } => {
                if let Some(s) = self.stream(*ord, stream) {
                    self.clocks.sync(self.current, s);
                }
            }
            Item::Shard {
                ord,
                out,
                input,
                axis,
                chunks,
                index,
            } => {
                if !(self.held(*out) && self.held(*input)) {
                    return Ok(());
                }
                let i = self.eval(*ord, "chunk index", index);
                let view = i.and_then(|i| {
                    let parent = self.views.get(*input)?.as_ref()?;
                    shard(parent, *axis, *chunks, i)
                });
                if let Some(v) = self.views.get_mut(*out) {
                    *v = view;
                }
            }
            Item::Narrow {
                ord,
                out,
                input,
                axis,
                start,
                length,
            } => {
                if !(self.held(*out) && self.held(*input)) {
                    return Ok(());
                }
                let s = self.eval(*ord, "narrow start", start);
                let l = self.eval(*ord, "narrow length", length);
                let view = s.zip(l).and_then(|(s, l)| {
                    let parent = self.views.get(*input)?.as_ref()?;
                    narrow(parent, *axis, s, l)
                });
                if let Some(v) = self.views.get_mut(*out) {
                    *v = view;
                }
            }
            Item::Comm {
                ord,
                label,
                team,
                collective,
                reads,
                writes,
                strict,
            } => {
                if !self.in_team(team) {
                    return Ok(());
                }
                let (reads, writes) = self.roles(*collective, team, reads, writes);
                let all_held = reads.iter().chain(writes).all(|&t| self.held(t));
                if *strict && !all_held {
                    return Ok(());
                }
                let clock = self.clocks.post(self.current, *label);
                if let Some(p) = self.pending.get_mut(*label) {
                    *p = Some(clock.clone());
                }
                if let Some(g) = self.group.as_mut() {
                    g.push(clock.clone());
                }
                let epoch = clock.get(*label).copied().unwrap_or(0);
                let site = (self.stream_key(), Some(*label));
                self.accesses(*ord, reads, writes, *label, epoch, &clock, site);
            }
            Item::Wait { label } => {
                if let Some(Some(c)) = self.pending.get(*label).cloned() {
                    self.clocks.join(self.current, &c);
                }
            }
            Item::BeginGroup => self.group = Some(Vec::new()),
            Item::EndGroup { label } => {
                let members = self.group.take().unwrap_or_default();
                let mut clock = self.clocks.post(self.current, *label).to_vec();
                for m in members {
                    crate::ordering::join_into(&mut clock, &m);
                }
                if let Some(p) = self.pending.get_mut(*label) {
                    *p = Some(clock.into());
                }
            }
            Item::Compute { ord, reads, writes } => {
                if !reads.iter().chain(writes).all(|&t| self.held(t)) {
                    return Ok(());
                }
                let (timeline, epoch) = self.clocks.tick(self.current);
                let clock = self.clocks.clock(self.current).to_vec();
                let site = (self.stream_key(), None);
                self.accesses(*ord, reads, writes, timeline, epoch, &clock, site);
            }
        }
        Ok(())
    }

    fn allocate(&mut self, tensor: usize) {
        let Some(t) = self.prog.host.tensors.get(HostTensorId::new(tensor)) else {
            return;
        };
        if !self.held(tensor) || t.role == Role::Input {
            return;
        }
        if t.role == Role::Output && self.views.get(tensor).is_some_and(Option::is_some) {
            return;
        }
        self.bind(tensor);
    }

    /// Checks, then records, the accesses of one instruction.
    #[allow(clippy::too_many_arguments)]
    fn accesses(
        &mut self,
        ord: PreorderIndex,
        reads: &[usize],
        writes: &[usize],
        timeline: usize,
        epoch: u32,
        clock: &[u32],
        (stream, label): (Option<i64>, Option<usize>),
    ) {
        if self.mode == Mode::Clocks {
            return;
        }
        let operands: Vec<(u8, usize, bool)> = reads
            .iter()
            .map(|&t| (t, false))
            .chain(writes.iter().map(|&t| (t, true)))
            .enumerate()
            .map(|(k, (t, w))| (k as u8, t, w))
            .collect();
        let mut planned = Vec::with_capacity(operands.len());
        for (k, t, write) in operands {
            let Some(view) = self.views.get(t).cloned().flatten() else {
                continue;
            };
            let site = At {
                ord,
                iteration: self.iter_arc.clone(),
                stream,
                label,
                write,
                tensor: t,
                stands_for: None,
            };
            let union = self.union(ord, k, &view);
            planned.push((view, site, union));
        }
        let scope = Scope {
            active_loops: &self.active,
            born_before: None,
            seq: self.seq,
            stands_for: None,
        };
        for (view, site, union) in &planned {
            let Some(buf) = self.bufs.get_mut(view.buffer) else {
                continue;
            };
            let region = Arc::new(Region::Boxed(view.spans.clone()));
            let access = Access {
                region: &region,
                write: site.write,
                timeline,
                epoch,
                clock,
                site: site.clone(),
            };
            if let Some(e) = buf.shadow.conflict(&buf.shape, &access, &scope) {
                let buffer = buf.tensor;
                self.out.race(self.rank, buffer, e.site, site.clone());
                continue;
            }
            let (Some((region, stands)), Some(b)) = (union, &self.boundary) else {
                continue;
            };
            if b.dir > 0 {
                let before = Scope {
                    born_before: Some(b.entry_seq),
                    ..scope
                };
                let mut later = site.clone();
                later.stands_for = Some(*stands);
                let access = Access {
                    region,
                    site: later.clone(),
                    ..access
                };
                if let Some(e) = buf.shadow.conflict(&buf.shape, &access, &before) {
                    let buffer = buf.tensor;
                    self.out.race(self.rank, buffer, e.site, later);
                }
            }
        }
        for (view, site, union) in planned {
            let Some(buf) = self.bufs.get_mut(view.buffer) else {
                continue;
            };
            let region = Arc::new(Region::Boxed(view.spans));
            let access = Access {
                region: &region,
                write: site.write,
                timeline,
                epoch,
                clock,
                site: site.clone(),
            };
            buf.shadow.record(&buf.shape, &access, &scope);
            if let (Some((region, stands)), Some(b)) = (union, &self.boundary) {
                if b.dir < 0 {
                    let mut standing = site;
                    standing.stands_for = Some(stands);
                    let access = Access {
                        region: &region,
                        site: standing,
                        ..access
                    };
                    let rec = Scope {
                        stands_for: Some(b.loop_id),
                        ..scope
                    };
                    buf.shadow.record(&buf.shape, &access, &rec);
                }
            }
        }
        self.seq += 1;
    }

    /// At a folded loop's boundary, the region standing for the skipped iterations of the
    /// access's class, when the access translates with the loop.
    fn union(
        &self,
        ord: PreorderIndex,
        k: u8,
        view: &View,
    ) -> Option<(Arc<Region>, (LoopVar, i64, i64))> {
        let b = self.boundary.as_ref()?;
        let &(axis, step) = b.shifts.get(&(ord, k))?;
        let (u0, u1) = b.window.unrecorded();
        let p = b.window.period;
        // Members of the class in u0..u1: value + dir * q * p for q = 1..=count.
        let (count, last) = if b.dir > 0 {
            let count = (u1 - 1 - b.value) / p;
            (count, b.value + count * p)
        } else {
            let count = (b.value - u0) / p;
            (count, b.value - count * p)
        };
        if count <= 0 {
            return None;
        }
        let span = view.spans.get(axis)?;
        let len = span.hi - span.lo;
        let delta = b.dir * step;
        let first = if delta > 0 {
            span.lo.checked_add(delta.unsigned_abs())?
        } else {
            span.lo
                .checked_sub(delta.unsigned_abs().checked_mul(count as u64)?)?
        };
        let mut spans = view.spans.clone();
        spans[axis] = Span::periodic(first, len, step.unsigned_abs(), count as u64);
        Some((Arc::new(Region::Boxed(spans)), (b.var, p, last)))
    }

    fn set_iteration(&mut self, var: LoopVar, value: Option<i64>) {
        if let Some(slot) = self.loops.get_mut(var.0 as usize) {
            *slot = value;
        }
        match value {
            Some(v) => self.iteration.push((var, v)),
            None => {
                self.iteration.pop();
            }
        }
        self.iter_arc = self.iteration.as_slice().into();
    }

    fn iterate(&mut self, var: LoopVar, v: i64, body: &[Item<'_>]) -> Result<(), super::TooLarge> {
        self.set_iteration(var, Some(v));
        let r = self.block(body);
        self.set_iteration(var, None);
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn run_loop(
        &mut self,
        ord: PreorderIndex,
        var: LoopVar,
        start: &Expr,
        stop: &Expr,
        body: &[Item<'_>],
        fold: Option<&[&Expr]>,
    ) -> Result<(), super::TooLarge> {
        let (Some(start), Some(stop)) = (
            self.eval(ord, "loop bounds", start),
            self.eval(ord, "loop bounds", stop),
        ) else {
            return Ok(());
        };
        let plan = match fold {
            Some(moduli)
                if self.out.fold
                    && stop.saturating_sub(start) > UNROLL
                    && self.mode == Mode::Record =>
            {
                self.plan_fold(var, start, stop, body, moduli)
            }
            _ => None,
        };
        let Some((window, shifts)) = plan else {
            for v in start..stop {
                self.iterate(var, v, body)?;
            }
            return Ok(());
        };
        let loop_id = self.next_loop;
        self.next_loop += 1;
        self.active.push(loop_id);
        let entry_seq = self.seq;
        let p = window.period;
        let front_end = start + window.front;
        let boundary = |dir: i64, value: i64| Boundary {
            loop_id,
            entry_seq,
            dir,
            var,
            value,
            window,
            shifts: shifts.clone(),
        };
        let mut result = Ok(());
        for v in start..front_end {
            self.boundary = (v >= front_end - p).then(|| boundary(1, v));
            result = self.iterate(var, v, body);
            if result.is_err() {
                break;
            }
        }
        self.boundary = None;
        if result.is_ok() {
            self.mode = Mode::Clocks;
            for v in front_end..front_end + window.gap {
                result = self.iterate(var, v, body);
                if result.is_err() {
                    break;
                }
            }
            self.mode = Mode::Record;
        }
        if result.is_ok() {
            let back = window.back_start();
            for v in back..stop {
                self.boundary = (v < back + p).then(|| boundary(-1, v));
                result = self.iterate(var, v, body);
                if result.is_err() {
                    break;
                }
            }
        }
        self.boundary = None;
        self.active.pop();
        result
    }
}

/// Elements `[start, start + length)` of `parent` along `axis`, or `None` when they do not
/// lie inside it (the runtime reports that).
fn narrow(parent: &View, axis: usize, start: i64, length: i64) -> Option<View> {
    let span = parent.spans.get(axis)?;
    let (start, length) = (u64::try_from(start).ok()?, u64::try_from(length).ok()?);
    let lo = span.lo.checked_add(start)?;
    let hi = lo.checked_add(length)?;
    if span.period != 0 || hi > span.hi {
        return None;
    }
    let mut spans = parent.spans.clone();
    spans[axis] = Span::new(lo, hi);
    Some(View {
        buffer: parent.buffer,
        spans,
    })
}

/// Chunk `index` of `chunks` of `parent` along `axis`, or `None` when it does not exist
/// (the runtime reports that).
fn shard(parent: &View, axis: usize, chunks: u64, index: i64) -> Option<View> {
    let span = parent.spans.get(axis)?;
    let extent = span.hi.checked_sub(span.lo)?;
    if chunks == 0 || extent % chunks != 0 || span.period != 0 {
        return None;
    }
    let index = u64::try_from(index).ok().filter(|&i| i < chunks)?;
    let part = extent / chunks;
    let mut spans = parent.spans.clone();
    spans[axis] = Span::new(span.lo + index * part, span.lo + (index + 1) * part);
    Some(View {
        buffer: parent.buffer,
        spans,
    })
}
