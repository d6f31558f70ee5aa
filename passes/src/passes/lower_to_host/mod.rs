//! `lower_to_host`: the phase change from a level-1 program to the host IR.
//!
//! - **Tensors** (`naming.rs`): every level-1 tensor becomes a host tensor of the same name
//!   with its **local** shape (the value axes of `Layout::local_shape`); program inputs become
//!   `in`, outputs `out` (the runtime binds and gathers them by name), the rest `tensor`.
//!   Views and temporaries get derived names (`ag_chunk`, `x_perm`, ...).
//! - **Loop nests** (`loop_nest.rs`): each op gets a stream key (the Stream split of its output:
//!   axis class, chunk count, swizzle); consecutive ops with the same key share **one** `for`
//!   loop over the chunks. Whole buffers stay outside the loop; inside, `shard_by_stream`
//!   views select the chunk `i`, or `(i + my(m, pt)) % d` under `swizzle1d`.
//! - **Communication** (`communication.rs`): each resharding `set` becomes the communication of
//!   its decision-table row ([`crate::decision`]), followed by its `wait` (moved later by
//!   `defer_waits`); exchanged axes that are not outermost are staged through `permute`s.
//! - **Buffers**: every temporary is allocated at the start and freed at the end (so the
//!   program verifies); `insert_allocations` moves them to their uses.
//! - **Compute** (`compute.rs`): every other op becomes its local host op, on chunk views inside
//!   a loop; `moe_dispatch`/`moe_combine` become the host MoE instructions over their
//!   expert-parallel team.
//! - **Neighbour rings** (`gather_ring.rs`, `reduce_ring.rs`): a swizzled all-gather whose
//!   [`Plan`] is a forwarding or bidirectional ring, and every swizzled reduce-scatter, lower to
//!   peeled loops that place their own streams (compute on the main stream, transfers one step
//!   ahead on workers); the per-step reduce (root = loop index) is a plain stream loop.
//!
//! The [`Plan`]s of `choose_decompositions` (by tensor name, in [`PassContext::plans`]) pick
//! the ring and its pieces; distance-ring loops planned with the prefetch schedule are reported
//! in [`PassContext::prefetch_loops`] for `prefetch_transfers`.
//! - **Uneven shards** (`uneven.rs`): buffers are padded to the largest piece; compute sees
//!   `narrow` views of the valid extents, collectives move padded buffers and the lowering
//!   repacks around them.
//!
//! Anything unsupported is an error naming the tensor or op and the reason.

mod communication;
mod compute;
mod gather_ring;
mod loop_nest;
mod naming;
mod reduce_ring;
mod uneven;
mod uneven_comm;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use meshflow_ir::host::{CommId, HostTensorId, Inst, InstKind, LoopVar, Role, StreamVar};
use meshflow_ir::{DeviceMesh, EntityRef, HostProgram, MeshId, Program, TensorId};

use crate::analysis::{AxisClasses, Sharding};
use crate::error::PassError;
use crate::manager::{LowerPass, PassContext};
use crate::plan::Plan;

/// The pass.
pub struct LowerToHost;

impl LowerPass for LowerToHost {
    fn name(&self) -> &'static str {
        "lower_to_host"
    }

    fn run(&self, program: &Program, cx: &mut PassContext) -> Result<HostProgram, PassError> {
        let (host, prefetch) = lower_planned(program, &cx.plans)?;
        cx.prefetch_loops = prefetch;
        Ok(host)
    }
}

/// Lowers `program` to a host program (no allocations, streams or deferred waits yet), every
/// decomposition as its annotation says (distance rings for swizzled all-gathers).
pub fn lower(program: &Program) -> Result<HostProgram, PassError> {
    lower_planned(program, &BTreeMap::new()).map(|(host, _)| host)
}

/// [`lower`] following `plans` (by tensor name, see the module docs); also returns the loops
/// planned with the prefetch schedule.
pub fn lower_planned(
    program: &Program,
    plans: &BTreeMap<String, Plan>,
) -> Result<(HostProgram, BTreeSet<LoopVar>), PassError> {
    let mut l = Lowering::new(program, plans)?;
    let groups = l.group_steps()?;
    let mut body = Vec::new();
    for g in groups {
        l.emit_group(&g, &mut body)?;
    }
    // Every temporary lives for the whole program; `insert_allocations` tightens this.
    let mut temps = Vec::new();
    for inst in &body {
        collect_temps(&l, inst, &mut temps);
    }
    let mut full: Vec<Inst> = temps
        .iter()
        .map(|&t| Inst::new(InstKind::Allocate { tensor: t }))
        .collect();
    full.extend(body);
    full.extend(
        temps
            .iter()
            .rev()
            .map(|&t| Inst::new(InstKind::Deallocate { tensor: t })),
    );
    l.host.body = full;
    Ok((l.host, l.prefetch_loops))
}

/// Internal buffers (not views) named by `inst`, in order of first appearance.
fn collect_temps(l: &Lowering<'_>, inst: &Inst, out: &mut Vec<HostTensorId>) {
    if let InstKind::ForLoop { body, .. } = &inst.kind {
        for i in body {
            collect_temps(l, i, out);
        }
        return;
    }
    for t in inst.kind.tensors() {
        if l.host.tensors[t].role == Role::Internal
            && !l.views.contains_key(&t)
            && !out.contains(&t)
        {
            out.push(t);
        }
    }
}

/// State of one lowering.
pub(crate) struct Lowering<'a> {
    pub(crate) program: &'a Program,
    pub(crate) shardings: Vec<Sharding>,
    pub(crate) classes: AxisClasses,
    pub(crate) host: HostProgram,
    /// Level-1 tensor -> host tensor.
    pub(crate) tensors: Vec<HostTensorId>,
    /// View -> (viewed tensor, axis).
    pub(crate) views: HashMap<HostTensorId, (HostTensorId, usize)>,
    /// Trip count of every stream loop emitted so far.
    pub(crate) loop_trips: HashMap<LoopVar, u64>,
    /// Per-rank extents of `narrow` views (see `uneven.rs`).
    pub(crate) lengths: HashMap<HostTensorId, Vec<meshflow_ir::Expr>>,
    /// The plans of `choose_decompositions`, by tensor name.
    pub(crate) plans: &'a BTreeMap<String, Plan>,
    /// Loops to reschedule with `prefetch_transfers`.
    pub(crate) prefetch_loops: BTreeSet<LoopVar>,
    next_comm: u32,
    next_loop: u32,
    next_stream: u32,
}

impl<'a> Lowering<'a> {
    fn new(
        program: &'a Program,
        plans: &'a BTreeMap<String, Plan>,
    ) -> Result<Lowering<'a>, PassError> {
        let mut host = HostProgram::new(program.name.clone());
        for m in program.meshes.values() {
            host.meshes.push(m.clone());
        }
        let mut shardings = Vec::with_capacity(program.tensors.len());
        let mut tensors = Vec::with_capacity(program.tensors.len());
        for (id, decl) in program.tensors.iter() {
            let sh = Sharding::of(program, id)?;
            let role = if decl.is_input {
                Role::Input
            } else if program.outputs.contains(&id) {
                Role::Output
            } else {
                Role::Internal
            };
            let h = host.add_tensor(
                decl.name.clone(),
                decl.ty.dtype,
                sh.local_value_shape(),
                decl.mesh,
                role,
            );
            shardings.push(sh);
            tensors.push(h);
        }
        Ok(Lowering {
            program,
            shardings,
            classes: AxisClasses::build(program),
            host,
            tensors,
            views: HashMap::new(),
            loop_trips: HashMap::new(),
            lengths: HashMap::new(),
            plans,
            prefetch_loops: BTreeSet::new(),
            next_comm: 0,
            next_loop: 0,
            next_stream: 0,
        })
    }

    pub(crate) fn sharding(&self, t: TensorId) -> &Sharding {
        &self.shardings[t.index()]
    }

    pub(crate) fn host_of(&self, t: TensorId) -> HostTensorId {
        self.tensors[t.index()]
    }

    pub(crate) fn name(&self, t: TensorId) -> &str {
        self.program
            .tensors
            .get(t)
            .map_or("<unknown>", |d| d.name.as_str())
    }

    pub(crate) fn mesh(&self, m: MeshId) -> Result<&DeviceMesh, PassError> {
        self.program
            .meshes
            .get(m)
            .map(|d| &d.mesh)
            .ok_or_else(|| PassError::internal("lower_to_host", format!("unknown mesh {m:?}")))
    }

    pub(crate) fn fresh_comm(&mut self) -> CommId {
        let id = CommId(self.next_comm);
        self.next_comm += 1;
        id
    }

    pub(crate) fn fresh_loop(&mut self) -> LoopVar {
        let v = LoopVar(self.next_loop);
        self.next_loop += 1;
        v
    }

    pub(crate) fn fresh_stream(&mut self) -> StreamVar {
        let v = StreamVar(self.next_stream);
        self.next_stream += 1;
        v
    }

    /// Pushes a communication instruction and its `wait`.
    pub(crate) fn push_comm(
        &mut self,
        block: &mut Vec<Inst>,
        make: impl FnOnce(CommId) -> InstKind,
    ) {
        let id = self.fresh_comm();
        block.push(Inst::new(make(id)));
        block.push(Inst::new(InstKind::Wait { comm: id }));
    }

    /// True when `t`'s buffer is contiguous (a view along an axis preceded only by extent-1
    /// axes of a contiguous tensor).
    pub(crate) fn contiguous(&self, t: HostTensorId) -> bool {
        match self.views.get(&t) {
            None => true,
            Some(&(base, axis)) => {
                self.host.tensors[base]
                    .shape
                    .iter()
                    .take(axis)
                    .all(|&e| e == 1)
                    && self.contiguous(base)
            }
        }
    }

    /// True when host axis `axis` of `t` is preceded only by extent-1 axes.
    pub(crate) fn outermost(&self, t: HostTensorId, axis: usize) -> bool {
        self.host.tensors[t]
            .shape
            .iter()
            .take(axis)
            .all(|&e| e == 1)
    }
}
