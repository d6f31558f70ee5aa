//! The operands of host instructions as data: every tensor an instruction names with how it
//! uses it ([`TensorUse`]), its scalar expressions, its team and label.
//!
//! Code that needs an instruction's buffers asks here instead of destructuring every variant;
//! each accessor matches every variant without a wildcard arm, so a new instruction must say
//! what it reads and writes before anything builds.

use super::{CommId, Expr, HostTensorId, InstKind, StreamRef, Team};

/// How an instruction uses a tensor it names.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum TensorUse {
    /// Its contents are read.
    Read,
    /// Its contents are written.
    Written,
    /// Its contents are read, then written (the output of an accumulating compute op,
    /// [`ComputeOp::reads_output`](super::ComputeOp::reads_output)).
    Updated,
    /// Its buffer is created (`allocate`).
    Allocated,
    /// Its buffer is released (`deallocate`).
    Deallocated,
    /// It becomes a view (`shard_by_stream`, `narrow`).
    View,
    /// A view of it is made.
    Viewed,
}

/// Calls `$f(use, tensor)` on every tensor handle of `$kind` (not those of a loop body), in a
/// fixed order: reads before writes (and updates), each in declaration order; every handle
/// once. The same body serves `&` and
/// `&mut` instructions (binding modes follow the reference).
macro_rules! each_tensor {
    ($kind:expr, $f:expr) => {{
        let mut f = $f;
        match $kind {
            InstKind::Allocate { tensor } => f(TensorUse::Allocated, tensor),
            InstKind::Deallocate { tensor } => f(TensorUse::Deallocated, tensor),
            InstKind::ShardByStream { out, input, .. } | InstKind::Narrow { out, input, .. } => {
                f(TensorUse::View, out);
                f(TensorUse::Viewed, input);
            }
            InstKind::Communication { input, output, .. }
            | InstKind::CollectivePermute { input, output, .. } => {
                f(TensorUse::Read, input);
                f(TensorUse::Written, output);
            }
            InstKind::MoeDispatch {
                x,
                topk_idx,
                expert_x,
                expert_counts,
                routing,
                ..
            } => {
                f(TensorUse::Read, x);
                f(TensorUse::Read, topk_idx);
                f(TensorUse::Written, expert_x);
                f(TensorUse::Written, expert_counts);
                f(TensorUse::Written, routing);
            }
            InstKind::MoeCombine {
                expert_y,
                expert_counts,
                routing,
                topk_weights,
                out,
                ..
            } => {
                f(TensorUse::Read, expert_y);
                f(TensorUse::Read, expert_counts);
                f(TensorUse::Read, routing);
                f(TensorUse::Read, topk_weights);
                f(TensorUse::Written, out);
            }
            InstKind::Compute {
                op,
                inputs,
                outputs,
            } => {
                let out = if op.reads_output() {
                    TensorUse::Updated
                } else {
                    TensorUse::Written
                };
                for t in inputs {
                    f(TensorUse::Read, t);
                }
                for t in outputs {
                    f(out, t);
                }
            }
            InstKind::CallKernel {
                inputs, outputs, ..
            } => {
                for t in inputs {
                    f(TensorUse::Read, t);
                }
                for t in outputs {
                    f(TensorUse::Written, t);
                }
            }
            InstKind::ForLoop { .. }
            | InstKind::GetCurrentStream { .. }
            | InstKind::SetCurrentStream { .. }
            | InstKind::Synchronize { .. }
            | InstKind::Wait { .. }
            | InstKind::StartCoalescing
            | InstKind::EndCoalescing { .. } => {}
        }
    }};
}

/// Calls `$f(expr)` on every scalar expression of `$kind` (not those of a loop body), in
/// declaration order, for `&` and `&mut` instructions alike.
macro_rules! each_expr {
    ($kind:expr, $f:expr) => {{
        let mut f = $f;
        match $kind {
            InstKind::ForLoop { start, stop, .. } => {
                f(start);
                f(stop);
            }
            InstKind::SetCurrentStream { stream } | InstKind::Synchronize { stream } => {
                match stream {
                    StreamRef::Worker(e) => f(e),
                    StreamRef::Var(_) => {}
                }
            }
            InstKind::ShardByStream { index, .. } => f(index),
            InstKind::Narrow { start, length, .. } => {
                f(start);
                f(length);
            }
            InstKind::Communication { root, .. } => {
                if let Some(r) = root {
                    f(r);
                }
            }
            InstKind::CollectivePermute {
                send_peer,
                recv_peer,
                ..
            } => {
                f(send_peer);
                f(recv_peer);
            }
            InstKind::CallKernel { args, .. } => {
                for a in args {
                    f(a);
                }
            }
            InstKind::Allocate { .. }
            | InstKind::Deallocate { .. }
            | InstKind::GetCurrentStream { .. }
            | InstKind::Wait { .. }
            | InstKind::StartCoalescing
            | InstKind::EndCoalescing { .. }
            | InstKind::MoeDispatch { .. }
            | InstKind::MoeCombine { .. }
            | InstKind::Compute { .. } => {}
        }
    }};
}

impl InstKind {
    /// Every tensor the instruction names with how it uses it (not those of a loop body):
    /// reads before writes, each in declaration order.
    pub fn operands(&self) -> Vec<(TensorUse, HostTensorId)> {
        let mut out = Vec::new();
        each_tensor!(self, |u, t: &HostTensorId| out.push((u, *t)));
        out
    }

    /// Calls `f` on every tensor handle of the instruction (not those of a loop body), with
    /// how it uses it, so that it can rewrite the handle.
    pub fn for_each_operand_mut(&mut self, f: impl FnMut(TensorUse, &mut HostTensorId)) {
        each_tensor!(self, f)
    }

    fn with_use(&self, wanted: &[TensorUse]) -> Vec<HostTensorId> {
        let mut out = Vec::new();
        each_tensor!(self, |u, t: &HostTensorId| if wanted.contains(&u) {
            out.push(*t)
        });
        out
    }

    /// The tensors whose contents the instruction reads (also those it updates).
    pub fn reads(&self) -> Vec<HostTensorId> {
        self.with_use(&[TensorUse::Read, TensorUse::Updated])
    }

    /// The tensors whose contents the instruction writes (also those it updates).
    pub fn writes(&self) -> Vec<HostTensorId> {
        self.with_use(&[TensorUse::Written, TensorUse::Updated])
    }

    /// Every tensor the instruction names (reads, writes, allocations and views).
    pub fn tensors(&self) -> Vec<HostTensorId> {
        self.operands().into_iter().map(|(_, t)| t).collect()
    }

    /// For `shard_by_stream` and `narrow`: `(the view, the tensor viewed)`.
    pub fn view(&self) -> Option<(HostTensorId, HostTensorId)> {
        let (mut view, mut viewed) = (None, None);
        each_tensor!(self, |u, t: &HostTensorId| {
            if u == TensorUse::View {
                view = Some(*t);
            } else if u == TensorUse::Viewed {
                viewed = Some(*t);
            }
        });
        view.zip(viewed)
    }

    /// Every scalar expression the instruction holds (not those of a loop body).
    pub fn exprs(&self) -> Vec<&Expr> {
        let mut out = Vec::new();
        each_expr!(self, |e| out.push(e));
        out
    }

    /// Every scalar expression the instruction holds (not those of a loop body), mutably.
    pub fn exprs_mut(&mut self) -> Vec<&mut Expr> {
        let mut out = Vec::new();
        each_expr!(self, |e| out.push(e));
        out
    }

    /// The communication label this instruction defines, if any.
    pub fn comm_id(&self) -> Option<CommId> {
        match self {
            InstKind::Communication { id, .. }
            | InstKind::CollectivePermute { id, .. }
            | InstKind::EndCoalescing { id }
            | InstKind::MoeDispatch { id, .. }
            | InstKind::MoeCombine { id, .. } => Some(*id),
            InstKind::Allocate { .. }
            | InstKind::Deallocate { .. }
            | InstKind::ForLoop { .. }
            | InstKind::GetCurrentStream { .. }
            | InstKind::SetCurrentStream { .. }
            | InstKind::Synchronize { .. }
            | InstKind::ShardByStream { .. }
            | InstKind::Narrow { .. }
            | InstKind::Wait { .. }
            | InstKind::StartCoalescing
            | InstKind::Compute { .. }
            | InstKind::CallKernel { .. } => None,
        }
    }

    /// True for instructions that move data between devices.
    pub fn is_communication(&self) -> bool {
        self.team().is_some()
    }

    /// The team of a communication.
    pub fn team(&self) -> Option<&Team> {
        match self {
            InstKind::Communication { team, .. }
            | InstKind::CollectivePermute { team, .. }
            | InstKind::MoeDispatch { team, .. }
            | InstKind::MoeCombine { team, .. } => Some(team),
            InstKind::Allocate { .. }
            | InstKind::Deallocate { .. }
            | InstKind::ForLoop { .. }
            | InstKind::GetCurrentStream { .. }
            | InstKind::SetCurrentStream { .. }
            | InstKind::Synchronize { .. }
            | InstKind::ShardByStream { .. }
            | InstKind::Narrow { .. }
            | InstKind::Wait { .. }
            | InstKind::StartCoalescing
            | InstKind::EndCoalescing { .. }
            | InstKind::Compute { .. }
            | InstKind::CallKernel { .. } => None,
        }
    }
}
