//! `defer_waits`: moves each `wait` as late as it may go, then double-buffers per-iteration
//! temporaries of stream loops.
//!
//! **Waits.** A `wait c` moves down its block to just before the first instruction that reads
//! a buffer `c` writes, writes a buffer `c` reads or writes, allocates or frees one of them
//! (views alias their base buffer), changes or saves the current stream, groups
//! communications, or is a loop containing any of these; otherwise to the end of its block.
//! So the transfer of chunk `i` overlaps whatever comes between it and its first consumer.
//!
//! **Double buffering.** In a stream loop of `n` iterations, a temporary used only within one
//! iteration — allocated and freed in the body, or a whole buffer outside the loop that the
//! body only touches through a chunk view whose index visits every chunk once (`i` or
//! `(i + c) % n`) — is replaced by a ring of `slots = min(num_streams, n)` slots allocated
//! around the loop, slot `i % slots` serving iteration `i`. This is safe because iterations
//! sharing a slot run on the same worker stream (`worker(i % num_streams)`, see
//! `assign_streams`; or all on one stream), in order: iteration `i + slots` starts only after
//! iteration `i`'s work on that stream, and a waited communication is complete by then. Loops
//! that set streams themselves (the neighbour rings) are not double-buffered.

use std::collections::{BTreeMap, HashMap, HashSet};

use meshflow_ir::host::{Block, CommId, Expr, HostTensorId, Inst, InstKind, LoopVar, Role};
use meshflow_ir::HostProgram;

use crate::error::PassError;
use crate::host_util::{
    after_epilogue, base_of, before_prologue, comm_io, compact_tensors, view_inputs,
};
use crate::index::{form_of, loop_atom, Facts, Form};
use crate::manager::HostPass;
use crate::options::PassContext;

/// The pass.
pub struct DeferWaits;

impl HostPass for DeferWaits {
    fn name(&self) -> &'static str {
        "defer_waits"
    }

    fn run(&self, host: &mut HostProgram, cx: &mut PassContext) -> Result<(), PassError> {
        let views = view_inputs(host);
        let io = comm_io(host);
        let ctx = WaitCtx { views, io };
        defer_block(&mut host.body, &ctx);
        double_buffer(host, cx.options.num_streams.max(1));
        compact_tensors(host);
        Ok(())
    }
}

struct WaitCtx {
    views: HashMap<HostTensorId, HostTensorId>,
    io: HashMap<CommId, (Vec<HostTensorId>, Vec<HostTensorId>)>,
}

impl WaitCtx {
    fn bases(&self, ts: &[HostTensorId]) -> HashSet<HostTensorId> {
        ts.iter().map(|&t| base_of(&self.views, t)).collect()
    }

    /// True when `inst` may not run before communication `comm` completes.
    fn blocks(
        &self,
        inst: &Inst,
        reads: &HashSet<HostTensorId>,
        writes: &HashSet<HostTensorId>,
    ) -> bool {
        let hit = |ts: Vec<HostTensorId>, set: &HashSet<HostTensorId>| {
            ts.iter().any(|&t| set.contains(&base_of(&self.views, t)))
        };
        match &inst.kind {
            InstKind::Wait { .. }
            | InstKind::Synchronize { .. }
            | InstKind::ShardByStream { .. }
            | InstKind::Narrow { .. } => false,
            InstKind::GetCurrentStream { .. }
            | InstKind::SetCurrentStream { .. }
            | InstKind::StartCoalescing
            | InstKind::EndCoalescing { .. } => true,
            InstKind::ForLoop { body, .. } => body.iter().any(|i| self.blocks(i, reads, writes)),
            InstKind::Allocate { tensor } | InstKind::Deallocate { tensor } => {
                let b = base_of(&self.views, *tensor);
                reads.contains(&b) || writes.contains(&b)
            }
            kind => {
                hit(kind.reads(), writes) || hit(kind.writes(), writes) || hit(kind.writes(), reads)
            }
        }
    }
}

fn defer_block(block: &mut Block, ctx: &WaitCtx) {
    for inst in block.iter_mut() {
        if let InstKind::ForLoop { body, .. } = &mut inst.kind {
            defer_block(body, ctx);
        }
    }
    // Last wait first, each moved once: the waits after it are already in place (a wait never
    // blocks another, so a front-to-back pass could swap two neighbours forever).
    for k in (0..block.len()).rev() {
        let InstKind::Wait { comm } = block[k].kind else {
            continue;
        };
        let Some((r, w)) = ctx.io.get(&comm) else {
            continue;
        };
        let (reads, writes) = (ctx.bases(r), ctx.bases(w));
        let mut j = k + 1;
        while j < block.len() && !ctx.blocks(&block[j], &reads, &writes) {
            j += 1;
        }
        if j > k + 1 {
            let wait = block.remove(k);
            block.insert(j - 1, wait);
        }
    }
}

/// True when `index` visits each of `chunks` chunks once over `i in 0..chunks`.
fn visits_each_chunk_once(index: &Expr, var: LoopVar, chunks: u64) -> bool {
    let d = form_of(index, &Facts::new());
    let coeff = |lin: &crate::index::Lin| {
        lin.terms
            .iter()
            .find(|(k, _)| k.symbol() == loop_atom(var))
            .map(|(_, &c)| c)
    };
    match &d.form {
        Form::Affine(lin) => coeff(lin) == Some(1) && lin.terms.len() == 1 && lin.c == 0,
        Form::Mod(lin, m) => *m as u64 == chunks && matches!(coeff(lin), Some(1 | -1)),
        Form::Opaque => false,
    }
}

/// Every instruction (deep) naming each tensor, counted.
fn ref_counts(block: &Block, out: &mut BTreeMap<HostTensorId, usize>) {
    for inst in block {
        match &inst.kind {
            InstKind::ForLoop { body, .. } => ref_counts(body, out),
            k => {
                for t in k.tensors() {
                    *out.entry(t).or_default() += 1;
                }
            }
        }
    }
}

fn double_buffer(host: &mut HostProgram, pool: usize) {
    let mut counts = BTreeMap::new();
    ref_counts(&host.body, &mut counts);
    let mut body = std::mem::take(&mut host.body);
    buffer_block(host, &mut body, &counts, pool);
    host.body = body;
}

fn buffer_block(
    host: &mut HostProgram,
    block: &mut Block,
    counts: &BTreeMap<HostTensorId, usize>,
    pool: usize,
) {
    let mut k = 0;
    while k < block.len() {
        let (var, trips) = match &block[k].kind {
            InstKind::ForLoop {
                index, start, stop, ..
            } => match (start.as_const(), stop.as_const()) {
                (Some(0), Some(n)) if n >= 2 => (*index, n as u64),
                _ => {
                    k += 1;
                    continue;
                }
            },
            _ => {
                k += 1;
                continue;
            }
        };
        let slots = (pool as u64).min(trips);
        let slot_index = Expr::var(var).rem(Expr::c(slots as i64));
        let InstKind::ForLoop { body, .. } = &mut block[k].kind else {
            break;
        };
        // A loop that places its own streams (neighbour rings) keeps its buffers: the slots
        // are safe only under `assign_streams`' one worker per iteration (one stream switch,
        // first in the body).
        if !one_stream_per_iteration(body) {
            k += 1;
            continue;
        }
        buffer_block(host, body, counts, pool);
        // Case A: allocated and freed in the body.
        let mut rings: Vec<(HostTensorId, Vec<u64>)> = Vec::new();
        let allocated: Vec<HostTensorId> = body
            .iter()
            .filter_map(|i| match i.kind {
                InstKind::Allocate { tensor } => Some(tensor),
                _ => None,
            })
            .filter(|t| {
                body.iter()
                    .any(|i| matches!(i.kind, InstKind::Deallocate { tensor } if tensor == *t))
            })
            .collect();
        for t in allocated {
            let shape = host.tensors[t].shape.clone();
            if shape.is_empty() || host.tensors[t].role != Role::Internal {
                continue;
            }
            let ring = ring_tensor(host, t, &shape, slots);
            body.retain(|i| !matches!(i.kind, InstKind::Deallocate { tensor } if tensor == t));
            for i in body.iter_mut() {
                if matches!(i.kind, InstKind::Allocate { tensor } if tensor == t) {
                    i.kind = InstKind::ShardByStream {
                        out: t,
                        input: ring,
                        axis: 0,
                        chunks: slots,
                        index: slot_index.clone(),
                    };
                }
            }
            rings.push((ring, Vec::new()));
        }
        // Case B: a buffer outside the loop touched only through chunk views in the body.
        let mut replaced: Vec<(HostTensorId, HostTensorId)> = Vec::new();
        if slots < trips {
            let mut chunked: BTreeMap<HostTensorId, Vec<(usize, u64, Expr, HostTensorId)>> =
                BTreeMap::new();
            for i in body.iter() {
                if let InstKind::ShardByStream {
                    out,
                    input,
                    axis,
                    chunks,
                    index,
                } = &i.kind
                {
                    chunked
                        .entry(*input)
                        .or_default()
                        .push((*axis, *chunks, index.clone(), *out));
                }
            }
            for (t, vs) in chunked {
                let (axis, chunks, index, v0) = vs[0].clone();
                let uniform = vs
                    .iter()
                    .all(|(a, c, e, _)| *a == axis && *c == chunks && *e == index);
                let only_here = counts.get(&t).copied().unwrap_or(0) == vs.len() + 2;
                if host.tensors[t].role != Role::Internal
                    || !uniform
                    || !only_here
                    || chunks != trips
                    || !visits_each_chunk_once(&index, var, chunks)
                {
                    continue;
                }
                let shape = host.tensors[v0].shape.clone();
                if shape.is_empty() {
                    continue;
                }
                let ring = ring_tensor(host, t, &shape, slots);
                for i in body.iter_mut() {
                    if let InstKind::ShardByStream {
                        input,
                        axis,
                        chunks,
                        index,
                        ..
                    } = &mut i.kind
                    {
                        if *input == t {
                            *input = ring;
                            *axis = 0;
                            *chunks = slots;
                            *index = slot_index.clone();
                        }
                    }
                }
                replaced.push((t, ring));
            }
        }
        // Allocate the rings around the loop.
        for (t, ring) in &replaced {
            for i in block.iter_mut() {
                match &mut i.kind {
                    InstKind::Allocate { tensor } | InstKind::Deallocate { tensor }
                        if tensor == t =>
                    {
                        *tensor = *ring
                    }
                    _ => {}
                }
            }
        }
        let after = after_epilogue(block, k);
        let before = before_prologue(block, k);
        for (ring, _) in rings.iter().rev() {
            block.insert(after, Inst::new(InstKind::Deallocate { tensor: *ring }));
        }
        for (ring, _) in rings.iter().rev() {
            block.insert(before, Inst::new(InstKind::Allocate { tensor: *ring }));
        }
        k = after + 2 * rings.len();
    }
}

/// True when `body` runs on one stream: it switches streams at most once, as its first
/// instruction (the shape `assign_streams` gives).
fn one_stream_per_iteration(body: &Block) -> bool {
    let mut switches = 0;
    count_switches(body, &mut switches);
    switches == 0
        || (switches == 1
            && body
                .first()
                .is_some_and(|i| matches!(i.kind, InstKind::SetCurrentStream { .. })))
}

fn count_switches(block: &Block, n: &mut usize) {
    for inst in block {
        match &inst.kind {
            InstKind::SetCurrentStream { .. } => *n += 1,
            InstKind::ForLoop { body, .. } => count_switches(body, n),
            _ => {}
        }
    }
}

fn ring_tensor(host: &mut HostProgram, t: HostTensorId, shape: &[u64], slots: u64) -> HostTensorId {
    let base = &host.tensors[t];
    let (dtype, mesh) = (base.dtype, base.mesh);
    let name = host.fresh_tensor_name(&format!("{}_ring", base.name));
    let mut ring_shape = shape.to_vec();
    ring_shape[0] *= slots;
    host.add_tensor(name, dtype, ring_shape, mesh, Role::Internal)
}
