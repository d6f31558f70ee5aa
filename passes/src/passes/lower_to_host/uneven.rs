//! Uneven shards: padded buffers and the per-rank views that select their valid part.
//!
//! A tensor split unevenly (DTensor's chunk rule, see `meshflow_ir::program::schedule`) gets
//! a host buffer of the same, *padded* local shape on every device: along a ragged axis each
//! level of its chain of splits keeps the extent of its largest piece. The device's actual
//! piece is a prefix of that buffer (of a stream chunk of it, when the chain has a Stream
//! level), whose length is a scalar expression of `my(mesh, pt)` (and of the stream chunk
//! index): level by level, `c = ceil(E / p)`, `E' = min(c, max(0, E - digit * c))`.
//!
//! - Compute ops see only valid extents: every operand goes through `narrow` views of length
//!   [`Lowering::valid_extent`] (kernels never read padding).
//! - Collectives move whole padded buffers (NCCL has no v-collectives): every member sends
//!   and receives the same count, and the lowering repacks around them with `narrow` views
//!   and copies (see `communication.rs`).
//!
//! Padding is never read as data: inputs are scattered with zero padding, outputs are
//! gathered from valid elements only, and a reduction over padded buffers only reduces
//! padding into padding.

use meshflow_ir::host::{ComputeOp, ExprEnv, HostTensorId, Inst, InstKind, LoopVar};
use meshflow_ir::{DeviceId, DeviceMesh, Expr, MeshId, ParallelType, TensorId};

use super::Lowering;
use crate::error::PassError;

/// `ceil(e / p)`, folded when `e` is a constant.
pub(crate) fn ceil_div(e: &Expr, p: u64) -> Expr {
    let p = p.max(1) as i64;
    match e.as_const() {
        Some(v) => Expr::c((v + p - 1).div_euclid(p)),
        None if p == 1 => e.clone(),
        None => e.clone().add(Expr::c(p - 1)).div(Expr::c(p)),
    }
}

/// `min(c, max(0, e - d * c))`: the extent of piece `d` of `e` cut into pieces of `c`.
pub(crate) fn piece(e: &Expr, c: &Expr, d: &Expr) -> Expr {
    if let (Some(ev), Some(cv), Some(dv)) = (e.as_const(), c.as_const(), d.as_const()) {
        return Expr::c(cv.min((ev - dv * cv).max(0)));
    }
    let off = match (d.as_const(), c.as_const()) {
        (Some(0), _) | (_, Some(0)) => Expr::c(0),
        (Some(1), _) => c.clone(),
        (_, Some(1)) => d.clone(),
        _ => d.clone().mul(c.clone()),
    };
    c.clone().min(Expr::c(0).max(e.clone().sub(off)))
}

/// `min(d * c, e)`: where piece `d` of `e` cut into pieces of `c` starts.
pub(crate) fn piece_start(e: &Expr, c: &Expr, d: &Expr) -> Expr {
    if let (Some(ev), Some(cv), Some(dv)) = (e.as_const(), c.as_const(), d.as_const()) {
        return Expr::c((dv * cv).min(ev));
    }
    d.clone().mul(c.clone()).min(e.clone())
}

/// An environment for evaluating an expression on every device of one mesh (and every value
/// of one loop variable).
struct Probe<'a> {
    mesh_id: MeshId,
    mesh: &'a DeviceMesh,
    device: DeviceId,
    var: Option<(LoopVar, i64)>,
}

impl ExprEnv for Probe<'_> {
    fn loop_value(&self, var: LoopVar) -> Option<i64> {
        self.var.filter(|(v, _)| *v == var).map(|(_, x)| x)
    }

    fn my_index(&self, mesh: MeshId, pt: ParallelType) -> Option<i64> {
        (mesh == self.mesh_id)
            .then(|| self.mesh.team_index(self.device, pt))
            .flatten()
            .and_then(|i| i64::try_from(i).ok())
    }

    fn rank(&self) -> DeviceId {
        self.device
    }
}

/// The values `e` takes on the devices of `mesh` (and for `var` in `0..n`), or `None` when it
/// cannot be evaluated everywhere.
pub(crate) fn values(
    e: &Expr,
    mesh_id: MeshId,
    mesh: &DeviceMesh,
    var: Option<(LoopVar, u64)>,
) -> Option<Vec<i64>> {
    let mut out = Vec::new();
    let iters: Vec<Option<(LoopVar, i64)>> = match var {
        Some((v, n)) => (0..n as i64).map(|x| Some((v, x))).collect(),
        None => vec![None],
    };
    for &device in mesh.devices() {
        for it in &iters {
            let env = Probe {
                mesh_id,
                mesh,
                device,
                var: *it,
            };
            out.push(e.eval(&env).ok()?);
        }
    }
    Some(out)
}

impl Lowering<'_> {
    /// The loop variable and trip count a chunk-index expression reads, if any.
    fn chunk_var(&self, chunk: Option<&Expr>) -> Option<(LoopVar, u64)> {
        let e = chunk?;
        let mut var = None;
        e.for_each_loop_var(&mut |v| var = Some(v));
        let v = var?;
        self.loop_trips.get(&v).map(|&n| (v, n))
    }

    /// The valid extent of host axis `v` of level-1 tensor `t`, as an expression of this
    /// device's team indices (and of `chunk`, the index of the stream chunk being accessed
    /// when the access is a chunk of `t`'s own Stream split), or `None` when it always equals
    /// the host extent (the axis is not ragged, or no piece is short).
    pub(crate) fn valid_extent(
        &self,
        t: TensorId,
        v: usize,
        chunk: Option<&Expr>,
    ) -> Result<Option<Expr>, PassError> {
        let sh = self.sharding(t);
        let Some(&a) = sh.value_axes.get(v) else {
            return Ok(None);
        };
        let Some(al) = sh.layout.axes.get(a) else {
            return Ok(None);
        };
        if !al.ragged || al.leaves.is_empty() {
            return Ok(None);
        }
        let n = al.leaves.len();
        let last = &al.leaves[n - 1];
        let has_stream = al.leaves.iter().any(|l| l.pt == ParallelType::Stream);
        let mut e = Expr::c(al.extent as i64);
        // Every level but the last cuts by the chunk rule; a last piece that is itself split
        // over devices is one more level.
        let levels = if last.pt.is_device() { n } else { n - 1 };
        for leaf in &al.leaves[..levels] {
            let digit = match leaf.pt {
                pt if pt.is_device() => Expr::my(sh.mesh, pt),
                ParallelType::Stream => match chunk {
                    Some(c) => c.clone(),
                    None => {
                        return Err(PassError::tensor(
                            self.name(t),
                            format!(
                                "its axis {v} is split unevenly and into stream chunks; the \
                                 whole buffer is read outside the stream loop, where its valid \
                                 elements are not one piece (keep the op in the loop, or split \
                                 evenly)"
                            ),
                        ))
                    }
                },
                _ => {
                    return Err(PassError::internal(
                        "lower_to_host",
                        "a serial level inside a ragged chain",
                    ))
                }
            };
            let c = ceil_div(&e, leaf.extent);
            e = piece(&e, &c, &digit);
        }
        // The host extent of what is accessed: the whole local buffer, or one chunk of it.
        let host = if has_stream && chunk.is_some() {
            if last.pt.is_device() {
                1
            } else {
                last.extent
            }
        } else {
            al.local_extent()
        };
        let mesh = self.mesh(sh.mesh)?;
        let always_full = values(&e, sh.mesh, mesh, self.chunk_var(chunk))
            .is_some_and(|vals| vals.iter().all(|&x| x == host as i64));
        Ok((!always_full).then_some(e))
    }

    /// A view of elements `[start, start + length)` of `base` along `axis` (declared with
    /// `base`'s shape: its capacity).
    pub(crate) fn narrow(
        &mut self,
        block: &mut Vec<Inst>,
        base: HostTensorId,
        axis: usize,
        start: Expr,
        length: Expr,
        suffix: &str,
    ) -> HostTensorId {
        // The view's declared extent is its capacity: the longest piece on any device.
        let mut shape = self.host.tensors[base].shape.clone();
        let full = shape.get(axis).copied().unwrap_or(0);
        let mesh_id = self.host.tensors[base].mesh;
        let mut var = None;
        length.for_each_loop_var(&mut |l| var = self.loop_trips.get(&l).map(|&n| (l, n)));
        let cap = self
            .mesh(mesh_id)
            .ok()
            .and_then(|m| values(&length, mesh_id, m, var))
            .and_then(|vals| vals.into_iter().max())
            .map_or(full, |m| (m.max(0) as u64).min(full));
        if let Some(e) = shape.get_mut(axis) {
            *e = cap;
        }
        let v = self.derived(base, suffix, shape);
        self.views.insert(v, (base, axis));
        let mut ext = self.extents(base);
        if let Some(slot) = ext.get_mut(axis) {
            *slot = length.clone();
        }
        self.lengths.insert(v, ext);
        block.push(Inst::new(InstKind::Narrow {
            out: v,
            input: base,
            axis,
            start,
            length,
        }));
        v
    }

    /// The extents of host tensor (or view) `h` on this rank: the lengths of the `narrow`s
    /// it was cut by, constants elsewhere.
    pub(crate) fn extents(&self, h: HostTensorId) -> Vec<Expr> {
        match self.lengths.get(&h) {
            Some(e) => e.clone(),
            None => self.host.tensors[h]
                .shape
                .iter()
                .map(|&e| Expr::c(e as i64))
                .collect(),
        }
    }

    /// `h` (the buffer of level-1 tensor `t`, or its chunk along value axis `chunk.0` with
    /// index `chunk.1`) narrowed to its valid extent along every ragged axis but `skip`.
    pub(crate) fn valid_view(
        &mut self,
        block: &mut Vec<Inst>,
        t: TensorId,
        h: HostTensorId,
        chunk: Option<(usize, &Expr)>,
        skip: Option<usize>,
    ) -> Result<HostTensorId, PassError> {
        let rank = self.sharding(t).value_axes.len();
        let mut cur = h;
        for v in (0..rank).filter(|&v| Some(v) != skip) {
            let digit = chunk.filter(|(a, _)| *a == v).map(|(_, e)| e);
            if let Some(len) = self.valid_extent(t, v, digit)? {
                cur = self.narrow(block, cur, v, Expr::c(0), len, "valid");
            }
        }
        Ok(cur)
    }

    /// `out = in`, both views of the same shape on this rank.
    pub(crate) fn copy(
        &mut self,
        block: &mut Vec<Inst>,
        input: HostTensorId,
        output: HostTensorId,
    ) {
        block.push(Inst::new(InstKind::Compute {
            op: ComputeOp::Copy,
            inputs: vec![input],
            outputs: vec![output],
        }));
    }

    /// True when level-1 tensor `t` has a ragged axis.
    pub(crate) fn is_ragged(&self, t: TensorId) -> bool {
        self.sharding(t).layout.axes.iter().any(|a| a.ragged)
    }
}
