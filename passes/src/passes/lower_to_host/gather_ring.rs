//! Neighbour rings of an all-gather: a swizzled Stream all-gather `c = set(p)` whose [`Plan`]
//! is [`Decomposition::RingForward`] or [`Decomposition::RingBidirectional`], with the compute
//! that reads its chunks in the same loop.
//!
//! **Forward** (one direction, `σ = +1`): at step `i` a rank holds chunk `(my − i) mod d` (its
//! own at step 0), computes on it on the main stream and, on worker 0, forwards it to rank + 1
//! while receiving chunk `(my − i − 1) mod d` from rank − 1:
//!
//! ```text
//! s = get_current_stream
//! set_current_stream worker(0); synchronize s
//! c0 = collective_permute(p -> c[my-1], send=my+1, recv=my-1)   // step 0: the own chunk
//! set_current_stream s; compute(chunk my, reading p itself); wait c0
//! for i in 1..d-1 {
//!   set_current_stream worker(0); synchronize s                  // after step i-1
//!   c1 = collective_permute(c[my-i] -> c[my-i-1], send=my+1, recv=my-1)
//!   set_current_stream s; compute(chunk my-i); wait c1
//! }
//! compute(chunk my+1)                                            // step d-1
//! synchronize worker(0)
//! ```
//!
//! **Bidirectional**: every chunk is cut into two halves; the first travels to rank + 1 on
//! worker 0 (held half: `2·((my − i) mod d)`), the second to rank − 1 on worker 1 (held half:
//! `2·((my + i) mod d) + 1`); each step computes on both held halves (step 0 on the whole own
//! chunk). On a switch both halves leave through the same link, so it moves no faster than the
//! forward ring; on a ring of links it would use both directions.
//!
//! The transfers of step `i` run under the compute of step `i` (the worker first waits for the
//! main stream, which waited for step `i − 1`'s transfers). When `c` is read outside the loop
//! (or is a program output) the own chunk is also copied into it, on worker 0 after the first
//! transfer. Loops that place their own streams are left alone by `assign_streams`,
//! `prefetch_transfers` and the double buffering of `defer_waits`.

use meshflow_ir::host::{ComputeOp, Expr, HostTensorId, Inst, InstKind, StreamRef, Team};
use meshflow_ir::{OpKind, ParallelType};

use super::loop_nest::{Group, LoopCtx, StreamKey};
use super::Lowering;
use crate::decision::{decide, Decision};
use crate::error::PassError;
use crate::manager::{Decomposition, StreamSchedule};
use crate::plan::Plan;

/// One direction of a ring.
#[derive(Copy, Clone)]
struct Dir {
    /// +1: chunks travel to rank + 1; −1: to rank − 1.
    sigma: i64,
    /// The worker stream its transfers run on.
    worker: i64,
    /// Which half of every chunk it carries (0 when chunks are not halved).
    half: i64,
}

/// `(my + d − σ·i) mod d` (kept non-negative): the chunk direction `σ` holds at step `i`.
fn held(my: &Expr, d: i64, sigma: i64, i: Expr) -> Expr {
    if sigma > 0 {
        my.clone().add(Expr::c(d)).sub(i).rem(Expr::c(d))
    } else {
        my.clone().add(i).rem(Expr::c(d))
    }
}

impl Lowering<'_> {
    /// The all-gather opening group `g` (its op index, parallel type, value axis and plan) when
    /// it is a swizzled stream all-gather (a `Ring` decision).
    fn gather_set(&self, g: &Group) -> Option<(usize, ParallelType, usize, Option<Plan>)> {
        let &i = g.ops.first()?;
        let op = &self.program.ops[i];
        if op.kind != OpKind::Set {
            return None;
        }
        let (&p, &c) = (op.inputs.first()?, op.outputs.first()?);
        let (ps, cs) = (self.sharding(p), self.sharding(c));
        let (pm, cm) = (self.mesh(ps.mesh).ok()?, self.mesh(cs.mesh).ok()?);
        match decide(ps, pm, cs, cm) {
            Decision::Ring { pt, axis } => {
                Some((i, pt, axis, self.plans.get(self.name(c)).copied()))
            }
            _ => None,
        }
    }

    /// True when group `g` is a distance ring planned with the prefetch schedule.
    pub(crate) fn planned_prefetch(&self, g: &Group) -> bool {
        matches!(
            self.gather_set(g),
            Some((_, _, _, Some(plan)))
                if plan.decomposition == Decomposition::Ring
                    && plan.schedule == StreamSchedule::Prefetch
        )
    }

    /// Emits group `g` as a forward or bidirectional ring when its all-gather is planned so and
    /// fits (contiguous chunks, halves that divide); `false` leaves it to the distance ring.
    pub(crate) fn emit_gather_ring(
        &mut self,
        g: &Group,
        key: &StreamKey,
        block: &mut Vec<Inst>,
    ) -> Result<bool, PassError> {
        let Some((set, pt, axis, Some(plan))) = self.gather_set(g) else {
            return Ok(false);
        };
        let halves: u64 = match plan.decomposition {
            Decomposition::RingForward => 1,
            Decomposition::RingBidirectional => 2,
            _ => return Ok(false),
        };
        let op = self.program.ops[set].clone();
        let (p, c) = (op.inputs[0], op.outputs[0]);
        let (ph, ch) = (self.host_of(p), self.host_of(c));
        let d = key.chunks;
        let others: Vec<usize> = g.ops[1..].to_vec();
        let extent = self.host.tensors[ch].shape.get(axis).copied().unwrap_or(0);
        let fits = d >= 1
            && extent.is_multiple_of(d * halves)
            && self.outermost(ch, axis)
            && self.outermost(ph, axis)
            && others.iter().all(|&i| {
                !matches!(
                    self.program.ops[i].kind,
                    OpKind::Set | OpKind::MoeDispatch { .. } | OpKind::MoeCombine
                )
            });
        if !fits {
            return Ok(false);
        }
        let own_needed = self.program.outputs.contains(&c)
            || self
                .program
                .uses(c)
                .iter()
                .any(|u| *u != set && !others.contains(u));
        let mesh = self.sharding(c).mesh;
        let my = Expr::my(mesh, pt);
        let di = d as i64;
        let var = self.fresh_loop();
        if d == 1 {
            let mut lp = LoopCtx::at(var, 1, Expr::c(0));
            lp.seed(ch, axis, ph);
            for &i in &others {
                self.emit_op(i, Some(&mut lp), block)?;
            }
            if own_needed {
                block.push(copy(ph, ch));
            }
            return Ok(true);
        }
        let dirs: Vec<Dir> = if halves == 2 {
            vec![
                Dir {
                    sigma: 1,
                    worker: 0,
                    half: 0,
                },
                Dir {
                    sigma: -1,
                    worker: 1,
                    half: 1,
                },
            ]
        } else {
            vec![Dir {
                sigma: 1,
                worker: 0,
                half: 0,
            }]
        };
        let slots = d * halves;
        let slot = |dir: &Dir, i: Expr| {
            let h = held(&my, di, dir.sigma, i);
            if halves == 1 {
                h
            } else {
                h.mul(Expr::c(2)).add(Expr::c(dir.half))
            }
        };
        let team = Team::Slice { mesh, pt };
        let peers = |dir: &Dir| {
            let next = my.clone().add(Expr::c(1)).rem(Expr::c(di));
            let prev = my.clone().add(Expr::c(di - 1)).rem(Expr::c(di));
            if dir.sigma > 0 {
                (next, prev)
            } else {
                (prev, next)
            }
        };
        let s0 = self.fresh_stream();
        block.push(Inst::new(InstKind::GetCurrentStream { dst: s0 }));
        // Step 0: the own chunk (or its halves) leaves while it is computed on.
        let mut waits = Vec::new();
        for dir in &dirs {
            on_worker(block, dir.worker, s0);
            let src = if halves == 1 {
                ph
            } else {
                self.cut(block, ph, axis, 2, Expr::c(dir.half), "half")
            };
            let dst = self.cut(block, ch, axis, slots, slot(dir, Expr::c(1)), "recv");
            let (send_peer, recv_peer) = peers(dir);
            waits.push(self.permute(block, team.clone(), (send_peer, recv_peer), src, dst));
            if own_needed && dir.worker == 0 {
                let own = self.cut(block, ch, axis, d, my.clone(), "own");
                block.push(copy(ph, own));
            }
        }
        block.push(back_to(s0));
        let mut lp = LoopCtx::at(var, d, my.clone());
        lp.seed(ch, axis, ph);
        for &i in &others {
            self.emit_op(i, Some(&mut lp), block)?;
        }
        for id in waits.drain(..) {
            block.push(Inst::new(InstKind::Wait { comm: id }));
        }
        // Steps 1..d-1: forward what arrived the step before while computing on it.
        if d >= 3 {
            let mut body = Vec::new();
            let i = Expr::var(var);
            for dir in &dirs {
                on_worker(&mut body, dir.worker, s0);
                let src = self.cut(&mut body, ch, axis, slots, slot(dir, i.clone()), "send");
                let next = i.clone().add(Expr::c(1));
                let dst = self.cut(&mut body, ch, axis, slots, slot(dir, next), "recv");
                let (send_peer, recv_peer) = peers(dir);
                waits.push(self.permute(&mut body, team.clone(), (send_peer, recv_peer), src, dst));
            }
            body.push(back_to(s0));
            for dir in &dirs {
                let chunks = if halves == 1 { d } else { slots };
                let mut lp = LoopCtx::at(var, chunks, slot(dir, i.clone()));
                for &k in &others {
                    self.emit_op(k, Some(&mut lp), &mut body)?;
                }
            }
            for id in waits.drain(..) {
                body.push(Inst::new(InstKind::Wait { comm: id }));
            }
            block.push(Inst::new(InstKind::ForLoop {
                index: var,
                start: Expr::c(1),
                stop: Expr::c(di - 1),
                body,
            }));
        }
        // Step d-1: the last chunk (halves) arrived.
        for dir in &dirs {
            let chunks = if halves == 1 { d } else { slots };
            let mut lp = LoopCtx::at(var, chunks, slot(dir, Expr::c(di - 1)));
            for &k in &others {
                self.emit_op(k, Some(&mut lp), block)?;
            }
        }
        for dir in &dirs {
            block.push(Inst::new(InstKind::Synchronize {
                stream: StreamRef::Worker(Expr::c(dir.worker)),
            }));
        }
        Ok(true)
    }

    /// Declares and pushes the view of chunk `index` of `chunks` of `t` along host axis `axis`.
    pub(crate) fn cut(
        &mut self,
        block: &mut Vec<Inst>,
        t: HostTensorId,
        axis: usize,
        chunks: u64,
        index: Expr,
        suffix: &str,
    ) -> HostTensorId {
        let mut shape = self.host.tensors[t].shape.clone();
        if let Some(e) = shape.get_mut(axis) {
            *e /= chunks.max(1);
        }
        let v = self.derived(t, suffix, shape);
        self.views.insert(v, (t, axis));
        block.push(Inst::new(InstKind::ShardByStream {
            out: v,
            input: t,
            axis,
            chunks,
            index,
        }));
        v
    }

    /// Pushes a collective permute (without its wait) and returns its label.
    pub(crate) fn permute(
        &mut self,
        block: &mut Vec<Inst>,
        team: Team,
        (send_peer, recv_peer): (Expr, Expr),
        input: HostTensorId,
        output: HostTensorId,
    ) -> meshflow_ir::host::CommId {
        let id = self.fresh_comm();
        block.push(Inst::new(InstKind::CollectivePermute {
            id,
            team,
            send_peer,
            recv_peer,
            input,
            output,
        }));
        id
    }
}

/// `set_current_stream worker(w); synchronize s`.
pub(crate) fn on_worker(block: &mut Vec<Inst>, w: i64, s: meshflow_ir::host::StreamVar) {
    block.push(Inst::new(InstKind::SetCurrentStream {
        stream: StreamRef::Worker(Expr::c(w)),
    }));
    block.push(Inst::new(InstKind::Synchronize {
        stream: StreamRef::Var(s),
    }));
}

/// `set_current_stream s`.
pub(crate) fn back_to(s: meshflow_ir::host::StreamVar) -> Inst {
    Inst::new(InstKind::SetCurrentStream {
        stream: StreamRef::Var(s),
    })
}

fn copy(input: HostTensorId, output: HostTensorId) -> Inst {
    Inst::new(InstKind::Compute {
        op: ComputeOp::Copy,
        inputs: vec![input],
        outputs: vec![output],
    })
}
