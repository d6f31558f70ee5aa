//! Communication lowering: one resharding `set` to the communication of its decision-table
//! row. Teams are mesh slices along the parallel type (`slice(m, pt)`), so 2-D meshes work, or
//! for the merged rows the flattened sub-mesh over several (`flattened(m, DIDy, DIDx)`);
//! transfers between meshes use explicit device teams. Collectives exchange chunks along axis
//! 0: when the exchanged axis is not outermost (or a view is not contiguous), the data is
//! staged through a `permute` (or `copy`) into a temporary and back.

use meshflow_ir::host::{CommKind, ComputeOp, Expr, HostTensorId, Inst, InstKind, ReduceOp, Team};
use meshflow_ir::{DeviceId, ParallelType, TensorId};

use super::loop_nest::LoopCtx;
use super::Lowering;
use crate::decision::{decide, Decision};
use crate::error::PassError;

/// `[a, 0, 1, .., a-1, a+1, ..]`.
fn to_front(rank: usize, a: usize) -> Vec<usize> {
    std::iter::once(a)
        .chain((0..rank).filter(|&v| v != a))
        .collect()
}

fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (k, &p) in perm.iter().enumerate() {
        if let Some(slot) = inv.get_mut(p) {
            *slot = k;
        }
    }
    inv
}

fn permute_op(perm: Vec<usize>) -> ComputeOp {
    if perm.iter().enumerate().all(|(k, &p)| k == p) {
        ComputeOp::Copy
    } else {
        ComputeOp::Permute { perm }
    }
}

fn compute(op: ComputeOp, input: HostTensorId, output: HostTensorId) -> Inst {
    Inst::new(InstKind::Compute {
        op,
        inputs: vec![input],
        outputs: vec![output],
    })
}

/// Arguments of one collective.
struct Collective {
    kind: CommKind,
    team: Team,
    input: HostTensorId,
    output: HostTensorId,
    root: Option<Expr>,
    op: Option<ReduceOp>,
    /// The axis whose chunks are exchanged (must be outermost).
    exchanged: Option<usize>,
}

impl Lowering<'_> {
    fn permuted_shape(&self, t: HostTensorId, perm: &[usize]) -> Vec<u64> {
        let shape = &self.host.tensors[t].shape;
        perm.iter()
            .map(|&p| shape.get(p).copied().unwrap_or(1))
            .collect()
    }

    /// [`Self::collective`] from its parts.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn collective_parts(
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
        self.collective(
            block,
            Collective {
                kind,
                team,
                input,
                output,
                root,
                op,
                exchanged,
            },
        );
    }

    fn collective(&mut self, block: &mut Vec<Inst>, c: Collective) {
        let rank_in = self.host.tensors[c.input].shape.len();
        let rank_out = self.host.tensors[c.output].shape.len();
        let perm_in = c
            .exchanged
            .map_or_else(|| (0..rank_in).collect(), |a| to_front(rank_in, a));
        let perm_out = c
            .exchanged
            .map_or_else(|| (0..rank_out).collect(), |a| to_front(rank_out, a));
        let stage_in =
            !self.contiguous(c.input) || c.exchanged.is_some_and(|a| !self.outermost(c.input, a));
        let stage_out =
            !self.contiguous(c.output) || c.exchanged.is_some_and(|a| !self.outermost(c.output, a));
        let input = if stage_in {
            let shape = self.permuted_shape(c.input, &perm_in);
            let t = self.derived(c.input, "perm", shape);
            block.push(compute(permute_op(perm_in), c.input, t));
            t
        } else {
            c.input
        };
        let output = if stage_out {
            let shape = self.permuted_shape(c.output, &perm_out);
            self.derived(c.output, "perm", shape)
        } else {
            c.output
        };
        let (kind, team, root, op) = (c.kind, c.team, c.root, c.op);
        self.push_comm(block, |id| InstKind::Communication {
            id,
            kind,
            team,
            input,
            output,
            root,
            op,
        });
        if stage_out {
            block.push(compute(permute_op(inverse(&perm_out)), output, c.output));
        }
    }

    pub(crate) fn emit_set(
        &mut self,
        i: usize,
        mut lp: Option<&mut LoopCtx>,
        block: &mut Vec<Inst>,
    ) -> Result<(), PassError> {
        let op = self.program.ops[i].clone();
        let (&[p], &[c]) = (op.inputs.as_slice(), op.outputs.as_slice()) else {
            return Err(PassError::op(
                self.program,
                i,
                "a set has one input and one output",
            ));
        };
        let (ps, cs) = (self.sharding(p).clone(), self.sharding(c).clone());
        let (pm, cm) = (self.mesh(ps.mesh)?.clone(), self.mesh(cs.mesh)?.clone());
        let decision = decide(&ps, &pm, &cs, &cm);
        let unsupported = |l: &Self, why: String| Err(PassError::op(l.program, i, why));
        match decision {
            Decision::Unsupported(why) => unsupported(self, why),
            Decision::Ring { pt, axis } | Decision::StreamBroadcast { pt, axis } => {
                let Some(lp) = lp else {
                    return Err(PassError::internal(
                        "lower_to_host",
                        "a stream decomposition outside a loop",
                    ));
                };
                let view = self.chunk_view(lp, block, self.host_of(c), axis, "gathered tensor")?;
                let (vs, ps_) = (
                    self.host.tensors[view].shape.clone(),
                    self.host.tensors[self.host_of(p)].shape.clone(),
                );
                if vs != ps_ {
                    return unsupported(
                        self,
                        format!(
                            "the stream chunks of `{}` (local shape {vs:?}) are not the shards of \
                             `{}` (local shape {ps_:?}): split both the same way",
                            self.name(c),
                            self.name(p)
                        ),
                    );
                }
                let out = if self.contiguous(view) {
                    view
                } else {
                    let shape = self.host.tensors[view].shape.clone();
                    self.derived(view, "recv", shape)
                };
                let input = self.host_of(p);
                let team = Team::Slice { mesh: cs.mesh, pt };
                let d = Expr::c(lp.chunks as i64);
                let my = Expr::my(cs.mesh, pt);
                let step = Expr::var(lp.var);
                if matches!(decision, Decision::Ring { .. }) {
                    let send_peer = d.clone().add(my.clone()).sub(step.clone()).rem(d.clone());
                    let recv_peer = step.add(my).rem(d);
                    self.push_comm(block, |id| InstKind::CollectivePermute {
                        id,
                        team,
                        send_peer,
                        recv_peer,
                        input,
                        output: out,
                    });
                } else {
                    self.push_comm(block, |id| InstKind::Communication {
                        id,
                        kind: CommKind::Broadcast,
                        team,
                        input,
                        output: out,
                        root: Some(step),
                        op: None,
                    });
                }
                if out != view {
                    block.push(compute(ComputeOp::Copy, out, view));
                }
                Ok(())
            }
            Decision::StreamReduce { pt, axis } => {
                let Some(lp) = lp else {
                    return Err(PassError::internal(
                        "lower_to_host",
                        "a per-step reduce outside its producer's loop",
                    ));
                };
                self.emit_stream_reduce(i, lp, pt, axis, block)
            }
            Decision::ReduceRing { pt, axis } if lp.is_none() => {
                // The partial sums are also read elsewhere: the loop, then one reduce-scatter.
                let (pin, cout) = (self.host_of(p), self.host_of(c));
                let rs = Decision::ReduceScatter { pt, axis };
                self.emit_row(i, rs, (p, pin), (c, cout), block)
            }
            other => {
                // Inside a loop every other row runs per chunk of the consumer's Stream axis.
                let axis = match (&lp, cs.stream()) {
                    (Some(_), Some(s)) => cs.value_index(s.axis),
                    _ => None,
                };
                let what = "resharding";
                let uneven = self.is_ragged(p) || self.is_ragged(c);
                if uneven && matches!(other, Decision::LocalCopy) {
                    // The same elements on both sides: copy the valid parts.
                    let pin = self.operand(lp.as_deref_mut(), block, p, axis, what)?;
                    let cout = self.operand(lp, block, c, axis, what)?;
                    self.copy(block, pin, cout);
                    return Ok(());
                }
                if let Some(a) = axis {
                    let (pl, cl) = (ps.local_value_shape(), cs.local_value_shape());
                    let own = |sh: &crate::analysis::Sharding| {
                        sh.stream()
                            .is_some_and(|s| sh.value_index(s.axis) == Some(a))
                    };
                    if pl.get(a) != cl.get(a) || (uneven && !(own(&ps) && own(&cs))) {
                        let ext =
                            |e: Option<&u64>| e.map_or_else(|| "none".into(), |e| e.to_string());
                        return unsupported(
                            self,
                            format!(
                                "the Stream split of `{}` cuts axis {a}, which the resharding \
                                 changes on the producer `{}` (local extents {} and {}{})",
                                self.name(c),
                                self.name(p),
                                ext(pl.get(a)),
                                ext(cl.get(a)),
                                if uneven {
                                    "; an uneven resharding inside a stream loop needs both \
                                     sides cut by that Stream split"
                                } else {
                                    ""
                                }
                            ),
                        );
                    }
                }
                let chunk = match (&lp, axis) {
                    (Some(lp), Some(a)) => Some((a, lp.index.clone())),
                    _ => None,
                };
                let pin = self.maybe_chunk(lp.as_deref_mut(), block, p, axis, what)?;
                let cout = self.maybe_chunk(lp, block, c, axis, what)?;
                if uneven {
                    return self.emit_uneven(i, other, (p, pin), (c, cout), block, chunk);
                }
                self.emit_row(i, other, (p, pin), (c, cout), block)
            }
        }
    }

    pub(crate) fn emit_row(
        &mut self,
        i: usize,
        decision: Decision,
        (p, pin): (TensorId, HostTensorId),
        (c, cout): (TensorId, HostTensorId),
        block: &mut Vec<Inst>,
    ) -> Result<(), PassError> {
        let (pmesh, cmesh) = (self.sharding(p).mesh, self.sharding(c).mesh);
        let (pm, cm) = (self.mesh(pmesh)?.clone(), self.mesh(cmesh)?.clone());
        let slice = |pt| Team::Slice { mesh: cmesh, pt };
        let flat = |pts| Team::Flattened { mesh: cmesh, pts };
        // Partial results are reduced with their own kind (sum, max, min or avg).
        let sum = Some(crate::analysis::partial_kind(self.program, p));
        let coll = |kind, team, root, op, exchanged| Collective {
            kind,
            team,
            input: pin,
            output: cout,
            root,
            op,
            exchanged,
        };
        match decision {
            Decision::LocalCopy => block.push(compute(ComputeOp::Copy, pin, cout)),
            Decision::AllGather { pt, axis } => self.collective(
                block,
                coll(CommKind::AllGather, slice(pt), None, None, Some(axis)),
            ),
            Decision::AllReduce { pt } => {
                self.collective(block, coll(CommKind::AllReduce, slice(pt), None, sum, None))
            }
            Decision::ReduceScatter { pt, axis } => self.collective(
                block,
                coll(CommKind::ReduceScatter, slice(pt), None, sum, Some(axis)),
            ),
            Decision::StridedAllGather { pt, axis, serial } => {
                let d = pm.size_of(pt).unwrap_or(1) as u64;
                let shape = self.host.tensors[cout].shape.clone();
                let gathered = self.derived(cout, "gathered", shape);
                self.collective(
                    block,
                    Collective {
                        kind: CommKind::AllGather,
                        team: slice(pt),
                        input: pin,
                        output: gathered,
                        root: None,
                        op: None,
                        exchanged: Some(axis),
                    },
                );
                // Blocks arrive member-major: [.., d, serial, rest, ..] -> [.., serial, d, rest, ..].
                let split = self.split_axis(gathered, axis, &[d, serial])?;
                let tmp = self.derived(gathered, "blocks", split.clone());
                block.push(compute(ComputeOp::Copy, gathered, tmp));
                let mut perm: Vec<usize> = (0..split.len()).collect();
                perm.swap(axis, axis + 1);
                let shape = self.permuted_shape(tmp, &perm);
                let ordered = self.derived(gathered, "ordered", shape);
                block.push(compute(ComputeOp::Permute { perm }, tmp, ordered));
                block.push(compute(ComputeOp::Copy, ordered, cout));
            }
            Decision::StridedSlice { pt, axis, serial } => {
                let d = pm.size_of(pt).unwrap_or(1) as u64;
                // [.., serial, d, rest, ..]: each device keeps index `my(pt)` of the `d` axis.
                let split = self.split_axis(pin, axis, &[serial, d])?;
                let tmp = self.derived(pin, "pieces", split.clone());
                block.push(compute(ComputeOp::Copy, pin, tmp));
                let mut shape = split;
                shape[axis + 1] = 1;
                let v = self.derived(tmp, "slice", shape.clone());
                self.views.insert(v, (tmp, axis + 1));
                block.push(Inst::new(InstKind::ShardByStream {
                    out: v,
                    input: tmp,
                    axis: axis + 1,
                    chunks: d,
                    index: Expr::my(cmesh, pt),
                }));
                let mine = self.derived(cout, "mine", shape);
                block.push(compute(ComputeOp::Copy, v, mine));
                block.push(compute(ComputeOp::Copy, mine, cout));
            }
            Decision::MergedAllGather { pts, axis } => self.collective(
                block,
                coll(CommKind::AllGather, flat(pts), None, None, Some(axis)),
            ),
            Decision::MergedAllReduce { pts } => {
                self.collective(block, coll(CommKind::AllReduce, flat(pts), None, sum, None))
            }
            Decision::MergedReduceScatter { pts, axis } => self.collective(
                block,
                coll(CommKind::ReduceScatter, flat(pts), None, sum, Some(axis)),
            ),
            Decision::LocalSlice { pt, axis } => {
                let parts = self.sharding(c).split(pt).map_or(1, |s| s.parts);
                let mut shape = self.host.tensors[pin].shape.clone();
                if let Some(e) = shape.get_mut(axis) {
                    *e /= parts.max(1);
                }
                let v = self.derived(pin, "slice", shape);
                self.views.insert(v, (pin, axis));
                block.push(Inst::new(InstKind::ShardByStream {
                    out: v,
                    input: pin,
                    axis,
                    chunks: parts,
                    index: Expr::my(cmesh, pt),
                }));
                block.push(compute(ComputeOp::Copy, v, cout));
            }
            Decision::AllToAll { pt, from, to } => {
                let d = pm.size_of(pt).unwrap_or(1) as u64;
                self.all_to_all(block, slice(pt), d, (from, to), pin, cout)?;
            }
            Decision::SendRecv => self.send_recv_pairs(block, &pm, &cm, pin, cout),
            // Every receiver already holds the data: each copies it locally (a collective
            // permute of every member of the receiving mesh to itself).
            Decision::Broadcast if cm.devices().iter().all(|&d| pm.contains(d)) => {
                let me = flat_index(cmesh, &cm);
                self.push_comm(block, |id| InstKind::CollectivePermute {
                    id,
                    team: Team::Mesh(cmesh),
                    send_peer: me.clone(),
                    recv_peer: me,
                    input: pin,
                    output: cout,
                });
            }
            Decision::Broadcast => {
                let root = pm
                    .devices()
                    .iter()
                    .copied()
                    .find(|&d| cm.contains(d))
                    .unwrap_or(pm.devices()[0]);
                let (team, r) = with_member(cm.devices(), root);
                self.collective(
                    block,
                    coll(
                        CommKind::Broadcast,
                        Team::Devices(team),
                        Some(Expr::c(r)),
                        None,
                        None,
                    ),
                );
            }
            Decision::Gather { .. } | Decision::Reduce { .. } => {
                let (kind, op, exchanged) = match decision {
                    Decision::Gather { axis, .. } => (CommKind::Gather, None, Some(axis)),
                    _ => (CommKind::Reduce, sum, None),
                };
                for &r in cm.devices() {
                    let root = pm.devices().iter().position(|&d| d == r).ok_or_else(|| {
                        PassError::internal("lower_to_host", "a receiver outside the sender mesh")
                    })?;
                    self.collective(
                        block,
                        coll(
                            kind,
                            Team::Mesh(pmesh),
                            Some(Expr::c(root as i64)),
                            op,
                            exchanged,
                        ),
                    );
                }
            }
            Decision::Scatter { axis, .. } => {
                let root = cm
                    .devices()
                    .iter()
                    .position(|&d| pm.contains(d))
                    .ok_or_else(|| {
                        PassError::internal("lower_to_host", "no sender inside the receiving mesh")
                    })?;
                self.collective(
                    block,
                    coll(
                        CommKind::Scatter,
                        Team::Mesh(cmesh),
                        Some(Expr::c(root as i64)),
                        None,
                        Some(axis),
                    ),
                );
            }
            Decision::Ring { .. }
            | Decision::StreamBroadcast { .. }
            | Decision::ReduceRing { .. }
            | Decision::StreamReduce { .. }
            | Decision::Unsupported(_) => {
                return Err(PassError::internal(
                    "lower_to_host",
                    format!("row {decision:?} in emit_row"),
                ))
            }
        }
        let _ = i;
        Ok(())
    }

    /// The shape of `t` with `axis` cut into the extents `outer` and the rest: `[4, 48]` cut
    /// on axis 1 into `[2, 3]` is `[4, 2, 3, 8]`.
    fn split_axis(
        &self,
        t: HostTensorId,
        axis: usize,
        outer: &[u64],
    ) -> Result<Vec<u64>, PassError> {
        let shape = &self.host.tensors[t].shape;
        let e = shape.get(axis).copied().unwrap_or(0);
        let parts: u64 = outer.iter().product();
        if parts == 0 || !e.is_multiple_of(parts) {
            return Err(PassError::internal(
                "lower_to_host",
                format!("a strided axis of extent {e} is not cut into {outer:?} pieces"),
            ));
        }
        let mut out = shape[..axis].to_vec();
        out.extend_from_slice(outer);
        out.push(e / parts);
        out.extend_from_slice(&shape[axis + 1..]);
        Ok(out)
    }

    /// Same placements on two meshes of one shape: the device at each mesh position sends its
    /// shard to the device at the same position of the other mesh. Transfers between two
    /// devices are `send_recv`s over that pair, issued together in one coalescing group; a
    /// device found at the same position of both meshes keeps its shard and copies it locally
    /// (a `collective_permute` over that device alone, which no other device takes part in).
    fn send_recv_pairs(
        &mut self,
        block: &mut Vec<Inst>,
        pm: &meshflow_ir::DeviceMesh,
        cm: &meshflow_ir::DeviceMesh,
        pin: HostTensorId,
        cout: HostTensorId,
    ) {
        let pairs: Vec<(DeviceId, DeviceId)> = pm
            .devices()
            .iter()
            .copied()
            .zip(cm.devices().iter().copied())
            .collect();
        let moves: Vec<(DeviceId, DeviceId)> =
            pairs.iter().copied().filter(|(s, d)| s != d).collect();
        let staged = !self.contiguous(pin) || !self.contiguous(cout);
        let group = moves.len() > 1 && !staged;
        if group {
            block.push(Inst::new(InstKind::StartCoalescing));
            for &(src, dst) in &moves {
                let id = self.fresh_comm();
                block.push(Inst::new(InstKind::Communication {
                    id,
                    kind: CommKind::SendRecv,
                    team: Team::Devices(vec![src, dst]),
                    input: pin,
                    output: cout,
                    root: Some(Expr::c(0)),
                    op: None,
                }));
            }
            let id = self.fresh_comm();
            block.push(Inst::new(InstKind::EndCoalescing { id }));
            block.push(Inst::new(InstKind::Wait { comm: id }));
        } else {
            for &(src, dst) in &moves {
                self.collective(
                    block,
                    Collective {
                        kind: CommKind::SendRecv,
                        team: Team::Devices(vec![src, dst]),
                        input: pin,
                        output: cout,
                        root: Some(Expr::c(0)),
                        op: None,
                        exchanged: None,
                    },
                );
            }
        }
        for (src, _) in pairs.into_iter().filter(|(s, d)| s == d) {
            self.push_comm(block, |id| InstKind::CollectivePermute {
                id,
                team: Team::Devices(vec![src]),
                send_peer: Expr::c(0),
                recv_peer: Expr::c(0),
                input: pin,
                output: cout,
            });
        }
    }

    /// Split on `from` to split on `to` over a team of `d`: chunks of `to` go to their
    /// owners; what arrives is ordered by source member (= `from` chunk) and rearranged.
    fn all_to_all(
        &mut self,
        block: &mut Vec<Inst>,
        team: Team,
        d: u64,
        (from, to): (usize, usize),
        pin: HostTensorId,
        cout: HostTensorId,
    ) -> Result<(), PassError> {
        let pshape = self.host.tensors[pin].shape.clone();
        let rank = pshape.len();
        let tin = if self.outermost(pin, to) && self.contiguous(pin) {
            pin
        } else {
            let perm = to_front(rank, to);
            let shape = self.permuted_shape(pin, &perm);
            let t = self.derived(pin, "perm", shape);
            block.push(compute(permute_op(perm), pin, t));
            t
        };
        let rest: Vec<usize> = (0..rank).filter(|&v| v != to).collect();
        let mut shape = vec![d, pshape.get(to).copied().unwrap_or(0) / d.max(1)];
        shape.extend(rest.iter().map(|&v| pshape[v]));
        let tout = self.derived(cout, "a2a", shape);
        self.push_comm(block, |id| InstKind::Communication {
            id,
            kind: CommKind::AllToAll,
            team,
            input: tin,
            output: tout,
            root: None,
            op: None,
        });
        let pos = |v: usize| 2 + rest.iter().position(|&r| r == v).unwrap_or(0);
        let mut perm = Vec::with_capacity(rank + 1);
        for v in 0..rank {
            if v == from {
                perm.push(0);
                perm.push(pos(v));
            } else if v == to {
                perm.push(1);
            } else {
                perm.push(pos(v));
            }
        }
        match permute_op(perm) {
            ComputeOp::Copy => block.push(compute(ComputeOp::Copy, tout, cout)),
            op => {
                let ComputeOp::Permute { perm } = &op else {
                    return Err(PassError::internal("lower_to_host", "permute expected"));
                };
                let shape = self.permuted_shape(tout, perm);
                let t2 = self.derived(cout, "a2a_perm", shape);
                block.push(compute(op, tout, t2));
                block.push(compute(ComputeOp::Copy, t2, cout));
            }
        }
        Ok(())
    }
}

/// This device's index in the row-major order of `mesh` (its index in `Team::Mesh`):
/// `my(m, DIDz) * dy * dx + my(m, DIDy) * dx + my(m, DIDx)`.
fn flat_index(id: meshflow_ir::MeshId, mesh: &meshflow_ir::DeviceMesh) -> Expr {
    let mut e: Option<Expr> = None;
    let mut stride = 1i64;
    for pt in ParallelType::DEVICE {
        let Some(n) = mesh.size_of(pt) else { break };
        let term = if stride == 1 {
            Expr::my(id, pt)
        } else {
            Expr::my(id, pt).mul(Expr::c(stride))
        };
        e = Some(match e {
            None => term,
            Some(acc) => term.add(acc),
        });
        stride *= n as i64;
    }
    e.unwrap_or(Expr::c(0))
}

/// `devices` with `member` appended when it is not in it, and `member`'s index.
fn with_member(devices: &[DeviceId], member: DeviceId) -> (Vec<DeviceId>, i64) {
    let mut team = devices.to_vec();
    let index = match team.iter().position(|&d| d == member) {
        Some(k) => k,
        None => {
            team.push(member);
            team.len() - 1
        }
    };
    (team, index as i64)
}
