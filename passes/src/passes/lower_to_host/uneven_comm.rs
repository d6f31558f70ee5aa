//! Communications of uneven shards: pad, run the collective at one size, unpad.
//!
//! NCCL has no v-collectives, so every member sends and receives the same count: the padded
//! buffers of `uneven.rs`. Around the collective the lowering moves the valid rows between
//! the padded slots and where the chunk rule puts them, with `narrow` views and copies whose
//! extents are per-rank expressions:
//!
//! - **all-gather** of the innermost split of an axis (team size `d`, padded piece `P`):
//!   gather `d` slots of `P`; member `j`'s rows go to `[min(j c, E), ...)` of the team's piece
//!   `E`, `c = ceil(E / d)`. When `c = P` on every team the valid rows are already a prefix
//!   (the chunk rule fills slots from the front), so one copy (or none) suffices; otherwise
//!   one copy per member.
//! - **local slice**: each device copies its piece `[min(my c, E), ...)` of the valid rows.
//! - **reduce-scatter**: the partial rows are packed into `d` slots of the consumer's padded
//!   piece (one prefix copy when `c` equals it), reduced and scattered.
//! - **all-to-all** (`from` -> `to`): the send buffer gets one slot per member, slot `k`
//!   holding this device's rows of member `k`'s piece of `to`; slot `k` received holds member
//!   `k`'s piece of `from`, copied to its place.
//! - **gather** to another mesh and **scatter** from one: as the all-gather and the local
//!   slice, on the root's side.
//!
//! Every other row (copies, all-reduce, broadcast, transfers between meshes) moves whole
//! padded buffers: the two sides have the same padded shape and the same valid parts.

use meshflow_ir::host::{CommKind, Expr, HostTensorId, Inst, InstKind, ReduceOp, Team};
use meshflow_ir::{ParallelType, TensorId};

use super::uneven::{ceil_div, piece, piece_start, values};
use super::Lowering;
use crate::decision::Decision;
use crate::error::PassError;
use crate::index::substitute;

impl Lowering<'_> {
    /// The valid extent of host axis `axis` of `t` (its host extent when never short), with
    /// the stream chunk digit when `axis` is the chunked one.
    fn extent_expr(
        &self,
        t: TensorId,
        h: HostTensorId,
        axis: usize,
        chunk: &Option<(usize, Expr)>,
    ) -> Result<Expr, PassError> {
        let digit = chunk.as_ref().filter(|(a, _)| *a == axis).map(|(_, e)| e);
        Ok(match self.valid_extent(t, axis, digit)? {
            Some(e) => e,
            None => Expr::c(self.host.tensors[h].shape.get(axis).copied().unwrap_or(0) as i64),
        })
    }

    /// True when `e` equals `v` on every device of `t`'s mesh (and loop iteration).
    fn always(&self, t: TensorId, e: &Expr, v: u64, chunk: &Option<(usize, Expr)>) -> bool {
        let sh = self.sharding(t);
        let Ok(mesh) = self.mesh(sh.mesh) else {
            return false;
        };
        let var = chunk.as_ref().and_then(|(_, c)| {
            let mut var = None;
            c.for_each_loop_var(&mut |l| var = Some(l));
            var.and_then(|l| self.loop_trips.get(&l).map(|&n| (l, n)))
        });
        values(e, sh.mesh, mesh, var).is_some_and(|vals| vals.iter().all(|&x| x == v as i64))
    }

    /// A temporary like `base` with extent `extent` along `axis`.
    fn temp_like(
        &mut self,
        base: HostTensorId,
        axis: usize,
        extent: u64,
        suffix: &str,
    ) -> HostTensorId {
        let mut shape = self.host.tensors[base].shape.clone();
        if let Some(e) = shape.get_mut(axis) {
            *e = extent;
        }
        self.derived(base, suffix, shape)
    }

    /// A temporary like `base` with a leading axis of `d` slots.
    fn slots_like(&mut self, base: HostTensorId, d: u64, suffix: &str) -> HostTensorId {
        let mut shape = vec![d];
        shape.extend(self.host.tensors[base].shape.iter().copied());
        self.derived(base, suffix, shape)
    }

    /// Slot `k` of a slots temporary (a `[1, ...]` view).
    fn slot(&mut self, block: &mut Vec<Inst>, slots: HostTensorId, d: u64, k: u64) -> HostTensorId {
        let mut shape = self.host.tensors[slots].shape.clone();
        shape[0] = 1;
        let v = self.derived(slots, "slot", shape);
        self.views.insert(v, (slots, 0));
        block.push(Inst::new(InstKind::ShardByStream {
            out: v,
            input: slots,
            axis: 0,
            chunks: d,
            index: Expr::c(k as i64),
        }));
        v
    }

    /// Lowers a decision-table row between tensors of which one is split unevenly.
    pub(crate) fn emit_uneven(
        &mut self,
        i: usize,
        decision: Decision,
        (p, pin): (TensorId, HostTensorId),
        (c, cout): (TensorId, HostTensorId),
        block: &mut Vec<Inst>,
        chunk: Option<(usize, Expr)>,
    ) -> Result<(), PassError> {
        let (pmesh, cmesh) = (self.sharding(p).mesh, self.sharding(c).mesh);
        let pm = self.mesh(pmesh)?.clone();
        match decision {
            Decision::AllGather { pt, axis } => {
                let d = pm.size_of(pt).unwrap_or(1) as u64;
                let team = Team::Slice { mesh: cmesh, pt };
                self.gather_uneven(block, (p, pin), (c, cout), pt, d, axis, &chunk, |tmp| {
                    (CommKind::AllGather, team, None, tmp)
                })
            }
            Decision::Gather { pt, axis } => {
                let d = pm.size_of(pt).unwrap_or(1) as u64;
                let cm = self.mesh(cmesh)?.clone();
                // One gather per receiver, each rooted at it, into its own padded buffer.
                let pp = self.host.tensors[pin].shape.get(axis).copied().unwrap_or(0);
                let tmp = self.temp_like(cout, axis, pp * d, "gathered");
                for &r in cm.devices() {
                    let root = pm.devices().iter().position(|&x| x == r).ok_or_else(|| {
                        PassError::internal("lower_to_host", "a receiver outside the sender mesh")
                    })?;
                    self.uneven_collective(
                        block,
                        CommKind::Gather,
                        Team::Mesh(pmesh),
                        pin,
                        tmp,
                        Some(Expr::c(root as i64)),
                        None,
                        Some(axis),
                    );
                }
                self.unpack_gathered(block, (p, pin), (c, cout), pt, d, axis, &chunk, tmp)
            }
            Decision::LocalSlice { pt, axis } => {
                let d = pm.size_of(pt).unwrap_or(1) as u64;
                let e = self.extent_expr(p, pin, axis, &chunk)?;
                let cc = ceil_div(&e, d);
                let my = Expr::my(cmesh, pt);
                let len = piece(&e, &cc, &my);
                let start = piece_start(&e, &cc, &my);
                let src = self.narrow(block, pin, axis, start, len.clone(), "piece");
                let dst = self.narrow(block, cout, axis, Expr::c(0), len, "valid");
                self.copy(block, src, dst);
                Ok(())
            }
            Decision::Scatter { pt, axis } => {
                let cm = self.mesh(cmesh)?.clone();
                let d = cm.size_of(pt).unwrap_or(1) as u64;
                let pc = self.host.tensors[cout]
                    .shape
                    .get(axis)
                    .copied()
                    .unwrap_or(0);
                let e = self.extent_expr(p, pin, axis, &chunk)?;
                let cc = ceil_div(&e, d);
                let tmp = self.temp_like(pin, axis, pc * d, "padded");
                self.pack(block, (p, pin), tmp, axis, d, pc, &e, &cc, &chunk)?;
                let root = cm
                    .devices()
                    .iter()
                    .position(|&x| pm.contains(x))
                    .ok_or_else(|| {
                        PassError::internal("lower_to_host", "no sender inside the receiving mesh")
                    })?;
                self.uneven_collective(
                    block,
                    CommKind::Scatter,
                    Team::Mesh(cmesh),
                    tmp,
                    cout,
                    Some(Expr::c(root as i64)),
                    None,
                    Some(axis),
                );
                Ok(())
            }
            Decision::ReduceScatter { pt, axis } => {
                let d = pm.size_of(pt).unwrap_or(1) as u64;
                let pc = self.host.tensors[cout]
                    .shape
                    .get(axis)
                    .copied()
                    .unwrap_or(0);
                let pp = self.host.tensors[pin].shape.get(axis).copied().unwrap_or(0);
                let e = self.extent_expr(p, pin, axis, &chunk)?;
                let cc = ceil_div(&e, d);
                let send = if pp == pc * d && self.always(p, &cc, pc, &chunk) {
                    // The rows already sit in their slots (padding reduces into padding).
                    pin
                } else {
                    let tmp = self.temp_like(pin, axis, pc * d, "padded");
                    self.pack(block, (p, pin), tmp, axis, d, pc, &e, &cc, &chunk)?;
                    tmp
                };
                self.uneven_collective(
                    block,
                    CommKind::ReduceScatter,
                    Team::Slice { mesh: cmesh, pt },
                    send,
                    cout,
                    None,
                    Some(ReduceOp::Sum),
                    Some(axis),
                );
                Ok(())
            }
            Decision::AllToAll { pt, from, to } => {
                let d = pm.size_of(pt).unwrap_or(1) as u64;
                self.all_to_all_uneven(block, (p, pin), (c, cout), pt, d, (from, to), &chunk)
            }
            Decision::StridedAllGather { .. } | Decision::StridedSlice { .. } => {
                Err(PassError::op(
                    self.program,
                    i,
                    format!(
                        "`{}` or `{}` is split unevenly and a strided axis changes ({}): strided \
                     layouts move with even splits only",
                        self.name(p),
                        self.name(c),
                        decision.describe()
                    ),
                ))
            }
            Decision::MergedAllGather { axis, .. } | Decision::MergedReduceScatter { axis, .. } => {
                // The merged rows cut their axis evenly: whole padded buffers along the others.
                let (ps, cs) = (
                    self.host.tensors[pin].shape.clone(),
                    self.host.tensors[cout].shape.clone(),
                );
                let others = |s: &[u64]| -> Vec<u64> {
                    s.iter()
                        .enumerate()
                        .filter(|&(k, _)| k != axis)
                        .map(|(_, &e)| e)
                        .collect()
                };
                if others(&ps) != others(&cs) {
                    return Err(PassError::op(
                        self.program,
                        i,
                        format!(
                            "`{}` and `{}` are split unevenly and padded differently (local \
                             shapes {ps:?} and {cs:?}); a {} moves whole padded buffers",
                            self.name(p),
                            self.name(c),
                            decision.describe()
                        ),
                    ));
                }
                self.emit_row(i, decision, (p, pin), (c, cout), block)
            }
            Decision::LocalCopy
            | Decision::AllReduce { .. }
            | Decision::MergedAllReduce { .. }
            | Decision::Reduce { .. }
            | Decision::Broadcast
            | Decision::SendRecv => {
                // Whole padded buffers: both sides must be padded alike.
                let (ps, cs) = (
                    self.host.tensors[pin].shape.clone(),
                    self.host.tensors[cout].shape.clone(),
                );
                if ps != cs {
                    return Err(PassError::op(
                        self.program,
                        i,
                        format!(
                            "`{}` and `{}` are split unevenly and padded differently (local \
                             shapes {ps:?} and {cs:?}); a {} moves whole padded buffers",
                            self.name(p),
                            self.name(c),
                            decision.describe()
                        ),
                    ));
                }
                self.emit_row(i, decision, (p, pin), (c, cout), block)
            }
            Decision::Ring { .. }
            | Decision::StreamBroadcast { .. }
            | Decision::ReduceRing { .. }
            | Decision::StreamReduce { .. }
            | Decision::Unsupported(_) => Err(PassError::internal(
                "lower_to_host",
                format!("row {decision:?} in emit_uneven"),
            )),
        }
    }

    /// Posts one collective, staging the exchanged axis to the front when needed.
    #[allow(clippy::too_many_arguments)]
    fn uneven_collective(
        &mut self,
        block: &mut Vec<Inst>,
        kind: CommKind,
        team: Team,
        input: HostTensorId,
        output: HostTensorId,
        root: Option<Expr>,
        op: Option<ReduceOp>,
        exchanged: Option<usize>,
    ) {
        self.collective_parts(block, kind, team, input, output, root, op, exchanged);
    }

    /// Copies the valid rows of `pin` along `axis` (extent `e`) into `d` slots of `pc` of
    /// `tmp`: row piece `j` (`[min(j c, e), ...)`, `c = cc`) to `[j pc, ...)`.
    #[allow(clippy::too_many_arguments)]
    fn pack(
        &mut self,
        block: &mut Vec<Inst>,
        (p, pin): (TensorId, HostTensorId),
        tmp: HostTensorId,
        axis: usize,
        d: u64,
        pc: u64,
        e: &Expr,
        cc: &Expr,
        chunk: &Option<(usize, Expr)>,
    ) -> Result<(), PassError> {
        if self.always(p, cc, pc, chunk) {
            let src = self.narrow(block, pin, axis, Expr::c(0), e.clone(), "valid");
            let dst = self.narrow(block, tmp, axis, Expr::c(0), e.clone(), "valid");
            self.copy(block, src, dst);
            return Ok(());
        }
        for j in 0..d {
            let jj = Expr::c(j as i64);
            let len = piece(e, cc, &jj);
            let src = self.narrow(
                block,
                pin,
                axis,
                piece_start(e, cc, &jj),
                len.clone(),
                "piece",
            );
            let dst = self.narrow(block, tmp, axis, Expr::c((j * pc) as i64), len, "slot");
            self.copy(block, src, dst);
        }
        Ok(())
    }

    /// Gathers `d` padded slots (the collective `make` describes, given the temporary) and
    /// moves the members' rows to where the chunk rule puts them in `cout`.
    #[allow(clippy::too_many_arguments)]
    fn gather_uneven(
        &mut self,
        block: &mut Vec<Inst>,
        (p, pin): (TensorId, HostTensorId),
        (c, cout): (TensorId, HostTensorId),
        pt: ParallelType,
        d: u64,
        axis: usize,
        chunk: &Option<(usize, Expr)>,
        make: impl FnOnce(HostTensorId) -> (CommKind, Team, Option<Expr>, HostTensorId),
    ) -> Result<(), PassError> {
        let pp = self.host.tensors[pin].shape.get(axis).copied().unwrap_or(0);
        let pc = self.host.tensors[cout]
            .shape
            .get(axis)
            .copied()
            .unwrap_or(0);
        let e = self.extent_expr(c, cout, axis, chunk)?;
        let cc = ceil_div(&e, d);
        if pc == pp * d && self.always(c, &cc, pp, chunk) {
            // Slot j holds member j's rows where the chunk rule puts them.
            let (kind, team, root, _) = make(cout);
            self.uneven_collective(block, kind, team, pin, cout, root, None, Some(axis));
            return Ok(());
        }
        let tmp = self.temp_like(cout, axis, pp * d, "gathered");
        let (kind, team, root, tmp) = make(tmp);
        self.uneven_collective(block, kind, team, pin, tmp, root, None, Some(axis));
        self.unpack_gathered(block, (p, pin), (c, cout), pt, d, axis, chunk, tmp)
    }

    /// Moves member `j`'s rows from slot `j` of `tmp` to their place in `cout`.
    #[allow(clippy::too_many_arguments)]
    fn unpack_gathered(
        &mut self,
        block: &mut Vec<Inst>,
        (p, pin): (TensorId, HostTensorId),
        (c, cout): (TensorId, HostTensorId),
        pt: ParallelType,
        d: u64,
        axis: usize,
        chunk: &Option<(usize, Expr)>,
        tmp: HostTensorId,
    ) -> Result<(), PassError> {
        let pp = self.host.tensors[pin].shape.get(axis).copied().unwrap_or(0);
        let e = self.extent_expr(c, cout, axis, chunk)?;
        let cc = ceil_div(&e, d);
        if self.always(c, &cc, pp, chunk) {
            let src = self.narrow(block, tmp, axis, Expr::c(0), e.clone(), "valid");
            let dst = self.narrow(block, cout, axis, Expr::c(0), e, "valid");
            self.copy(block, src, dst);
            return Ok(());
        }
        let pmesh = self.sharding(p).mesh;
        let vp = self.extent_expr(p, pin, axis, chunk)?;
        for j in 0..d {
            let jj = Expr::c(j as i64);
            let len = substitute(&vp, &Expr::my(pmesh, pt), &jj);
            let src = self.narrow(
                block,
                tmp,
                axis,
                Expr::c((j * pp) as i64),
                len.clone(),
                "slot",
            );
            let dst = self.narrow(block, cout, axis, piece_start(&e, &cc, &jj), len, "piece");
            self.copy(block, src, dst);
        }
        Ok(())
    }

    /// `from` -> `to` over a team of `d` with uneven pieces (see the module docs).
    #[allow(clippy::too_many_arguments)]
    fn all_to_all_uneven(
        &mut self,
        block: &mut Vec<Inst>,
        (p, pin): (TensorId, HostTensorId),
        (c, cout): (TensorId, HostTensorId),
        pt: ParallelType,
        d: u64,
        (from, to): (usize, usize),
        chunk: &Option<(usize, Expr)>,
    ) -> Result<(), PassError> {
        let (pmesh, cmesh) = (self.sharding(p).mesh, self.sharding(c).mesh);
        let pct = self.host.tensors[cout].shape.get(to).copied().unwrap_or(0);
        // This device's rows of `to` (the whole axis, before the split) and their pieces.
        let et = self.extent_expr(p, pin, to, chunk)?;
        let ct = ceil_div(&et, d);
        // Member k's piece of `from` and the team's extent of `from` after the gather.
        let vf = self.extent_expr(p, pin, from, chunk)?;
        let ef = self.extent_expr(c, cout, from, chunk)?;
        let cf = ceil_div(&ef, d);
        let send_base = self.temp_like(pin, to, pct, "a2a_in");
        let send = self.slots_like(send_base, d, "slots");
        let recv = self.slots_like(send_base, d, "slots");
        for k in 0..d {
            let kk = Expr::c(k as i64);
            let len = piece(&et, &ct, &kk);
            let src = self.narrow(
                block,
                pin,
                to,
                piece_start(&et, &ct, &kk),
                len.clone(),
                "piece",
            );
            let s = self.slot(block, send, d, k);
            let dst = self.narrow(block, s, to + 1, Expr::c(0), len, "valid");
            self.copy(block, src, dst);
        }
        self.push_comm(block, |id| InstKind::Communication {
            id,
            kind: CommKind::AllToAll,
            team: Team::Slice { mesh: cmesh, pt },
            input: send,
            output: recv,
            root: None,
            op: None,
        });
        let my = Expr::my(cmesh, pt);
        let mine = piece(&et, &ct, &my);
        for k in 0..d {
            let kk = Expr::c(k as i64);
            let rows = substitute(&vf, &Expr::my(pmesh, pt), &kk);
            let r = self.slot(block, recv, d, k);
            let r = self.narrow(block, r, from + 1, Expr::c(0), rows.clone(), "valid");
            let src = self.narrow(block, r, to + 1, Expr::c(0), mine.clone(), "valid");
            let dst = self.narrow(block, cout, from, piece_start(&ef, &cf, &kk), rows, "piece");
            let dst = self.narrow(block, dst, to, Expr::c(0), mine.clone(), "valid");
            self.copy(block, src, dst);
        }
        Ok(())
    }
}
