//! Shape, dtype and attribute rules of single host instructions: views, communications,
//! MoE dispatch and combine, and compute ops.

use super::host::HostChecker;
use super::Location;
use crate::dtype::DType;
use crate::host::{CommKind, Expr, HostTensor, HostTensorId, InstKind, Role, Side};

/// `[4, 8]`.
fn shape_str(s: &[u64]) -> String {
    format!("{s:?}")
}

/// Element count, `None` on overflow.
pub(super) fn numel(t: &HostTensor) -> Option<u64> {
    t.shape.iter().try_fold(1u64, |acc, &e| acc.checked_mul(e))
}

impl HostChecker<'_> {
    fn decl(&self, t: HostTensorId) -> Option<&HostTensor> {
        self.p.tensors.get(t)
    }

    /// Checks a constant index expression against `0..bound`.
    fn const_in_range(&mut self, e: &Expr, bound: u64, what: &str, here: &Location) {
        if let Some(v) = e.as_const() {
            if v < 0 || v as u64 >= bound {
                self.push(here, format!("{what} {v} is out of range for {bound}"));
            }
        }
    }

    /// A view's own rules (shared by `shard_by_stream` and `narrow`): not a view of itself,
    /// internal, same dtype and mesh, an axis in range. Returns the view, the viewed tensor
    /// and the viewed extent along the axis when they hold.
    fn view_rules(
        &mut self,
        out: HostTensorId,
        input: HostTensorId,
        axis: usize,
        here: &Location,
    ) -> Option<(HostTensor, HostTensor, u64)> {
        let (Some(v), Some(t)) = (self.decl(out).cloned(), self.decl(input).cloned()) else {
            return None;
        };
        if out == input {
            self.push(here, format!("`{}` cannot be a view of itself", v.name));
            return None;
        }
        if v.role != Role::Internal {
            self.push(
                here,
                format!(
                    "view `{}` must be declared `tensor` (internal), not as a program {}",
                    v.name,
                    if v.role == Role::Input {
                        "input"
                    } else {
                        "output"
                    }
                ),
            );
        }
        if v.dtype != t.dtype {
            self.push(
                here,
                format!(
                    "view `{}` is {} but `{}` is {}",
                    v.name, v.dtype, t.name, t.dtype
                ),
            );
        }
        if v.mesh != t.mesh {
            self.push(
                here,
                format!("view `{}` and `{}` are on different meshes", v.name, t.name),
            );
        }
        let Some(&extent) = t.shape.get(axis) else {
            self.push(
                here,
                format!(
                    "axis {axis} is out of range for `{}` of shape {}",
                    t.name,
                    shape_str(&t.shape)
                ),
            );
            return None;
        };
        Some((v, t, extent))
    }

    /// `narrow`: the view has the viewed tensor's shape except along the axis, where its
    /// capacity is at most the viewed extent; constant bounds must lie inside.
    pub(super) fn narrow(&mut self, kind: &InstKind, here: &Location) {
        let InstKind::Narrow {
            out,
            input,
            axis,
            start,
            length,
        } = kind
        else {
            return;
        };
        let Some((v, t, extent)) = self.view_rules(*out, *input, *axis, here) else {
            return;
        };
        let same_elsewhere = v.shape.len() == t.shape.len()
            && v.shape
                .iter()
                .zip(&t.shape)
                .enumerate()
                .all(|(k, (a, b))| k == *axis || a == b);
        let cap = v.shape.get(*axis).copied().unwrap_or(0);
        if !same_elsewhere || cap > extent {
            self.push(
                here,
                format!(
                    "view `{}` has shape {} but a narrowing of `{}` (shape {}) along axis \
                     {axis} keeps every other extent and at most {extent} elements along it",
                    v.name,
                    shape_str(&v.shape),
                    t.name,
                    shape_str(&t.shape)
                ),
            );
        }
        if let (Some(s), Some(l)) = (start.as_const(), length.as_const()) {
            if s < 0 || l < 0 || l as u64 > cap || (s + l) as u64 > extent {
                self.push(
                    here,
                    format!(
                        "elements [{s}, {s} + {l}) along axis {axis} do not fit `{}` (extent \
                         {extent}) or the view's capacity {cap}",
                        t.name
                    ),
                );
            }
        }
    }

    /// `shard_by_stream`: the view is one of `chunks` equal chunks of the viewed tensor along
    /// the axis; a constant index must name one of them.
    pub(super) fn shard_by_stream(&mut self, kind: &InstKind, here: &Location) {
        let InstKind::ShardByStream {
            out,
            input,
            axis,
            chunks,
            index,
        } = kind
        else {
            return;
        };
        let Some((v, t, extent)) = self.view_rules(*out, *input, *axis, here) else {
            return;
        };
        if *chunks == 0 {
            self.push(here, "chunks must be at least 1".to_string());
            return;
        }
        if extent % chunks != 0 {
            self.push(
                here,
                format!(
                    "axis {axis} of `{}` has extent {extent}, which is not divisible into \
                     {chunks} chunks",
                    t.name
                ),
            );
            return;
        }
        let mut want = t.shape.clone();
        if let Some(e) = want.get_mut(*axis) {
            *e = extent / chunks;
        }
        if v.shape != want {
            self.push(
                here,
                format!(
                    "view `{}` has shape {} but a chunk of `{}` along axis {axis} has shape {}",
                    v.name,
                    shape_str(&v.shape),
                    t.name,
                    shape_str(&want)
                ),
            );
        }
        self.const_in_range(index, *chunks, "index", here);
    }

    /// Per-kind rules of communications and compute ops.
    pub(super) fn shapes(&mut self, kind: &InstKind, team_size: Option<usize>, here: &Location) {
        match kind {
            InstKind::Communication {
                kind,
                input,
                output,
                root,
                op,
                ..
            } => {
                let name = kind.name();
                match (kind.is_rooted(), root) {
                    (true, None) => self.push(here, format!("`{name}` needs `root=`")),
                    (false, Some(_)) => self.push(here, format!("`{name}` takes no `root`")),
                    (true, Some(r)) => {
                        if let Some(d) = team_size {
                            self.const_in_range(r, d as u64, "root", here);
                        }
                    }
                    (false, None) => {}
                }
                match (kind.is_reduction(), op) {
                    (true, None) => self.push(here, format!("`{name}` needs `op=`")),
                    (false, Some(_)) => self.push(here, format!("`{name}` takes no `op`")),
                    _ => {}
                }
                if let (Some(want), Some(d)) = (kind.contract().team_size, team_size) {
                    if d != want {
                        self.push(
                            here,
                            format!("`{name}` needs a team of {want} devices, this team has {d}"),
                        );
                    }
                }
                self.comm_buffers(*kind, *input, *output, team_size, here);
            }
            InstKind::CollectivePermute {
                input,
                output,
                send_peer,
                recv_peer,
                ..
            } => {
                if let Some(d) = team_size {
                    self.const_in_range(send_peer, d as u64, "send peer", here);
                    self.const_in_range(recv_peer, d as u64, "recv peer", here);
                }
                self.same_dtype("collective_permute", *input, *output, here);
                let (Some(i), Some(o)) = (self.decl(*input), self.decl(*output)) else {
                    return;
                };
                let (ni, no) = (numel(i), numel(o));
                if ni != no {
                    let count =
                        |n: Option<u64>| n.map_or_else(|| "too many".into(), |n| n.to_string());
                    let message = format!(
                        "`collective_permute` needs `{}` and `{}` to have the same number of \
                         elements, {} and {}",
                        i.name,
                        o.name,
                        count(ni),
                        count(no)
                    );
                    self.push(here, message);
                }
            }
            InstKind::MoeDispatch { .. } | InstKind::MoeCombine { .. } => self.moe(kind, here),
            InstKind::Compute {
                op,
                inputs,
                outputs,
            } => self.compute(op, inputs, outputs, here),
            // Kernels registered by an embedder check their own operands; the other
            // instructions have no shape rules here (views: `shard_by_stream`, `narrow`).
            InstKind::CallKernel { .. }
            | InstKind::Allocate { .. }
            | InstKind::Deallocate { .. }
            | InstKind::ForLoop { .. }
            | InstKind::GetCurrentStream { .. }
            | InstKind::SetCurrentStream { .. }
            | InstKind::Synchronize { .. }
            | InstKind::ShardByStream { .. }
            | InstKind::Narrow { .. }
            | InstKind::Wait { .. }
            | InstKind::StartCoalescing
            | InstKind::EndCoalescing { .. } => {}
        }
    }

    fn same_dtype(&mut self, inst: &str, a: HostTensorId, b: HostTensorId, here: &Location) {
        let (Some(x), Some(y)) = (self.decl(a), self.decl(b)) else {
            return;
        };
        if x.dtype != y.dtype {
            let message = format!(
                "`{inst}` needs equal dtypes, but `{}` is {} and `{}` is {}",
                x.name, x.dtype, y.name, y.dtype
            );
            self.push(here, message);
        }
    }

    fn comm_buffers(
        &mut self,
        kind: CommKind,
        input: HostTensorId,
        output: HostTensorId,
        team_size: Option<usize>,
        here: &Location,
    ) {
        let name = kind.name();
        self.same_dtype(name, input, output, here);
        let (Some(i), Some(o)) = (self.decl(input).cloned(), self.decl(output).cloned()) else {
            return;
        };
        let (Some(ni), Some(no)) = (numel(&i), numel(&o)) else {
            return;
        };
        let Some(d) = team_size.map(|d| d as u64) else {
            return;
        };
        let contract = kind.contract();
        // (the larger buffer, its role, the smaller buffer) for the kinds that scale by d.
        let scaled = match contract.sizing.whole() {
            Some(Side::Recv) => Some((&o, "output", no, &i, ni)),
            Some(Side::Send) => Some((&i, "input", ni, &o, no)),
            None => None,
        };
        let message = if let Some((big, role, nbig, small, nsmall)) = scaled {
            match nsmall.checked_mul(d) {
                Some(want) if want == nbig => None,
                want => Some(format!(
                    "`{name}` over a team of {d} needs its {role} to hold {d} × {nsmall} = {} \
                     elements (`{}` has {nsmall}), but `{}` has {nbig}",
                    want.map_or_else(|| "too many".to_string(), |w| w.to_string()),
                    small.name,
                    big.name
                )),
            }
        } else if ni != no {
            Some(format!(
                "`{name}` needs `{}` and `{}` to have the same number of elements, {ni} and {no}",
                i.name, o.name
            ))
        } else if contract.send_chunked && ni % d != 0 {
            Some(format!(
                "`{name}` needs `{}` to split into {d} equal chunks, but it has {ni} \
                 elements",
                i.name
            ))
        } else {
            None
        };
        if let Some(message) = message {
            self.push(here, message);
        }
    }

    /// Checks `t` has exactly `want` as shape; `what` describes the expected form.
    fn want_shape(
        &mut self,
        t: &HostTensor,
        want: &[u64],
        inst: &str,
        what: &str,
        here: &Location,
    ) -> bool {
        if t.shape == want {
            return true;
        }
        self.push(
            here,
            format!(
                "`{inst}`: `{}` must have shape {} ({what}), has {}",
                t.name,
                shape_str(want),
                shape_str(&t.shape)
            ),
        );
        false
    }

    fn want_dtype(&mut self, t: &HostTensor, ok: &[DType], inst: &str, here: &Location) {
        if !ok.contains(&t.dtype) {
            let names: Vec<&str> = ok.iter().map(|d| d.name()).collect();
            self.push(
                here,
                format!(
                    "`{inst}`: `{}` must be {}, is {}",
                    t.name,
                    names.join(" or "),
                    t.dtype
                ),
            );
        }
    }

    fn want_rank(
        &mut self,
        t: &HostTensor,
        min: usize,
        inst: &str,
        what: &str,
        here: &Location,
    ) -> bool {
        if t.shape.len() >= min {
            return true;
        }
        self.push(
            here,
            format!(
                "`{inst}`: `{}` must be {what}, has shape {}",
                t.name,
                shape_str(&t.shape)
            ),
        );
        false
    }

    /// The number of devices in `team`, when its mesh is known.
    fn team_size(&self, team: &crate::host::Team) -> Option<usize> {
        use crate::host::Team;
        match team {
            Team::Devices(d) => Some(d.len()),
            Team::Mesh(m) => self.p.meshes.get(*m).map(|d| d.mesh.size()),
            Team::Slice { mesh, pt } => self.p.meshes.get(*mesh)?.mesh.size_of(*pt),
            Team::Flattened { .. } => team.size(&self.p.meshes),
        }
    }

    fn moe(&mut self, kind: &InstKind, here: &Location) {
        const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
        const INTS: [DType; 2] = [DType::I32, DType::I64];
        let get = |t: &HostTensorId| self.p.tensors.get(*t).cloned();
        match kind {
            InstKind::MoeDispatch {
                x,
                topk_idx,
                expert_x,
                expert_counts,
                routing,
                wire,
                ..
            } => {
                let inst = "moe_dispatch";
                let (Some(x), Some(idx), Some(ex), Some(counts), Some(routing)) = (
                    get(x),
                    get(topk_idx),
                    get(expert_x),
                    get(expert_counts),
                    get(routing),
                ) else {
                    return;
                };
                self.want_dtype(&x, &FLOATS, inst, here);
                self.want_dtype(&idx, &INTS, inst, here);
                self.want_dtype(&ex, &[x.dtype], inst, here);
                self.want_dtype(&counts, &[DType::I32], inst, here);
                self.want_dtype(&routing, &[DType::I32], inst, here);
                if !self.want_rank(&x, 2, inst, "[B.., T, H]", here) {
                    return;
                }
                let nb = x.shape.len() - 2;
                let (batch, t, h) = (&x.shape[..nb], x.shape[nb], x.shape[nb + 1]);
                if let Some(why) = wire.width_error(h) {
                    self.push(here, format!("`{inst}`: `{}`: {why}", x.name));
                }
                if idx.shape.len() != nb + 2 || idx.shape[..nb + 1] != x.shape[..nb + 1] {
                    self.push(
                        here,
                        format!(
                            "`{inst}`: `{}` must be [B.., T={t}, K] with the batch axes of \
                             `{}`, has shape {}",
                            idx.name,
                            x.name,
                            shape_str(&idx.shape)
                        ),
                    );
                }
                if ex.shape.len() != nb + 3
                    || ex.shape[..nb] != *batch
                    || ex.shape.last() != Some(&h)
                {
                    self.push(
                        here,
                        format!(
                            "`{inst}`: `{}` must be [B.., L, C, H={h}], has shape {}",
                            ex.name,
                            shape_str(&ex.shape)
                        ),
                    );
                    return;
                }
                let (l, c) = (ex.shape[nb], ex.shape[nb + 1]);
                let mut want = batch.to_vec();
                want.push(l);
                self.want_shape(&counts, &want, inst, "[B.., L]", here);
                want.extend([c, 2]);
                self.want_shape(&routing, &want, inst, "[B.., L, C, 2]", here);
                let team = match kind {
                    InstKind::MoeDispatch { team, .. } => self.team_size(team),
                    _ => None,
                };
                let k = idx.shape.last().copied().unwrap_or(0);
                if let Some(w) = team {
                    let experts = l.saturating_mul(w as u64);
                    if k > experts {
                        self.push(
                            here,
                            format!(
                                "`{inst}`: top-{k} routing (`{}` has K = {k}) needs at least {k} \
                                 experts, but the team of {w} holds {l} each ({experts} in all)",
                                idx.name
                            ),
                        );
                    }
                }
            }
            InstKind::MoeCombine {
                expert_y,
                expert_counts,
                routing,
                topk_weights,
                out,
                ..
            } => {
                let inst = "moe_combine";
                let (Some(ey), Some(counts), Some(routing), Some(w), Some(out)) = (
                    get(expert_y),
                    get(expert_counts),
                    get(routing),
                    get(topk_weights),
                    get(out),
                ) else {
                    return;
                };
                self.want_dtype(&ey, &FLOATS, inst, here);
                self.want_dtype(&counts, &[DType::I32], inst, here);
                self.want_dtype(&routing, &[DType::I32], inst, here);
                self.want_dtype(&w, &FLOATS, inst, here);
                self.want_dtype(&out, &[ey.dtype], inst, here);
                if !self.want_rank(&ey, 3, inst, "[B.., L, C, F]", here) {
                    return;
                }
                let nb = ey.shape.len() - 3;
                let batch = &ey.shape[..nb];
                let (l, c, f) = (ey.shape[nb], ey.shape[nb + 1], ey.shape[nb + 2]);
                let mut want = batch.to_vec();
                want.push(l);
                self.want_shape(&counts, &want, inst, "[B.., L]", here);
                want.extend([c, 2]);
                self.want_shape(&routing, &want, inst, "[B.., L, C, 2]", here);
                if w.shape.len() != nb + 2 || w.shape[..nb] != *batch {
                    self.push(
                        here,
                        format!(
                            "`{inst}`: `{}` must be [B.., T, K] with the batch axes of `{}`, \
                             has shape {}",
                            w.name,
                            ey.name,
                            shape_str(&w.shape)
                        ),
                    );
                    return;
                }
                let mut want = batch.to_vec();
                want.extend([w.shape[nb], f]);
                self.want_shape(&out, &want, inst, "[B.., T, F]", here);
            }
            _ => {}
        }
    }
}
