//! Reduce-scatters of partial sums computed chunk by chunk in a stream loop (the producer's
//! output `y` has a Stream split over the axis the result `z = set(y)` is split on, one chunk per
//! team member):
//!
//! **Ring** (`swizzle1d`, [`Decision::ReduceRing`]): running sums travel around a ring of
//! neighbours. At step `i` a rank computes its partial product of chunk `(my − 1 − i) mod d`,
//! receives from rank − 1 the running sum of that chunk and adds its part; it sends its own
//! running sum to rank + 1 under the step's compute. After `d − 1` transfers the sum of chunk
//! `my` lands in `z`:
//!
//! ```text
//! s = get_current_stream
//! compute(chunk my-1 -> acc)                                   // step 0
//! for i in 1..d-1 {
//!   set_current_stream worker(0); synchronize s               // acc of step i-1 is ready
//!   c = collective_permute(acc -> recv, send=my+1, recv=my-1)
//!   set_current_stream s; compute(chunk my-1-i -> part); wait c
//!   add(part, recv -> acc)
//! }
//! ... step d-1 as above, computing chunk my and adding into z
//! synchronize worker(0)
//! ```
//!
//! With `pieces` > 1 (the [`Plan`](crate::plan::Plan)'s) each step computes its chunk in row
//! pieces on the main stream, and worker 1 (after waiting for the transfer) adds each piece
//! once the main stream has computed it, under the next piece's compute; the main stream waits
//! for worker 1 before the running sum travels on. The producer's output is never
//! materialized: its chunks are computed straight into `acc` and `part`.
//!
//! **Per-step reduce** (no swizzle, [`Decision::StreamReduce`], the dual of the stream
//! broadcast): iteration `i` computes chunk `i` and reduces it onto team member `i`, which
//! receives the sum in `z`; an ordinary stream loop (`assign_streams` puts iterations on
//! workers).
//!
//! A ring whose partial sums are also read elsewhere (or are an output) is lowered as the loop
//! followed by one `reduce_scatter`.

use meshflow_ir::host::{CommKind, ComputeOp, Expr, Inst, InstKind, ReduceOp, StreamRef, Team};
use meshflow_ir::{OpKind, ParallelType};

use super::gather_ring::{back_to, on_worker};
use super::loop_nest::{Group, LoopCtx, StreamKey};
use super::Lowering;
use crate::decision::{decide, Decision};
use crate::error::PassError;

impl Lowering<'_> {
    /// The decision of the `set` at op `i`, when it is a reduce of a stream-split producer.
    fn stream_reduce_of(&self, i: usize) -> Option<Decision> {
        let op = &self.program.ops[i];
        if op.kind != OpKind::Set {
            return None;
        }
        let (&p, &c) = (op.inputs.first()?, op.outputs.first()?);
        let (ps, cs) = (self.sharding(p), self.sharding(c));
        let (pm, cm) = (self.mesh(ps.mesh).ok()?, self.mesh(cs.mesh).ok()?);
        let d = decide(ps, pm, cs, cm);
        matches!(
            d,
            Decision::ReduceRing { .. } | Decision::StreamReduce { .. }
        )
        .then_some(d)
    }

    /// The stream key a reducing `set` (op `i`) joins: its producer's, when it reduces inside
    /// the producer's loop (always for the per-step reduce; for the ring when the partial sums
    /// are read by this `set` alone, right after the op that computes them).
    pub(crate) fn reduce_key(&self, i: usize) -> Option<StreamKey> {
        let decision = self.stream_reduce_of(i)?;
        let p = self.program.ops[i].inputs[0];
        if matches!(decision, Decision::ReduceRing { .. }) {
            let produced_just_before = i
                .checked_sub(1)
                .is_some_and(|j| self.program.ops[j].outputs.contains(&p));
            let only_here = self.program.uses(p) == [i] && !self.program.outputs.contains(&p);
            if !(produced_just_before && only_here) {
                return None;
            }
        }
        self.key_of(p)
    }

    /// Emits group `g` as the reduce-scatter ring when it ends with a ring `set`; `false`
    /// otherwise.
    pub(crate) fn emit_reduce_ring(
        &mut self,
        g: &Group,
        key: &StreamKey,
        block: &mut Vec<Inst>,
    ) -> Result<bool, PassError> {
        let Some(&set) = g.ops.last() else {
            return Ok(false);
        };
        let Some(Decision::ReduceRing { pt, axis }) = self.stream_reduce_of(set) else {
            return Ok(false);
        };
        if g.ops.len() < 2 {
            return Ok(false);
        }
        let op = self.program.ops[set].clone();
        let (p, z) = (op.inputs[0], op.outputs[0]);
        let pieces = self
            .plans
            .get(self.name(p))
            .map_or(1, |plan| plan.pieces.max(1));
        let (ph, zh) = (self.host_of(p), self.host_of(z));
        let others: Vec<usize> = g.ops[..g.ops.len() - 1].to_vec();
        let d = key.chunks;
        let di = d as i64;
        let mesh = self.sharding(z).mesh;
        let my = Expr::my(mesh, pt);
        let var = self.fresh_loop();
        let zshape = self.host.tensors[zh].shape.clone();
        let rows = zshape.get(axis).copied().unwrap_or(0);
        let pieces = if pieces > 1 && rows.is_multiple_of(pieces) {
            pieces
        } else {
            1
        };
        // Chunk `(my + d - 1 - i) % d` at step `i`.
        let chunk = |i: Expr| my.clone().add(Expr::c(di - 1)).sub(i).rem(Expr::c(di));
        if d == 1 {
            let mut lp = LoopCtx::at(var, 1, Expr::c(0));
            lp.seed(ph, axis, zh);
            for &k in &others {
                self.emit_op(k, Some(&mut lp), block)?;
            }
            return Ok(true);
        }
        let acc = self.derived(zh, "acc", zshape.clone());
        let part = self.derived(zh, "part", zshape.clone());
        let recv = self.derived(zh, "recv", zshape);
        let s0 = self.fresh_stream();
        block.push(Inst::new(InstKind::GetCurrentStream { dst: s0 }));
        let mut lp = LoopCtx::at(var, d, chunk(Expr::c(0)));
        lp.seed(ph, axis, acc);
        for &k in &others {
            self.emit_op(k, Some(&mut lp), block)?;
        }
        let ring = Ring {
            mesh,
            pt,
            axis,
            d,
            pieces,
            others: &others,
            ph,
            acc,
            part,
            recv,
            s0,
        };
        if d >= 3 {
            let mut body = Vec::new();
            self.ring_step(&ring, chunk(Expr::var(var)), var, acc, &mut body)?;
            block.push(Inst::new(InstKind::ForLoop {
                index: var,
                start: Expr::c(1),
                stop: Expr::c(di - 1),
                body,
            }));
        }
        self.ring_step(&ring, chunk(Expr::c(di - 1)), var, zh, block)?;
        block.push(Inst::new(InstKind::Synchronize {
            stream: StreamRef::Worker(Expr::c(0)),
        }));
        Ok(true)
    }

    /// One step `i > 0` of the ring (chunk `chunk_at`): the running sum travels while this
    /// rank's part is computed, then the two are added into `out`.
    fn ring_step(
        &mut self,
        r: &Ring<'_>,
        chunk_at: Expr,
        var: meshflow_ir::host::LoopVar,
        out: meshflow_ir::host::HostTensorId,
        block: &mut Vec<Inst>,
    ) -> Result<(), PassError> {
        let mesh = r.mesh;
        let my = Expr::my(mesh, r.pt);
        let di = r.d as i64;
        let team = Team::Slice { mesh, pt: r.pt };
        let next = my.clone().add(Expr::c(1)).rem(Expr::c(di));
        let prev = my.add(Expr::c(di - 1)).rem(Expr::c(di));
        on_worker(block, 0, r.s0);
        let id = self.permute(block, team, (next, prev), r.acc, r.recv);
        block.push(back_to(r.s0));
        if r.pieces == 1 {
            let mut lp = LoopCtx::at(var, r.d, chunk_at);
            lp.seed(r.ph, r.axis, r.part);
            for &k in r.others {
                self.emit_op(k, Some(&mut lp), block)?;
            }
            block.push(Inst::new(InstKind::Wait { comm: id }));
            block.push(add(r.part, r.recv, out));
            return Ok(());
        }
        // Worker 1 adds the pieces: it waits for the transfer once, then for each piece.
        block.push(Inst::new(InstKind::SetCurrentStream {
            stream: StreamRef::Worker(Expr::c(1)),
        }));
        block.push(Inst::new(InstKind::Wait { comm: id }));
        block.push(back_to(r.s0));
        let q = self.fresh_loop();
        let p = r.pieces as i64;
        let mut body = Vec::new();
        let piece = Expr::var(q);
        let part_q = self.cut(&mut body, r.part, r.axis, r.pieces, piece.clone(), "piece");
        let recv_q = self.cut(&mut body, r.recv, r.axis, r.pieces, piece.clone(), "piece");
        let out_q = self.cut(&mut body, out, r.axis, r.pieces, piece.clone(), "piece");
        let index = chunk_at.mul(Expr::c(p)).add(piece);
        let mut lp = LoopCtx::at(q, r.d * r.pieces, index);
        lp.seed(r.ph, r.axis, part_q);
        for &k in r.others {
            self.emit_op(k, Some(&mut lp), &mut body)?;
        }
        on_worker(&mut body, 1, r.s0);
        body.push(add(part_q, recv_q, out_q));
        body.push(back_to(r.s0));
        block.push(Inst::new(InstKind::ForLoop {
            index: q,
            start: Expr::c(0),
            stop: Expr::c(p),
            body,
        }));
        // The running sum travels on (and the run ends) only after every add.
        block.push(Inst::new(InstKind::Synchronize {
            stream: StreamRef::Worker(Expr::c(1)),
        }));
        Ok(())
    }

    /// The per-step reduce of the `set` at op `i` inside its producer's loop `lp`: chunk `i` of
    /// the partial sums is reduced onto team member `i` (the loop index), into the result.
    pub(crate) fn emit_stream_reduce(
        &mut self,
        i: usize,
        lp: &mut LoopCtx,
        pt: ParallelType,
        axis: usize,
        block: &mut Vec<Inst>,
    ) -> Result<(), PassError> {
        let op = self.program.ops[i].clone();
        let (p, z) = (op.inputs[0], op.outputs[0]);
        let chunk = self.chunk_view(lp, block, self.host_of(p), axis, "partial sums")?;
        let input = if self.contiguous(chunk) {
            chunk
        } else {
            let shape = self.host.tensors[chunk].shape.clone();
            let staged = self.derived(chunk, "send", shape);
            block.push(Inst::new(InstKind::Compute {
                op: ComputeOp::Copy,
                inputs: vec![chunk],
                outputs: vec![staged],
            }));
            staged
        };
        let output = self.host_of(z);
        let team = Team::Slice {
            mesh: self.sharding(z).mesh,
            pt,
        };
        let root = Expr::var(lp.var);
        self.push_comm(block, |id| InstKind::Communication {
            id,
            kind: CommKind::Reduce,
            team,
            input,
            output,
            root: Some(root),
            op: Some(ReduceOp::Sum),
        });
        Ok(())
    }
}

/// What every step of a reduce-scatter ring shares.
struct Ring<'a> {
    mesh: meshflow_ir::MeshId,
    pt: ParallelType,
    axis: usize,
    d: u64,
    pieces: u64,
    /// The ops computing the partial sums, in order.
    others: &'a [usize],
    /// The partial sums (never materialized: their chunks are seeded).
    ph: meshflow_ir::host::HostTensorId,
    acc: meshflow_ir::host::HostTensorId,
    part: meshflow_ir::host::HostTensorId,
    recv: meshflow_ir::host::HostTensorId,
    s0: meshflow_ir::host::StreamVar,
}

fn add(
    a: meshflow_ir::host::HostTensorId,
    b: meshflow_ir::host::HostTensorId,
    out: meshflow_ir::host::HostTensorId,
) -> Inst {
    Inst::new(InstKind::Compute {
        op: ComputeOp::Add,
        inputs: vec![a, b],
        outputs: vec![out],
    })
}
