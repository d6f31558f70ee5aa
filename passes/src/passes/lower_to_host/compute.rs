//! Compute lowering: local ops (on chunk views inside a stream loop; `custom` ops become
//! `call_kernel`) and the MoE communication ops.

use meshflow_ir::host::{ComputeOp, Expr, Inst, InstKind, Team};
use meshflow_ir::{OpKind, ParallelType, TensorId};

use super::loop_nest::LoopCtx;
use super::Lowering;
use crate::analysis::op_axis_map;
use crate::decision::{placements, Placement};
use crate::error::PassError;
use crate::passes::decompose_reshardings::local_mismatch;

/// What a local op lowers to.
enum Local {
    /// A built-in compute op.
    Compute(ComputeOp),
    /// `call_kernel` of an embedder's kernel (a `custom` op).
    Kernel { kernel: String, args: Vec<i64> },
}

impl Lowering<'_> {
    pub(crate) fn emit_compute(
        &mut self,
        i: usize,
        mut lp: Option<&mut LoopCtx>,
        block: &mut Vec<Inst>,
    ) -> Result<(), PassError> {
        let op = self.program.ops[i].clone();
        if let Some(why) = local_mismatch(self.program, i)? {
            return Err(PassError::op(self.program, i, why));
        }
        let local = match &op.kind {
            OpKind::Set => Local::Compute(ComputeOp::Copy),
            OpKind::Matmul => Local::Compute(ComputeOp::Matmul),
            OpKind::Linear => Local::Compute(ComputeOp::Linear),
            OpKind::Add => Local::Compute(ComputeOp::Add),
            OpKind::Sub => Local::Compute(ComputeOp::Sub),
            OpKind::Mul => Local::Compute(ComputeOp::Mul),
            OpKind::Gelu => Local::Compute(ComputeOp::Gelu),
            OpKind::Silu => Local::Compute(ComputeOp::Silu),
            OpKind::Cast => Local::Compute(ComputeOp::Cast),
            OpKind::Sum { axis } => Local::Compute(ComputeOp::Sum { axis: *axis }),
            OpKind::Max { axis } => Local::Compute(ComputeOp::Max { axis: *axis }),
            OpKind::Min { axis } => Local::Compute(ComputeOp::Min { axis: *axis }),
            OpKind::Avg { axis } => Local::Compute(ComputeOp::Avg { axis: *axis }),
            OpKind::Softmax { axis } => Local::Compute(ComputeOp::Softmax { axis: *axis }),
            OpKind::RmsNorm { axis, eps } => Local::Compute(ComputeOp::RmsNorm {
                axis: *axis,
                eps: *eps,
            }),
            // Splits of a reshape land on the first axes of its groups: the local buffers hold
            // the same elements in the same row-major order.
            OpKind::Reshape | OpKind::View | OpKind::Squeeze { .. } | OpKind::Unsqueeze { .. } => {
                Local::Compute(ComputeOp::Copy)
            }
            OpKind::Permute { perm } if perm.iter().enumerate().all(|(k, &p)| k == p) => {
                Local::Compute(ComputeOp::Copy)
            }
            OpKind::Permute { perm } => Local::Compute(ComputeOp::Permute { perm: perm.clone() }),
            OpKind::Expand => Local::Compute(ComputeOp::Expand),
            // The sliced, selected or concatenated axis is never split: local indices are global.
            OpKind::Slice { axis, start, .. } | OpKind::Select { axis, index: start } => {
                Local::Compute(ComputeOp::Slice {
                    axis: *axis,
                    start: *start,
                })
            }
            OpKind::Cat { axis, inputs } => Local::Compute(ComputeOp::Cat {
                axis: *axis,
                inputs: *inputs,
            }),
            OpKind::GroupedMatmul => Local::Compute(ComputeOp::GroupedMatmul),
            OpKind::Custom(c) => Local::Kernel {
                kernel: c.kernel.clone(),
                args: c.args.clone(),
            },
            OpKind::MoeDispatch { .. } | OpKind::MoeCombine => {
                return Err(PassError::internal(
                    "lower_to_host",
                    "MoE op lowered as compute",
                ))
            }
        };
        let Some(&out) = op.outputs.first() else {
            return Err(PassError::op(self.program, i, "expected an output"));
        };
        match local {
            Local::Compute(_) if op.outputs.len() != 1 => {
                return Err(PassError::op(
                    self.program,
                    i,
                    "expected exactly one output",
                ))
            }
            Local::Kernel { .. } => {
                // One launch computes every output chunk: they must be cut alike.
                let first = self.sharding(out);
                for &o in &op.outputs[1..] {
                    let sh = self.sharding(o);
                    if sh.mesh != first.mesh || sh.spec != first.spec {
                        return Err(PassError::tensor(
                            self.name(o),
                            format!(
                                "every output of a `custom` op must be sharded like its first \
                                 output `{}`",
                                self.name(out)
                            ),
                        ));
                    }
                }
            }
            Local::Compute(_) => {}
        }
        let stream_axis = if lp.is_some() {
            self.sharding(out).stream().map(|s| s.axis)
        } else {
            None
        };
        let map = op_axis_map(self.program, &op);
        let mut inputs = Vec::with_capacity(op.inputs.len());
        for (j, &t) in op.inputs.iter().enumerate() {
            let axis = stream_axis
                .and_then(|k| map.first()?.get(k)?.iter().find(|(jj, _)| *jj == j))
                .and_then(|&(_, a)| self.sharding(t).value_index(a));
            let what = format!("input of `{}`", op.kind.name());
            inputs.push(self.operand(lp.as_deref_mut(), block, t, axis, &what)?);
        }
        let mut outputs = Vec::with_capacity(op.outputs.len());
        for &o in &op.outputs {
            let out_axis = stream_axis.and_then(|k| self.sharding(o).value_index(k));
            let what = format!("output of `{}`", op.kind.name());
            outputs.push(self.operand(lp.as_deref_mut(), block, o, out_axis, &what)?);
        }
        if let (OpKind::Select { axis, .. }, Some(&o)) = (&op.kind, outputs.first()) {
            // `select` is a one-element slice (the axis kept) copied into the output.
            let mut shape = self.host.tensors[inputs[0]].shape.clone();
            if let Some(e) = shape.get_mut(*axis) {
                *e = 1;
            }
            let t = self.derived(o, "selected", shape);
            if let Local::Compute(slice) = local {
                block.push(Inst::new(InstKind::Compute {
                    op: slice,
                    inputs,
                    outputs: vec![t],
                }));
            }
            block.push(Inst::new(InstKind::Compute {
                op: ComputeOp::Copy,
                inputs: vec![t],
                outputs,
            }));
            return Ok(());
        }
        let kind = match local {
            Local::Compute(op) => InstKind::Compute {
                op,
                inputs,
                outputs,
            },
            Local::Kernel { kernel, mut args } => {
                // The local extents of the first output's chunk (per rank, for uneven
                // shards) follow the op's own args.
                let shape = outputs
                    .first()
                    .map(|&o| self.extents(o))
                    .unwrap_or_default();
                let mut all: Vec<Expr> = args.drain(..).map(Expr::c).collect();
                all.extend(shape);
                InstKind::CallKernel {
                    kernel,
                    inputs,
                    outputs,
                    args: all,
                }
            }
        };
        block.push(Inst::new(kind));
        Ok(())
    }

    /// The device parallel type splitting value axis `axis` of `t`; every other device split
    /// of `t` is an error.
    fn only_split(&self, t: TensorId, axis: usize, role: &str) -> Result<ParallelType, PassError> {
        let pl = placements(self.sharding(t));
        let found = pl.iter().find_map(|(&pt, p)| match p {
            Placement::Split { axis: a, .. } if *a == axis => Some(pt),
            _ => None,
        });
        match found {
            Some(pt) if pl.len() == 1 => Ok(pt),
            _ => Err(PassError::tensor(
                self.name(t),
                format!(
                    "as the {role} it must be split over exactly one device parallel type, on \
                     its axis {axis}, and nothing else"
                ),
            )),
        }
    }

    pub(crate) fn emit_moe(&mut self, i: usize, block: &mut Vec<Inst>) -> Result<(), PassError> {
        let op = self.program.ops[i].clone();
        let vrank = |l: &Self, t: TensorId| l.sharding(t).value_axes.len();
        // (tensor, axis that must carry the expert-parallel split, role)
        let (experts, checks): (TensorId, Vec<(TensorId, usize, &str)>) = match op.kind {
            OpKind::MoeDispatch { .. } => {
                let (x, idx) = (op.inputs[0], op.inputs[1]);
                let (ex, counts, routing) = (op.outputs[0], op.outputs[1], op.outputs[2]);
                let nb = vrank(self, ex).saturating_sub(3);
                let t = vrank(self, x).saturating_sub(2);
                (
                    ex,
                    vec![
                        (ex, nb, "expert rows (expert axis)"),
                        (counts, nb, "expert counts (expert axis)"),
                        (routing, nb, "routing (expert axis)"),
                        (x, t, "tokens (token axis)"),
                        (idx, t, "top-k indices (token axis)"),
                    ],
                )
            }
            _ => {
                let (ey, counts, routing, w) =
                    (op.inputs[0], op.inputs[1], op.inputs[2], op.inputs[3]);
                let out = op.outputs[0];
                let nb = vrank(self, ey).saturating_sub(3);
                let t = vrank(self, w).saturating_sub(2);
                (
                    ey,
                    vec![
                        (ey, nb, "expert outputs (expert axis)"),
                        (counts, nb, "expert counts (expert axis)"),
                        (routing, nb, "routing (expert axis)"),
                        (w, t, "top-k weights (token axis)"),
                        (out, t, "combined tokens (token axis)"),
                    ],
                )
            }
        };
        let mesh = self.sharding(experts).mesh;
        let mut ep = None;
        for (t, axis, role) in checks {
            let pt = self.only_split(t, axis, role)?;
            if self.sharding(t).mesh != mesh {
                return Err(PassError::tensor(
                    self.name(t),
                    format!("`{}` needs all its tensors on one mesh", op.kind.name()),
                ));
            }
            match ep {
                None => ep = Some(pt),
                Some(p) if p != pt => {
                    return Err(PassError::tensor(
                        self.name(t),
                        format!(
                            "split over {pt} but the expert-parallel type of `{}` is {p}",
                            op.kind.name()
                        ),
                    ))
                }
                _ => {}
            }
        }
        let pt = ep.ok_or_else(|| PassError::internal("lower_to_host", "no MoE tensors"))?;
        let team = Team::Slice { mesh, pt };
        let h = |t: TensorId| self.host_of(t);
        let kind = if let OpKind::MoeDispatch { wire } = op.kind {
            let (x, topk_idx) = (h(op.inputs[0]), h(op.inputs[1]));
            let (expert_x, expert_counts, routing) =
                (h(op.outputs[0]), h(op.outputs[1]), h(op.outputs[2]));
            Box::new(move |id| InstKind::MoeDispatch {
                id,
                team,
                x,
                topk_idx,
                expert_x,
                expert_counts,
                routing,
                wire,
            }) as Box<dyn FnOnce(_) -> InstKind>
        } else {
            let (expert_y, expert_counts, routing, topk_weights) = (
                h(op.inputs[0]),
                h(op.inputs[1]),
                h(op.inputs[2]),
                h(op.inputs[3]),
            );
            let out = h(op.outputs[0]);
            Box::new(move |id| InstKind::MoeCombine {
                id,
                team,
                expert_y,
                expert_counts,
                routing,
                topk_weights,
                out,
            })
        };
        self.push_comm(block, kind);
        Ok(())
    }
}
