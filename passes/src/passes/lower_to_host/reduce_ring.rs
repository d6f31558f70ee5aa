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
//! **Ring accumulating in place** ([`Plan::accumulate`](crate::plan::Plan::accumulate), where
//! [`accumulates_in_place`]): no `part`, no `add`. The running sum received from rank − 1
//! lands in this step's accumulator (two alternate between the middle steps) or, at the last
//! step, in `z` itself, and the step's chunk GEMM adds onto it in place
//! (`linear_accumulate`). Both sides are pipelined in pieces: each piece of a step moves on
//! once it is computed, and at the last step piece `j`'s GEMM waits for piece `j`'s transfer
//! alone (see `emit_accumulating_ring`).
//!
//! A ring whose partial sums are also read elsewhere (or are an output) is lowered as the loop
//! followed by one `reduce_scatter`.

use meshflow_ir::host::{
    CommId, CommKind, ComputeOp, Expr, HostTensorId, Inst, InstKind, LoopVar, ReduceOp, StreamRef,
    StreamVar, Team,
};
use meshflow_ir::{OpKind, ParallelType};

use super::gather_ring::{back_to, on_worker};
use super::loop_nest::{Group, LoopCtx, StreamKey};
use super::Lowering;
use crate::analysis::accumulates_in_place;
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
        let accumulate = self
            .plans
            .get(self.name(p))
            .is_some_and(|plan| plan.accumulate);
        if accumulate {
            if !accumulates_in_place(self.program, set) {
                return Err(PassError::tensor(
                    self.name(p),
                    "its ring cannot accumulate in place: the partial sums must be computed by \
                     a `linear` right before the reduce, read by it alone, and of the dtype of \
                     its operands and of the result",
                ));
            }
            // Two accumulators alternate between the middle steps (one suffices for d = 2).
            let halves = if d == 2 { 1 } else { 2 };
            let mut shape = zshape.clone();
            if let Some(e) = shape.get_mut(axis) {
                *e *= halves;
            }
            let acc = self.derived(zh, "acc", shape);
            let s0 = self.fresh_stream();
            block.push(Inst::new(InstKind::GetCurrentStream { dst: s0 }));
            let ring = AccumulatingRing {
                mesh,
                pt,
                axis,
                d,
                pieces,
                others: &others,
                ph,
                z: zh,
                acc,
                halves,
                s0,
                var,
            };
            self.emit_accumulating_ring(&ring, block)?;
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

/// What every step of a reduce-scatter ring that accumulates in place shares.
struct AccumulatingRing<'a> {
    mesh: meshflow_ir::MeshId,
    pt: ParallelType,
    axis: usize,
    d: u64,
    pieces: u64,
    /// The ops computing the partial sums, in order (the last one a `linear`).
    others: &'a [usize],
    /// The partial sums (never materialized: their pieces are seeded).
    ph: HostTensorId,
    /// The result.
    z: HostTensorId,
    /// `halves` accumulators stacked along `axis`.
    acc: HostTensorId,
    halves: u64,
    s0: StreamVar,
    /// The nominal loop variable of the chunk contexts.
    var: LoopVar,
}

/// Where a step's running sums live.
#[derive(Clone)]
enum Sums {
    /// The result.
    Result,
    /// Accumulator `half` (an expression of the step).
    Acc(Expr),
}

/// How a step's running sums arrive from rank − 1.
enum Arrival {
    /// Step 0: none, the step computes its partial products from scratch.
    None,
    /// Piece `q` waits for the transfer labelled `ids[q]`.
    PerPiece(Vec<CommId>),
    /// Everything has landed already (waited for by the step before).
    Landed,
}

impl Lowering<'_> {
    /// The ring of running sums accumulating in place: the sum received from rank − 1 lands
    /// in this step's accumulator (the result at the last step), the step's chunk GEMM adds
    /// onto it (`linear_accumulate`), piece by piece, and each piece moves on to rank + 1 as
    /// soon as it is computed, on worker 0:
    ///
    /// ```text
    /// s0 = get_current_stream
    /// for each piece q: linear(x piece of chunk my-1 -> acc[0][q])            // step 0
    ///                   on worker 0 after s0: c_q = permute(acc[0][q] -> next[q])
    /// [d >= 4: wait every c_q; for k in 1..d-2 { step k into acc[k % 2], sending to
    ///  acc[(k + 1) % 2], then wait for its transfers }]
    /// [d >= 3: step d-2 into acc[(d-2) % 2], sending to z]
    /// for each piece q: wait c_q; linear_accumulate(x piece of chunk my -> z[q])
    /// synchronize worker(0)
    /// ```
    ///
    /// The last step (and the middle step of d = 3) waits for each piece's transfer alone;
    /// the steps of the loop wait for all of a step's transfers (a wait names a transfer of
    /// its own block).
    fn emit_accumulating_ring(
        &mut self,
        r: &AccumulatingRing<'_>,
        block: &mut Vec<Inst>,
    ) -> Result<(), PassError> {
        let d = r.d as i64;
        let first_dest = if d == 2 {
            Sums::Result
        } else {
            Sums::Acc(Expr::c(1))
        };
        let sent = self.accumulating_step(
            r,
            Expr::c(0),
            &Sums::Acc(Expr::c(0)),
            Some(&first_dest),
            Arrival::None,
            block,
        )?;
        let mut arrival = Arrival::PerPiece(sent);
        if d >= 4 {
            if let Arrival::PerPiece(ids) = &arrival {
                for &comm in ids {
                    block.push(Inst::new(InstKind::Wait { comm }));
                }
            }
            let var = self.fresh_loop();
            let k = Expr::var(var);
            let mut body = Vec::new();
            let sent = self.accumulating_step(
                r,
                k.clone(),
                &Sums::Acc(k.clone().rem(Expr::c(2))),
                Some(&Sums::Acc(k.add(Expr::c(1)).rem(Expr::c(2)))),
                Arrival::Landed,
                &mut body,
            )?;
            for comm in sent {
                body.push(Inst::new(InstKind::Wait { comm }));
            }
            block.push(Inst::new(InstKind::ForLoop {
                index: var,
                start: Expr::c(1),
                stop: Expr::c(d - 2),
                body,
            }));
            arrival = Arrival::Landed;
        }
        if d >= 3 {
            let sent = self.accumulating_step(
                r,
                Expr::c(d - 2),
                &Sums::Acc(Expr::c((d - 2) % 2)),
                Some(&Sums::Result),
                arrival,
                block,
            )?;
            arrival = Arrival::PerPiece(sent);
        }
        self.accumulating_step(r, Expr::c(d - 1), &Sums::Result, None, arrival, block)?;
        block.push(Inst::new(InstKind::Synchronize {
            stream: StreamRef::Worker(Expr::c(0)),
        }));
        Ok(())
    }

    /// Step `k` of the ring: chunk `(my + d - 1 - k) % d` computed piece by piece into
    /// `sums` (onto what arrived there, after step 0), each piece sent on to `dest` of rank +
    /// 1 once computed. Returns the labels of the transfers (one per piece).
    fn accumulating_step(
        &mut self,
        r: &AccumulatingRing<'_>,
        k: Expr,
        sums: &Sums,
        dest: Option<&Sums>,
        arrival: Arrival,
        block: &mut Vec<Inst>,
    ) -> Result<Vec<CommId>, PassError> {
        let di = r.d as i64;
        let my = Expr::my(r.mesh, r.pt);
        let chunk = my.clone().add(Expr::c(di - 1)).sub(k).rem(Expr::c(di));
        let team = Team::Slice {
            mesh: r.mesh,
            pt: r.pt,
        };
        let next = my.clone().add(Expr::c(1)).rem(Expr::c(di));
        let prev = my.add(Expr::c(di - 1)).rem(Expr::c(di));
        let accumulate = !matches!(arrival, Arrival::None);
        let mut sent = Vec::new();
        for q in 0..r.pieces {
            if let Arrival::PerPiece(ids) = &arrival {
                let comm = ids.get(q as usize).copied().ok_or_else(|| {
                    PassError::internal("lower_to_host", "a ring piece without its transfer")
                })?;
                block.push(Inst::new(InstKind::Wait { comm }));
            }
            let here = self.sums_piece(r, sums, q, block);
            let index = chunk
                .clone()
                .mul(Expr::c(r.pieces as i64))
                .add(Expr::c(q as i64));
            let mut lp = LoopCtx::at(r.var, r.d * r.pieces, index);
            lp.seed(r.ph, r.axis, here);
            let mut ops = Vec::new();
            for &o in r.others {
                self.emit_op(o, Some(&mut lp), &mut ops)?;
            }
            if accumulate {
                let gemm = match ops.last_mut().map(|i| &mut i.kind) {
                    Some(InstKind::Compute { op, .. }) if *op == ComputeOp::Linear => op,
                    _ => {
                        return Err(PassError::internal(
                            "lower_to_host",
                            "the accumulating ring's producer did not lower to a `linear`",
                        ))
                    }
                };
                *gemm = ComputeOp::LinearAccumulate;
            }
            block.extend(ops);
            if let Some(dest) = dest {
                on_worker(block, 0, r.s0);
                let there = self.sums_piece(r, dest, q, block);
                sent.push(self.permute(
                    block,
                    team.clone(),
                    (next.clone(), prev.clone()),
                    here,
                    there,
                ));
                block.push(back_to(r.s0));
            }
        }
        Ok(sent)
    }

    /// Piece `q` of the running sums `sums` (the tensor itself when it is one piece).
    fn sums_piece(
        &mut self,
        r: &AccumulatingRing<'_>,
        sums: &Sums,
        q: u64,
        block: &mut Vec<Inst>,
    ) -> HostTensorId {
        let p = r.pieces as i64;
        let (t, chunks, index) = match sums {
            Sums::Result => (r.z, r.pieces, Expr::c(q as i64)),
            Sums::Acc(half) => (
                r.acc,
                r.halves * r.pieces,
                half.clone().mul(Expr::c(p)).add(Expr::c(q as i64)),
            ),
        };
        if chunks == 1 {
            t
        } else {
            self.cut(block, t, r.axis, chunks, index, "piece")
        }
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
