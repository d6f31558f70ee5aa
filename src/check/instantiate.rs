//! Instantiating a host program on every rank: unroll loops, evaluate roots and peers, keep
//! the communications the rank takes part in.

use std::collections::{HashMap, HashSet};

use meshflow_ir::host::ExprEnv;
use meshflow_ir::text::inst_to_string;
use meshflow_ir::{
    host::Side, Arena, BufferUse, CommKind, DeviceId, Expr, HostProgram, HostTensorId, Inst,
    InstKind, LoopVar, MeshDecl, MeshId, ParallelType, Team,
};

use super::error::{CheckError, CheckErrors, Site};
use super::events::{Buffer, CommEvent, Cut, EventKind, InstInfo, Instances, Iteration, Slice};
use super::teams::TeamTable;

/// The most loop iterations plus communications instantiated over all ranks.
pub const MAX_INSTANCES: usize = 1_000_000;

/// The instructions that matter to the check, with their index in [`Instances::insts`].
enum Item<'a> {
    Loop {
        ord: usize,
        index: LoopVar,
        start: &'a Expr,
        stop: &'a Expr,
        body: Vec<Item<'a>>,
    },
    Comm {
        ord: usize,
        inst: &'a Inst,
    },
    StartGroup {
        ord: usize,
    },
    EndGroup {
        ord: usize,
    },
    /// A view (`shard_by_stream`, `narrow`): its per-rank shape sizes later communications.
    View {
        ord: usize,
        inst: &'a Inst,
    },
}

fn build_items<'a>(
    host: &HostProgram,
    block: &'a [Inst],
    insts: &mut Vec<InstInfo>,
) -> Vec<Item<'a>> {
    /// What the check keeps of an instruction.
    enum Kept<'a> {
        Loop(LoopVar, &'a Expr, &'a Expr, &'a [Inst]),
        Comm,
        StartGroup,
        EndGroup,
        View,
    }
    let mut items = Vec::new();
    for inst in block {
        let kept = match &inst.kind {
            InstKind::ForLoop {
                index,
                start,
                stop,
                body,
            } => Kept::Loop(*index, start, stop, body),
            InstKind::StartCoalescing => Kept::StartGroup,
            InstKind::EndCoalescing { .. } => Kept::EndGroup,
            InstKind::ShardByStream { .. } | InstKind::Narrow { .. } => Kept::View,
            InstKind::Communication { .. }
            | InstKind::CollectivePermute { .. }
            | InstKind::MoeDispatch { .. }
            | InstKind::MoeCombine { .. } => Kept::Comm,
            InstKind::Allocate { .. }
            | InstKind::Deallocate { .. }
            | InstKind::GetCurrentStream { .. }
            | InstKind::SetCurrentStream { .. }
            | InstKind::Synchronize { .. }
            | InstKind::Wait { .. }
            | InstKind::Compute { .. }
            | InstKind::CallKernel { .. } => continue,
        };
        let ord = insts.len();
        insts.push(InstInfo {
            text: inst_to_string(host, inst),
            loc: inst.loc,
        });
        items.push(match kept {
            Kept::Loop(index, start, stop, body) => Item::Loop {
                ord,
                index,
                start,
                stop,
                body: build_items(host, body, insts),
            },
            Kept::StartGroup => Item::StartGroup { ord },
            Kept::EndGroup => Item::EndGroup { ord },
            Kept::View => Item::View { ord, inst },
            Kept::Comm => Item::Comm { ord, inst },
        });
    }
    items
}

/// Expression values on one rank.
struct RankEnv<'a> {
    meshes: &'a Arena<MeshId, MeshDecl>,
    rank: DeviceId,
    loops: &'a [(LoopVar, i64)],
}

impl ExprEnv for RankEnv<'_> {
    fn loop_value(&self, var: LoopVar) -> Option<i64> {
        self.loops
            .iter()
            .rev()
            .find(|(v, _)| *v == var)
            .map(|(_, x)| *x)
    }

    fn my_index(&self, mesh: MeshId, pt: ParallelType) -> Option<i64> {
        let index = self.meshes.get(mesh)?.mesh.team_index(self.rank, pt)?;
        i64::try_from(index).ok()
    }

    fn rank(&self) -> DeviceId {
        self.rank
    }
}

/// Signals that the instance cap was hit.
struct Abort;

struct Walker<'h, 'o> {
    host: &'h HostProgram,
    out: &'o mut Instances,
    errors: &'o mut Vec<CheckError>,
    /// `(rank, instruction, category)` of errors already reported, so an error in a loop body
    /// is reported for its first iteration only.
    reported: &'o mut HashSet<(DeviceId, usize, &'static str)>,
    budget: &'o mut usize,
    /// Team tables by communication instruction (`ord`), shared by all ranks.
    tables: &'o mut HashMap<usize, TeamTable>,
    /// Per mesh, whether each rank of the world is in it (`DeviceMesh::contains` is a linear
    /// search, quadratic over every rank).
    in_mesh: &'o HashMap<MeshId, Vec<bool>>,
    rank: DeviceId,
    loops: Vec<(LoopVar, i64)>,
    group: Option<(u32, usize)>,
    next_group: u32,
    /// The actual shape of every view on this rank, as of the last view instruction: the
    /// pieces of uneven shards have per-rank extents.
    shapes: HashMap<HostTensorId, Vec<u64>>,
    /// The slice each view tensor stands for now (tensors not listed are whole).
    views: HashMap<HostTensorId, Option<Slice>>,
}

impl Walker<'_, '_> {
    fn spend(&mut self) -> Result<(), Abort> {
        if *self.budget == 0 {
            return Err(Abort);
        }
        *self.budget -= 1;
        Ok(())
    }

    fn site(&self, ord: usize) -> Site {
        Site {
            inst: self.out.insts.get(ord).cloned().unwrap_or(InstInfo {
                text: String::new(),
                loc: meshflow_ir::SourceLoc::NONE,
            }),
            at: Iteration(self.loops.clone()),
        }
    }

    fn report(&mut self, ord: usize, error: CheckError) {
        if self.reported.insert((self.rank, ord, error.category())) {
            self.errors.push(error);
        }
    }

    fn eval(&mut self, ord: usize, what: &'static str, expr: &Expr) -> Option<i64> {
        let env = RankEnv {
            meshes: &self.host.meshes,
            rank: self.rank,
            loops: &self.loops,
        };
        match expr.eval(&env) {
            Ok(v) => Some(v),
            Err(error) => {
                let site = self.site(ord);
                let rank = self.rank;
                self.report(
                    ord,
                    CheckError::Eval {
                        rank,
                        what,
                        site,
                        error,
                    },
                );
                None
            }
        }
    }

    fn walk(&mut self, items: &[Item<'_>]) -> Result<(), Abort> {
        for item in items {
            match item {
                Item::Loop {
                    ord,
                    index,
                    start,
                    stop,
                    body,
                } => {
                    let (Some(start), Some(stop)) = (
                        self.eval(*ord, "loop bounds", start),
                        self.eval(*ord, "loop bounds", stop),
                    ) else {
                        continue;
                    };
                    for value in start..stop {
                        self.spend()?;
                        self.loops.push((*index, value));
                        self.walk(body)?;
                        self.loops.pop();
                    }
                }
                Item::StartGroup { ord } => {
                    if self.group.is_some() {
                        let (rank, site) = (self.rank, self.site(*ord));
                        let detail = "start_coalescing inside an open coalescing group".into();
                        self.report(*ord, CheckError::Malformed { rank, site, detail });
                    } else {
                        self.group = Some((self.next_group, *ord));
                        self.next_group += 1;
                    }
                }
                Item::EndGroup { ord } => {
                    if self.group.take().is_none() {
                        let (rank, site) = (self.rank, self.site(*ord));
                        let detail = "end_coalescing without start_coalescing".into();
                        self.report(*ord, CheckError::Malformed { rank, site, detail });
                    }
                }
                Item::Comm { ord, inst } => {
                    self.spend()?;
                    self.communication(*ord, inst);
                }
                Item::View { ord, inst } => self.view(*ord, inst),
            }
        }
        Ok(())
    }

    /// The slice `tensor` stands for now (`None`: unknown).
    fn slice(&self, tensor: HostTensorId) -> Option<Slice> {
        match self.views.get(&tensor) {
            Some(s) => s.clone(),
            None => Some(Slice::whole(tensor)),
        }
    }

    fn holds(&self, tensor: HostTensorId) -> Option<Buffer> {
        let t = self.host.tensors.get(tensor)?;
        let member = self.in_mesh.get(&t.mesh)?.get(self.rank).copied();
        let numel = match self.shapes.get(&tensor) {
            Some(shape) => shape.iter().product(),
            None => t.numel(),
        };
        member.unwrap_or(false).then_some(Buffer {
            tensor,
            dtype: t.dtype,
            numel,
        })
    }

    /// The shape of `t` on this rank now: a view's evaluated shape, else the declared one.
    fn shape_of(&self, t: HostTensorId) -> Option<Vec<u64>> {
        self.shapes
            .get(&t)
            .cloned()
            .or_else(|| self.host.tensors.get(t).map(|d| d.shape.clone()))
    }

    /// Evaluates a view on this rank: its shape sizes the communications that use it, and a
    /// `narrow` outside its tensor would fail the run.
    fn view(&mut self, ord: usize, inst: &Inst) {
        let (out, input, axis) = match &inst.kind {
            InstKind::ShardByStream {
                out, input, axis, ..
            }
            | InstKind::Narrow {
                out, input, axis, ..
            } => (*out, *input, *axis),
            _ => return,
        };
        // Only the devices holding the tensor evaluate its views.
        if self.holds(input).is_none() {
            return;
        }
        let Some(mut shape) = self.shape_of(input) else {
            return;
        };
        let Some(&extent) = shape.get(axis) else {
            return;
        };
        let rank = self.rank;
        // What the view stands for (main slice matching of collectives); `None`: unknown.
        let mut slice = if self.holds(out).is_some() {
            self.slice(input)
        } else {
            None
        };
        match &inst.kind {
            InstKind::ShardByStream { chunks, index, .. } => {
                let env = RankEnv {
                    meshes: &self.host.meshes,
                    rank: self.rank,
                    loops: &self.loops,
                };
                let i = index.eval(&env).ok();
                slice = slice.zip(i).map(|(mut s, index)| {
                    s.cuts.push(Cut::Chunk {
                        axis,
                        chunks: *chunks,
                        index,
                    });
                    s
                });
                if *chunks == 0 || !extent.is_multiple_of(*chunks) {
                    let site = self.site(ord);
                    let detail = format!(
                        "{chunks} chunks do not divide the extent {extent} this rank's view has \
                         along axis {axis}"
                    );
                    self.report(ord, CheckError::Malformed { rank, site, detail });
                    return;
                }
                shape[axis] = extent / chunks;
            }
            InstKind::Narrow { start, length, .. } => {
                let (Some(s), Some(l)) = (
                    self.eval(ord, "narrow start", start),
                    self.eval(ord, "narrow length", length),
                ) else {
                    return;
                };
                let cap = self
                    .host
                    .tensors
                    .get(out)
                    .and_then(|d| d.shape.get(axis).copied())
                    .unwrap_or(0);
                let fits = s >= 0 && l >= 0 && (s + l) as u64 <= extent && l as u64 <= cap;
                if !fits {
                    let site = self.site(ord);
                    let detail = format!(
                        "elements [{s}, {s} + {l}) along axis {axis} do not fit this rank's \
                         extent {extent} or the view's capacity {cap}"
                    );
                    self.report(ord, CheckError::Malformed { rank, site, detail });
                    return;
                }
                shape[axis] = l as u64;
                if let Some(sl) = slice.as_mut() {
                    sl.cuts.push(Cut::Narrow {
                        axis,
                        start: s,
                        length: l,
                    });
                }
            }
            _ => return,
        }
        self.shapes.insert(out, shape);
        self.views.insert(out, slice);
    }

    fn require(
        &mut self,
        ord: usize,
        team: &[DeviceId],
        role: &'static str,
        tensor: HostTensorId,
    ) -> Option<Buffer> {
        let held = self.holds(tensor);
        if held.is_none() {
            let (name, mesh) = match self.host.tensors.get(tensor) {
                Some(t) => (
                    t.name.clone(),
                    self.host
                        .meshes
                        .get(t.mesh)
                        .map_or_else(|| format!("{:?}", t.mesh), |m| m.name.clone()),
                ),
                None => (format!("{tensor:?}"), "?".into()),
            };
            let error = CheckError::MissingBuffer {
                rank: self.rank,
                site: self.site(ord),
                team: team.to_vec(),
                role,
                tensor: name,
                mesh,
            };
            self.report(ord, error);
        }
        held
    }

    /// Evaluates a team index (root or peer) and resolves it to a device.
    fn team_member(
        &mut self,
        ord: usize,
        what: &'static str,
        expr: &Expr,
        team: &[DeviceId],
    ) -> (Option<i64>, Option<DeviceId>) {
        let Some(value) = self.eval(ord, what, expr) else {
            return (None, None);
        };
        let device = usize::try_from(value)
            .ok()
            .and_then(|i| team.get(i).copied());
        if device.is_none() {
            let error = CheckError::OutOfRange {
                rank: self.rank,
                what,
                value,
                team: team.to_vec(),
                site: self.site(ord),
            };
            self.report(ord, error);
        }
        (Some(value), device)
    }

    fn contract(&mut self, ord: usize, detail: String) {
        let (rank, site) = (self.rank, self.site(ord));
        self.report(ord, CheckError::BufferContract { rank, site, detail });
    }

    /// The per-member count of a chunked kind: `whole` holds `d` chunks of `part`'s size.
    fn chunked(
        &mut self,
        ord: usize,
        whole: Option<Buffer>,
        part: Option<Buffer>,
        d: usize,
    ) -> Option<u64> {
        let d = d as u64;
        if let Some(w) = whole {
            if w.numel % d != 0 {
                self.contract(
                    ord,
                    format!("{} elements do not split into {d} equal chunks", w.numel),
                );
            }
        }
        if let (Some(w), Some(p)) = (whole, part) {
            if w.numel != p.numel.saturating_mul(d) {
                self.contract(
                    ord,
                    format!(
                        "the whole buffer holds {} elements, not {d} x {}",
                        w.numel, p.numel
                    ),
                );
            }
        }
        part.map(|p| p.numel).or(whole.map(|w| w.numel / d))
    }

    fn same_size(&mut self, ord: usize, a: Option<Buffer>, b: Option<Buffer>) -> Option<u64> {
        if let (Some(a), Some(b)) = (a, b) {
            if a.numel != b.numel {
                self.contract(
                    ord,
                    format!(
                        "send buffer has {} elements, receive buffer {}",
                        a.numel, b.numel
                    ),
                );
            }
        }
        a.or(b).map(|x| x.numel)
    }

    fn not_in_team(&mut self, ord: usize, inst: &Inst) {
        // A point-to-point transfer over an explicit list of devices names exactly the
        // devices that take part: between overlapping meshes, other devices hold both buffers
        // and rightly skip it.
        let point_to_point = matches!(
            inst.kind,
            InstKind::Communication {
                kind: CommKind::SendRecv,
                ..
            } | InstKind::CollectivePermute { .. }
        );
        if point_to_point && matches!(inst.kind.team(), Some(Team::Devices(_))) {
            return;
        }
        let tensors = inst.kind.tensors();
        if tensors.is_empty() || !tensors.iter().all(|&t| self.holds(t).is_some()) {
            return;
        }
        let meshes = &self.host.meshes;
        let team = match inst.kind.team() {
            Some(Team::Devices(devices)) => devices.clone(),
            Some(Team::Mesh(m))
            | Some(Team::Slice { mesh: m, .. })
            | Some(Team::Flattened { mesh: m, .. }) => meshes
                .get(*m)
                .map(|d| d.mesh.devices().to_vec())
                .unwrap_or_default(),
            None => Vec::new(),
        };
        let (rank, site) = (self.rank, self.site(ord));
        self.report(ord, CheckError::NotInTeam { rank, site, team });
    }

    fn communication(&mut self, ord: usize, inst: &Inst) {
        let Some(team) = inst.kind.team() else { return };
        let (meshes, world_size) = (&self.host.meshes, self.out.world_size);
        let table = self
            .tables
            .entry(ord)
            .or_insert_with(|| TeamTable::build(team, meshes, world_size));
        let Some((team_id, resolved)) = table.team_of(self.rank, self.out) else {
            self.not_in_team(ord, inst);
            return;
        };
        let (members, outside) = (resolved.members.clone(), resolved.outside);
        if let Some(device) = outside {
            let error = CheckError::WorldTooSmall {
                what: self.site(ord).to_string(),
                device,
                world_size: self.out.world_size,
            };
            self.report(ord, error);
            return;
        }
        let d = members.len();
        let rank = self.rank;
        let mut event = CommEvent {
            kind: EventKind::CollectivePermute,
            team: team_id,
            root_index: None,
            root: None,
            send_peer: None,
            recv_peer: None,
            send: None,
            recv: None,
            send_slice: None,
            recv_slice: None,
            count: None,
            dtype: None,
            iteration: Iteration(self.loops.clone()),
            inst: ord,
            group: self.group.map(|(g, _)| g),
        };
        match &inst.kind {
            InstKind::Communication {
                kind,
                input,
                output,
                root,
                ..
            } => {
                event.kind = EventKind::Collective(*kind);
                if kind.is_rooted() {
                    match root {
                        Some(root) => {
                            (event.root_index, event.root) =
                                self.team_member(ord, "root", root, &members)
                        }
                        None => {
                            let site = self.site(ord);
                            let detail = format!("{} needs a root", kind.name());
                            self.report(ord, CheckError::Malformed { rank, site, detail });
                        }
                    }
                }
                let is_root = event.root == Some(rank);
                let other = members.iter().copied().find(|&m| m != rank);
                let contract = kind.contract();
                let uses = contract.member(is_root);
                let buffer = |this: &mut Self, side: Side, tensor| match uses.of(side) {
                    BufferUse::Required => this.require(ord, &members, side.name(), tensor),
                    BufferUse::Optional | BufferUse::Unused => this.holds(tensor),
                };
                let s = buffer(self, Side::Send, *input);
                let r = buffer(self, Side::Recv, *output);
                // The sizes of the buffers this member touches.
                let touched = |side: Side, b: Option<Buffer>| b.filter(|_| uses.of(side).touched());
                let (ts, tr) = (touched(Side::Send, s), touched(Side::Recv, r));
                event.count = match contract.sizing.whole() {
                    Some(Side::Recv) => self.chunked(ord, tr, ts, d),
                    Some(Side::Send) => self.chunked(ord, ts, tr, d),
                    None => {
                        let count = self.same_size(ord, ts, tr);
                        if contract.send_chunked && count.is_some_and(|c| c % d as u64 != 0) {
                            self.contract(
                                ord,
                                format!(
                                    "{} elements do not split into {d} equal chunks",
                                    count.unwrap_or(0)
                                ),
                            );
                        }
                        count
                    }
                };
                if let (Some(a), Some(b)) = (s, r) {
                    if a.dtype != b.dtype
                        && (is_root || (uses.send.touched() && uses.recv.touched()))
                    {
                        self.contract(
                            ord,
                            format!("send buffer is {}, receive buffer {}", a.dtype, b.dtype),
                        );
                    }
                }
                event.dtype = if uses.send.touched() { s.or(r) } else { r }.map(|b| b.dtype);
                (event.send, event.recv) = (s, r);
                if let Some(want) = contract.team_size.filter(|&want| want != d) {
                    let site = self.site(ord);
                    let detail = format!(
                        "{} needs a team of {want} devices, not {members:?}",
                        kind.name()
                    );
                    self.report(ord, CheckError::Malformed { rank, site, detail });
                    return;
                }
                if *kind == CommKind::SendRecv {
                    if is_root {
                        event.send_peer = other;
                    } else {
                        event.recv_peer = event.root;
                    }
                }
            }
            InstKind::CollectivePermute {
                send_peer,
                recv_peer,
                input,
                output,
                ..
            } => {
                (_, event.send_peer) = self.team_member(ord, "send peer", send_peer, &members);
                (_, event.recv_peer) = self.team_member(ord, "recv peer", recv_peer, &members);
                event.send = self.require(ord, &members, "send", *input);
                event.recv = self.require(ord, &members, "receive", *output);
                event.count = event.send.map(|b| b.numel);
                event.dtype = event.send.map(|b| b.dtype);
            }
            InstKind::MoeDispatch {
                x,
                topk_idx,
                expert_x,
                expert_counts,
                routing,
                ..
            } => {
                event.kind = EventKind::MoeDispatch;
                event.send = self.require(ord, &members, "send", *x);
                self.require(ord, &members, "send", *topk_idx);
                event.recv = self.require(ord, &members, "receive", *expert_x);
                self.require(ord, &members, "receive", *expert_counts);
                self.require(ord, &members, "receive", *routing);
                event.count = event.recv.map(|b| b.numel);
                event.dtype = event.send.map(|b| b.dtype);
            }
            InstKind::MoeCombine {
                expert_y,
                expert_counts,
                routing,
                topk_weights,
                out,
                ..
            } => {
                event.kind = EventKind::MoeCombine;
                event.send = self.require(ord, &members, "send", *expert_y);
                self.require(ord, &members, "send", *expert_counts);
                self.require(ord, &members, "send", *routing);
                self.require(ord, &members, "send", *topk_weights);
                event.recv = self.require(ord, &members, "receive", *out);
                event.count = event.send.map(|b| b.numel);
                event.dtype = event.recv.map(|b| b.dtype);
            }
            InstKind::Allocate { .. }
            | InstKind::Deallocate { .. }
            | InstKind::ForLoop { .. }
            | InstKind::GetCurrentStream { .. }
            | InstKind::SetCurrentStream { .. }
            | InstKind::Synchronize { .. }
            | InstKind::ShardByStream { .. }
            | InstKind::Narrow { .. }
            | InstKind::Wait { .. }
            | InstKind::StartCoalescing
            | InstKind::EndCoalescing { .. }
            | InstKind::Compute { .. }
            | InstKind::CallKernel { .. } => return,
        }
        event.send_slice = event.send.and_then(|b| self.slice(b.tensor));
        event.recv_slice = event.recv.and_then(|b| self.slice(b.tensor));
        if let Some(events) = self.out.events.get_mut(rank) {
            events.push(event);
        }
    }
}

/// Instantiates `host` on ranks `0..world_size`. Returns the events and the problems found on
/// the way (out-of-range roots and peers, missing buffers, ...); fails only when the program
/// cannot be instantiated at all (a mesh outside the world, too many instances).
pub(crate) fn instantiate_all(
    host: &HostProgram,
    world_size: usize,
) -> Result<(Instances, Vec<CheckError>), CheckErrors> {
    let mut fatal = Vec::new();
    for decl in host.meshes.values() {
        if let Some(&device) = decl.mesh.devices().iter().max() {
            if device >= world_size {
                fatal.push(CheckError::WorldTooSmall {
                    what: format!("mesh `{}` = {}", decl.name, decl.mesh),
                    device,
                    world_size,
                });
            }
        }
    }
    if !fatal.is_empty() {
        return Err(CheckErrors::capped(fatal));
    }
    let mut insts = Vec::new();
    let items = build_items(host, &host.body, &mut insts);
    let mut out = Instances::new(world_size, insts);
    out.tensor_names = host.tensors.values().map(|t| t.name.clone()).collect();
    let mut errors = Vec::new();
    let mut reported = HashSet::new();
    let mut budget = MAX_INSTANCES;
    let mut tables = HashMap::new();
    let in_mesh: HashMap<MeshId, Vec<bool>> = host
        .meshes
        .iter()
        .map(|(id, decl)| {
            let mut member = vec![false; world_size];
            for &d in decl.mesh.devices() {
                if let Some(m) = member.get_mut(d) {
                    *m = true;
                }
            }
            (id, member)
        })
        .collect();
    for rank in 0..world_size {
        let mut walker = Walker {
            host,
            out: &mut out,
            errors: &mut errors,
            reported: &mut reported,
            budget: &mut budget,
            tables: &mut tables,
            in_mesh: &in_mesh,
            rank,
            loops: Vec::new(),
            group: None,
            next_group: 0,
            shapes: HashMap::new(),
            views: HashMap::new(),
        };
        if walker.walk(&items).is_err() {
            return Err(CheckErrors::capped(vec![CheckError::TooManyInstances {
                world_size,
                limit: MAX_INSTANCES,
            }]));
        }
        if let Some((_, ord)) = walker.group {
            let site = walker.site(ord);
            let detail = "start_coalescing is never ended".into();
            walker.report(ord, CheckError::Malformed { rank, site, detail });
        }
    }
    Ok((out, errors))
}
