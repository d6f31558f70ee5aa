//! How each op relates the logical axes of its outputs to those of its inputs.
//!
//! For `y = linear(x[M, K], w[N, K])` with `y[M, N, rK]`: `y.M <- x.M`, `y.N <- w.N` and the
//! reduction axis `y.rK <- x.K, w.K`. Propagation pushes splits along these maps, the
//! decomposition derives the sharding an op needs from its inputs through them, and the
//! lowering uses them to find which input axis a Stream chunk of the output cuts. A `custom`
//! op maps each output axis to the input axes aligned with it from the last axis.
//!
//! Shape ops map an output axis only where a split of the input axis **is** the same split of
//! the output axis: `permute` renumbers, `squeeze`/`unsqueeze`/`select` shift, `expand` maps
//! its non-broadcast axes, `slice` and `cat` every axis but the sliced or concatenated one,
//! and `reshape`/`view` the first axis of each group ([`view_sources`]). A broadcast batch
//! axis of `matmul` maps only to the operand that has it.

use meshflow_ir::program::view_groups::view_sources;
use meshflow_ir::{Op, OpKind, Program, TensorId};

/// Per output of an op, per logical axis of that output: the `(input index, input logical
/// axis)` pairs it corresponds to.
pub type AxisMap = Vec<Vec<Vec<(usize, usize)>>>;

/// The axis map of `op` (see the module docs). Inputs are addressed by their **logical** axes;
/// only their value (non-reduction) axes ever appear, since a consumer never sees reduction
/// axes.
pub fn op_axis_map(program: &Program, op: &Op) -> AxisMap {
    let ty = |t: TensorId| program.tensors.get(t).map(|d| &d.ty);
    // Value axis -> logical axis, per input.
    let value_axes: Vec<Vec<usize>> = op
        .inputs
        .iter()
        .map(|&t| {
            ty(t).map_or_else(Vec::new, |ty| {
                ty.axes
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| !a.reduction)
                    .map(|(i, _)| i)
                    .collect()
            })
        })
        .collect();
    let vrank = |j: usize| value_axes.get(j).map_or(0, Vec::len);
    let out_rank = |o: usize| {
        op.outputs
            .get(o)
            .and_then(|&t| ty(t))
            .map_or(0, |t| t.axes.len())
    };
    // Build in value-axis terms, then translate.
    let mut map: Vec<Vec<Vec<(usize, usize)>>> = (0..op.outputs.len())
        .map(|o| vec![Vec::new(); out_rank(o)])
        .collect();
    let mut put = |o: usize, k: usize, j: usize, v: usize| {
        if let Some(slot) = map.get_mut(o).and_then(|m| m.get_mut(k)) {
            if let Some(&logical) = value_axes.get(j).and_then(|va| va.get(v)) {
                slot.push((j, logical));
            }
        }
    };
    let in_shape = |j: usize| -> Vec<u64> {
        op.inputs
            .get(j)
            .and_then(|&t| ty(t))
            .map_or_else(Vec::new, |t| t.value_shape())
    };
    let out_shape = || -> Vec<u64> {
        op.outputs
            .first()
            .and_then(|&t| ty(t))
            .map_or_else(Vec::new, |t| t.value_shape())
    };
    let vrank_out = |o: usize| {
        op.outputs
            .get(o)
            .and_then(|&t| ty(t))
            .map_or(0, |t| t.value_shape().len())
    };
    let in_logical_rank = op
        .inputs
        .first()
        .and_then(|&t| ty(t))
        .map_or(0, |t| t.axes.len());
    match op.kind {
        // A set that keeps its input's reduction axes (partial to partial) maps every logical
        // axis, reduction axes included.
        OpKind::Set if out_rank(0) == in_logical_rank && vrank(0) < in_logical_rank => {
            for (k, slot) in map[0].iter_mut().enumerate() {
                slot.push((0, k));
            }
        }
        // `add`/`sub`/`mul` keeping partial sums: an input with the output's logical axes maps
        // every axis (reduction axes included), the other one its value axes.
        OpKind::Add | OpKind::Sub | OpKind::Mul if vrank_out(0) < out_rank(0) => {
            let out_value: Vec<usize> = op
                .outputs
                .first()
                .and_then(|&t| ty(t))
                .map(|t| {
                    t.axes
                        .iter()
                        .enumerate()
                        .filter(|(_, a)| !a.reduction)
                        .map(|(i, _)| i)
                        .collect()
                })
                .unwrap_or_default();
            let out_axes = op
                .outputs
                .first()
                .and_then(|&t| ty(t))
                .map(|t| t.axes.clone());
            for (j, &t) in op.inputs.iter().enumerate() {
                let same = ty(t).map(|x| Some(&x.axes) == out_axes.as_ref()) == Some(true);
                for (k, slot) in map[0].iter_mut().enumerate() {
                    if same {
                        slot.push((j, k));
                    } else if let Some(v) = out_value.iter().position(|&p| p == k) {
                        if let Some(&logical) = value_axes.get(j).and_then(|va| va.get(v)) {
                            slot.push((j, logical));
                        }
                    }
                }
            }
        }
        OpKind::Set
        | OpKind::Gelu
        | OpKind::Silu
        | OpKind::Cast
        | OpKind::Sum { .. }
        | OpKind::Max { .. }
        | OpKind::Min { .. }
        | OpKind::Avg { .. }
        | OpKind::Softmax { .. }
        | OpKind::Add
        | OpKind::Sub
        | OpKind::Mul => {
            for k in 0..out_rank(0) {
                for j in 0..op.inputs.len() {
                    put(0, k, j, k);
                }
            }
        }
        OpKind::RmsNorm { axis, .. } => {
            for k in 0..out_rank(0) {
                put(0, k, 0, k);
            }
            put(0, axis, 1, 0);
        }
        OpKind::Permute { ref perm } => {
            for (k, &p) in perm.iter().enumerate() {
                put(0, k, 0, p);
            }
        }
        OpKind::Squeeze { axis } | OpKind::Select { axis, .. } => {
            for k in 0..out_rank(0) {
                put(0, k, 0, if k < axis { k } else { k + 1 });
            }
        }
        OpKind::Unsqueeze { axis } => {
            for k in 0..out_rank(0) {
                if k != axis {
                    put(0, k, 0, if k < axis { k } else { k - 1 });
                }
            }
        }
        OpKind::Expand => {
            let (is, os) = (in_shape(0), out_shape());
            let off = os.len().saturating_sub(is.len());
            for (v, &e) in is.iter().enumerate() {
                if os.get(v + off) == Some(&e) {
                    put(0, v + off, 0, v);
                }
            }
        }
        OpKind::Slice { axis, start, end } => {
            let full = start == 0 && in_shape(0).get(axis) == Some(&end);
            for k in 0..out_rank(0) {
                if k != axis || full {
                    put(0, k, 0, k);
                }
            }
        }
        OpKind::Cat { axis, .. } => {
            for k in (0..out_rank(0)).filter(|&k| k != axis) {
                for j in 0..op.inputs.len() {
                    put(0, k, j, k);
                }
            }
        }
        OpKind::Reshape | OpKind::View => {
            let sources = view_sources(&in_shape(0), &out_shape());
            for (k, src) in sources.into_iter().enumerate() {
                if let Some(v) = src {
                    put(0, k, 0, v);
                }
            }
        }
        OpKind::Matmul => {
            // Batch axes broadcast (aligned from the last batch axis); an operand's batch axis
            // of extent 1 under a larger output extent maps to nothing (it is repeated).
            let (sa, sb, so) = (in_shape(0), in_shape(1), out_shape());
            if sa.len() >= 2 && sb.len() >= 2 && so.len() >= 2 {
                let nb = so.len() - 2;
                for (j, s) in [(0usize, &sa), (1, &sb)] {
                    if j == 1 && s.len() == 2 {
                        continue;
                    }
                    let nbj = s.len() - 2;
                    for v in 0..nbj {
                        let k = v + nb - nbj.min(nb);
                        if so.get(k) == s.get(v) {
                            put(0, k, j, v);
                        }
                    }
                }
                put(0, nb, 0, sa.len() - 2); // M
                put(0, nb + 1, 1, sb.len() - 1); // N
                put(0, nb + 2, 0, sa.len() - 1); // rK
                put(0, nb + 2, 1, sb.len() - 2);
            }
        }
        OpKind::Linear => {
            let ra = vrank(0);
            let rb = vrank(1);
            if ra >= 2 && rb >= 2 {
                let nb = ra - 2;
                for k in 0..nb {
                    put(0, k, 0, k);
                }
                put(0, nb, 0, nb); // M
                put(0, nb + 1, 1, 0); // N
                put(0, nb + 2, 0, nb + 1); // rK
                put(0, nb + 2, 1, 1);
            }
        }
        OpKind::MoeDispatch { .. } => {
            // x[B.., T, H], topk_idx[B.., T, K] -> expert_x[B.., E, C, H], counts[B.., E],
            // routing[B.., E, C, 2].
            let nb = vrank(0).saturating_sub(2);
            for o in 0..3 {
                for k in 0..nb {
                    put(o, k, 0, k);
                    put(o, k, 1, k);
                }
            }
            put(0, nb + 2, 0, nb + 1); // H
        }
        OpKind::GroupedMatmul => {
            // expert_x[B.., E, C, H], counts[B.., E], w[E, H, F] -> [B.., E, C, F, rH].
            let nb = vrank(0).saturating_sub(3);
            for k in 0..nb {
                put(0, k, 0, k);
                put(0, k, 1, k);
            }
            put(0, nb, 0, nb); // E
            put(0, nb, 1, nb);
            put(0, nb, 2, 0);
            put(0, nb + 1, 0, nb + 1); // C
            put(0, nb + 2, 2, 2); // F
            put(0, nb + 3, 0, nb + 2); // rH
            put(0, nb + 3, 2, 1);
        }
        OpKind::MoeCombine => {
            // expert_y[B.., E, C, F], counts[B.., E], routing[B.., E, C, 2],
            // topk_weights[B.., T, K] -> out[B.., T, F].
            let nb = vrank(0).saturating_sub(3);
            for k in 0..nb {
                for j in 0..4 {
                    put(0, k, j, k);
                }
            }
            put(0, nb, 3, nb); // T
            put(0, nb + 1, 0, nb + 2); // F
        }
        OpKind::Custom(_) => {
            // Inputs align with the outputs from the last axis (see `CustomOp`).
            for o in 0..op.outputs.len() {
                let r = out_rank(o);
                for j in 0..op.inputs.len() {
                    let offset = r.saturating_sub(vrank(j));
                    for k in offset..r {
                        put(o, k, j, k - offset);
                    }
                }
            }
        }
    }
    map
}

/// Equivalence classes of `(tensor, logical axis)` pairs connected by op axis maps: two
/// tensors' axes in one class are "the same logical axis" for loop fusion.
#[derive(Clone, Debug)]
pub struct AxisClasses {
    offsets: Vec<usize>,
    parent: Vec<usize>,
}

impl AxisClasses {
    /// Builds the classes of every tensor axis of `program`.
    pub fn build(program: &Program) -> AxisClasses {
        let mut offsets = Vec::with_capacity(program.tensors.len());
        let mut n = 0;
        for decl in program.tensors.values() {
            offsets.push(n);
            n += decl.ty.axes.len();
        }
        let mut classes = AxisClasses {
            offsets,
            parent: (0..n).collect(),
        };
        for op in &program.ops {
            let map = op_axis_map(program, op);
            for (o, axes) in map.iter().enumerate() {
                let Some(&out) = op.outputs.get(o) else {
                    continue;
                };
                for (k, sources) in axes.iter().enumerate() {
                    for &(j, a) in sources {
                        if let Some(&input) = op.inputs.get(j) {
                            classes.union((out, k), (input, a));
                        }
                    }
                }
            }
        }
        classes
    }

    fn slot(&self, (t, axis): (TensorId, usize)) -> Option<usize> {
        use meshflow_ir::EntityRef;
        let base = *self.offsets.get(t.index())?;
        let slot = base + axis;
        (slot < self.parent.len()).then_some(slot)
    }

    fn find(&self, mut x: usize) -> usize {
        while self.parent[x] != x {
            x = self.parent[x];
        }
        x
    }

    fn union(&mut self, a: (TensorId, usize), b: (TensorId, usize)) {
        if let (Some(a), Some(b)) = (self.slot(a), self.slot(b)) {
            let (ra, rb) = (self.find(a), self.find(b));
            if ra != rb {
                let (lo, hi) = (ra.min(rb), ra.max(rb));
                self.parent[hi] = lo;
            }
        }
    }

    /// The class of logical axis `axis` of tensor `t` (`None` for an unknown axis).
    pub fn class(&self, t: TensorId, axis: usize) -> Option<usize> {
        self.slot((t, axis)).map(|s| self.find(s))
    }
}
