//! Loop nests: stream keys, grouping of consecutive ops into one stream loop, and the chunk
//! views inside a loop.

use std::collections::HashMap;

use meshflow_ir::host::{Expr, HostTensorId, Inst, InstKind, LoopVar};
use meshflow_ir::{MeshId, OpKind, ParallelType, TensorId};

use super::Lowering;
use crate::error::PassError;

/// What makes two ops share a stream loop: the same logical axis (class), chunk count and
/// swizzle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StreamKey {
    pub(crate) class: usize,
    pub(crate) chunks: u64,
    pub(crate) swizzle: Option<(MeshId, ParallelType)>,
}

/// A run of consecutive ops, in a stream loop when `key` is set.
pub(crate) struct Group {
    pub(crate) key: Option<StreamKey>,
    pub(crate) ops: Vec<usize>,
}

/// The loop being emitted.
pub(crate) struct LoopCtx {
    pub(crate) var: LoopVar,
    pub(crate) chunks: u64,
    /// The chunk index: `i`, or `(i + my(m, pt)) % chunks` when swizzled.
    pub(crate) index: Expr,
    views: HashMap<(HostTensorId, usize), HostTensorId>,
}

impl LoopCtx {
    /// A context cutting `chunks` chunks, at chunk `index` (an expression of `var` and
    /// `my(..)`, or of `my(..)` alone for a peeled step).
    pub(crate) fn at(var: LoopVar, chunks: u64, index: Expr) -> LoopCtx {
        LoopCtx {
            var,
            chunks,
            index,
            views: HashMap::new(),
        }
    }

    /// Makes `view` the chunk of `t` along `axis` in this context (instead of a new view).
    pub(crate) fn seed(&mut self, t: HostTensorId, axis: usize, view: HostTensorId) {
        self.views.insert((t, axis), view);
    }
}

impl Lowering<'_> {
    /// The stream key of the tensor `t` (from its Stream split).
    pub(crate) fn key_of(&self, t: TensorId) -> Option<StreamKey> {
        let sh = self.sharding(t);
        let s = sh.stream()?;
        Some(StreamKey {
            class: self.classes.class(t, s.axis)?,
            chunks: s.chunks,
            swizzle: s.swizzle.map(|pt| (sh.mesh, pt)),
        })
    }

    /// Groups the ops into loops.
    pub(crate) fn group_steps(&self) -> Result<Vec<Group>, PassError> {
        let mut groups: Vec<Group> = Vec::new();
        for (i, op) in self.program.ops.iter().enumerate() {
            let key = match op.kind {
                OpKind::MoeDispatch { .. } | OpKind::MoeCombine => {
                    let streamed = op
                        .inputs
                        .iter()
                        .chain(&op.outputs)
                        .find(|&&t| self.sharding(t).stream().is_some());
                    if let Some(&t) = streamed {
                        return Err(PassError::tensor(
                            self.name(t),
                            format!("`{}` does not support Stream splits", op.kind.name()),
                        ));
                    }
                    None
                }
                _ => op
                    .outputs
                    .first()
                    .and_then(|&o| self.key_of(o))
                    .or_else(|| self.reduce_key(i)),
            };
            let joins = groups.last().is_some_and(|g| {
                key.is_some()
                    && g.key == key
                    && op.inputs.iter().enumerate().all(|(j, &t)| {
                        let produced_here = g
                            .ops
                            .iter()
                            .any(|&k| self.program.ops[k].outputs.contains(&t));
                        !produced_here || self.reads_by_chunk(i, j) || self.reduce_key(i).is_some()
                    })
            });
            match groups.last_mut() {
                Some(g) if joins => g.ops.push(i),
                _ => groups.push(Group { key, ops: vec![i] }),
            }
        }
        Ok(groups)
    }

    /// True when op `i` reads its input `j` one chunk per iteration, along that input's own
    /// Stream split (so an earlier op of the same loop has produced that chunk).
    fn reads_by_chunk(&self, i: usize, j: usize) -> bool {
        let op = &self.program.ops[i];
        let (Some(&input), Some(&out)) = (op.inputs.get(j), op.outputs.first()) else {
            return false;
        };
        let (Some(is), Some(os)) = (self.sharding(input).stream(), self.sharding(out).stream())
        else {
            return false;
        };
        if is.chunks != os.chunks || is.swizzle != os.swizzle {
            return false;
        }
        if op.kind == OpKind::Set {
            return self.sharding(input).value_index(is.axis)
                == self.sharding(out).value_index(os.axis);
        }
        crate::analysis::op_axis_map(self.program, op)
            .first()
            .and_then(|m| m.get(os.axis))
            .is_some_and(|src| src.contains(&(j, is.axis)))
    }

    /// Emits one group into `block`.
    pub(crate) fn emit_group(&mut self, g: &Group, block: &mut Vec<Inst>) -> Result<(), PassError> {
        let Some(key) = &g.key else {
            for &i in &g.ops {
                self.emit_op(i, None, block)?;
            }
            return Ok(());
        };
        if self.emit_gather_ring(g, key, block)? || self.emit_reduce_ring(g, key, block)? {
            return Ok(());
        }
        let var = self.fresh_loop();
        self.loop_trips.insert(var, key.chunks);
        if self.planned_prefetch(g) {
            self.prefetch_loops.insert(var);
        }
        let index = match key.swizzle {
            None => Expr::var(var),
            Some((mesh, pt)) => Expr::var(var)
                .add(Expr::my(mesh, pt))
                .rem(Expr::c(key.chunks as i64)),
        };
        let mut lp = LoopCtx {
            var,
            chunks: key.chunks,
            index,
            views: HashMap::new(),
        };
        let mut body = Vec::new();
        for &i in &g.ops {
            self.emit_op(i, Some(&mut lp), &mut body)?;
        }
        block.push(Inst::new(InstKind::ForLoop {
            index: var,
            start: Expr::c(0),
            stop: Expr::c(key.chunks as i64),
            body,
        }));
        Ok(())
    }

    pub(crate) fn emit_op(
        &mut self,
        i: usize,
        lp: Option<&mut LoopCtx>,
        block: &mut Vec<Inst>,
    ) -> Result<(), PassError> {
        match self.program.ops[i].kind {
            OpKind::Set => self.emit_set(i, lp, block),
            OpKind::MoeDispatch { .. } | OpKind::MoeCombine => self.emit_moe(i, block),
            _ => self.emit_compute(i, lp, block),
        }
    }

    /// The view of chunk `lp.index` of `t` along host axis `axis` (declared and pushed on
    /// first use in the loop).
    pub(crate) fn chunk_view(
        &mut self,
        lp: &mut LoopCtx,
        block: &mut Vec<Inst>,
        t: HostTensorId,
        axis: usize,
        what: &str,
    ) -> Result<HostTensorId, PassError> {
        if let Some(&v) = lp.views.get(&(t, axis)) {
            return Ok(v);
        }
        let base = &self.host.tensors[t];
        let extent = base.shape.get(axis).copied().ok_or_else(|| {
            PassError::tensor(
                &base.name,
                format!("{what}: it has no axis {axis} to cut into stream chunks"),
            )
        })?;
        if !extent.is_multiple_of(lp.chunks) {
            return Err(PassError::tensor(
                &base.name,
                format!(
                    "{what}: its local extent {extent} along axis {axis} is not divisible by the {} stream chunks",
                    lp.chunks
                ),
            ));
        }
        let mut shape = base.shape.clone();
        shape[axis] = extent / lp.chunks;
        let v = self.derived(t, "chunk", shape);
        self.views.insert(v, (t, axis));
        block.push(Inst::new(InstKind::ShardByStream {
            out: v,
            input: t,
            axis,
            chunks: lp.chunks,
            index: lp.index.clone(),
        }));
        lp.views.insert((t, axis), v);
        Ok(v)
    }

    /// The part of level-1 tensor `l1` a compute op reads or writes: inside a loop, its chunk
    /// along value axis `axis` (its own padded stream chunk when it has that Stream split,
    /// else the chunk rule over its valid extent), narrowed to the valid extents of its
    /// uneven axes.
    pub(crate) fn operand(
        &mut self,
        lp: Option<&mut LoopCtx>,
        block: &mut Vec<Inst>,
        l1: TensorId,
        axis: Option<usize>,
        what: &str,
    ) -> Result<HostTensorId, PassError> {
        let t = self.host_of(l1);
        let (Some(lp), Some(axis)) = (lp, axis) else {
            return self.valid_view(block, l1, t, None, None);
        };
        let sh = self.sharding(l1);
        let own = sh
            .stream()
            .is_some_and(|s| sh.value_index(s.axis) == Some(axis) && s.chunks == lp.chunks);
        let index = lp.index.clone();
        if own {
            let v = self.chunk_view(lp, block, t, axis, what)?;
            return self.valid_view(block, l1, v, Some((axis, &index)), None);
        }
        let whole = self.valid_extent(l1, axis, None)?;
        let host_extent = self.host.tensors[t].shape.get(axis).copied().unwrap_or(0);
        if whole.is_none() && host_extent.is_multiple_of(lp.chunks) {
            let v = self.chunk_view(lp, block, t, axis, what)?;
            return self.valid_view(block, l1, v, None, None);
        }
        // The chunk rule over the valid extent: chunk `i` of `E` is `[min(i c, E), ...)`.
        let e = whole.unwrap_or(Expr::c(host_extent as i64));
        let c = super::uneven::ceil_div(&e, lp.chunks);
        let start = super::uneven::piece_start(&e, &c, &index);
        let len = super::uneven::piece(&e, &c, &index);
        let v = self.narrow(block, t, axis, start, len, "chunk");
        self.valid_view(block, l1, v, None, Some(axis))
    }

    /// `t` itself, or its chunk along the value axis `axis` of level-1 tensor `l1` when in a
    /// loop.
    pub(crate) fn maybe_chunk(
        &mut self,
        lp: Option<&mut LoopCtx>,
        block: &mut Vec<Inst>,
        l1: TensorId,
        axis: Option<usize>,
        what: &str,
    ) -> Result<HostTensorId, PassError> {
        let t = self.host_of(l1);
        match (lp, axis) {
            (Some(lp), Some(axis)) => self.chunk_view(lp, block, t, axis, what),
            _ => Ok(t),
        }
    }
}
