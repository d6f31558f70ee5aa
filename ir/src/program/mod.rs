//! Level 1: the sharded tensor program.
//!
//! A [`Program`] declares device meshes, tensors (each with a logical type, a mesh and an
//! optional schedule) and a list of ops in execution order. Its meaning is the **unsharded**
//! computation on logical tensors; the schedules only say where the data lives and in what
//! order chunks are visited. See the crate docs for the full semantics.

mod attrs;
mod builder;
mod builder_ops;
mod infer;
mod infer_ops;
pub mod schedule;
pub mod view_groups;

use std::fmt;

pub use attrs::Epsilon;
pub use builder::{BuildError, ProgramBuilder, TensorRef};
pub use infer::{infer_output_types, InferError};
pub use schedule::{
    AxisLayout, DeviceSplit, IdDef, IterDomain, Layout, LayoutError, Leaf, LoopDomain,
    ScheduleError, StreamSplit, Transform,
};

use crate::dtype::DType;
use crate::entity::Arena;
use crate::mesh::DeviceMesh;
use crate::moe::MoeWire;
use crate::span::SourceLoc;

crate::entity_ref!(
    /// Handle of a mesh declared in a program.
    MeshId,
    "m"
);
crate::entity_ref!(
    /// Handle of a level-1 tensor.
    TensorId,
    "t"
);

/// A named device mesh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshDecl {
    /// Name, unique in the program.
    pub name: String,
    /// The mesh.
    pub mesh: DeviceMesh,
    /// Where it was declared.
    pub loc: SourceLoc,
}

/// One logical axis of a tensor type.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Axis {
    /// Number of elements along the axis.
    pub extent: u64,
    /// True for an axis that the producing op reduces over (printed with an `r` prefix). A
    /// consumer sees only the non-reduction axes.
    pub reduction: bool,
}

impl Axis {
    /// An iteration (non-reduction) axis.
    pub fn iter(extent: u64) -> Axis {
        Axis {
            extent,
            reduction: false,
        }
    }

    /// A reduction axis.
    pub fn reduce(extent: u64) -> Axis {
        Axis {
            extent,
            reduction: true,
        }
    }
}

/// The logical type of a tensor: element type and axes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Logical axes, outermost first.
    pub axes: Vec<Axis>,
}

impl TensorType {
    /// A type with only iteration axes.
    pub fn new(dtype: DType, shape: &[u64]) -> TensorType {
        TensorType {
            dtype,
            axes: shape.iter().map(|&e| Axis::iter(e)).collect(),
        }
    }

    /// The shape a consumer sees: the extents of the non-reduction axes.
    pub fn value_shape(&self) -> Vec<u64> {
        self.axes
            .iter()
            .filter(|a| !a.reduction)
            .map(|a| a.extent)
            .collect()
    }

    /// The number of elements a consumer sees.
    pub fn value_numel(&self) -> u64 {
        self.value_shape().iter().product()
    }

    /// Logical axes as `(extent, is_reduction)`, the input of [`LoopDomain::replay`].
    pub fn logical(&self) -> Vec<(u64, bool)> {
        self.axes.iter().map(|a| (a.extent, a.reduction)).collect()
    }
}

impl fmt::Display for TensorType {
    /// `bf16[64, 48, r32]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, a) in self.axes.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if a.reduction {
                f.write_str("r")?;
            }
            write!(f, "{}", a.extent)?;
        }
        f.write_str("]")
    }
}

/// A level-1 tensor declaration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    /// Name, unique in the program.
    pub name: String,
    /// Logical type.
    pub ty: TensorType,
    /// The mesh the tensor is placed on.
    pub mesh: MeshId,
    /// The schedule. `None` means "not annotated": sharding propagation may fill it in.
    /// `Some(vec![])` is an explicit annotation: replicated on the mesh, never changed by
    /// propagation.
    pub schedule: Option<Vec<Transform>>,
    /// True for a program input.
    pub is_input: bool,
    /// Where it was declared.
    pub loc: SourceLoc,
}

impl TensorDecl {
    /// The schedule, or the empty schedule when the tensor is not annotated.
    pub fn transforms(&self) -> &[Transform] {
        self.schedule.as_deref().unwrap_or(&[])
    }

    /// Replays the schedule over the logical axes.
    pub fn loop_domain(&self) -> Result<LoopDomain, ScheduleError> {
        LoopDomain::replay(&self.ty.logical(), self.transforms())
    }
}

/// What an op computes. Shapes below are logical; `r` marks reduction axes. Leading `B...`
/// axes are batch axes carried through unchanged.
///
/// Shape ops (`reshape`, `view`, `permute`, `expand`, `squeeze`, `unsqueeze`, `slice`,
/// `select`, `cat`) move elements without arithmetic; their shardings propagate through them
/// as described in the crate docs ("Shape ops and sharding"). The reductions `sum`, `max`,
/// `min` and `avg` keep the reduced axis as a reduction axis of their output: split over
/// devices, it holds partial results of that kind.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `out = in` (a copy; a resharding when the two schedules differ). The output may keep
    /// the input's reduction axes (a `set` between two partial placements); otherwise it has
    /// the input's value axes and the set reduces the partial results.
    Set,
    /// `a[A.., M, K] @ b[B.., K, N] -> [C.., M, N, rK]` with torch.matmul batch broadcasting:
    /// `C` is the broadcast of `A` and `B` (aligned from the last batch axis, each pair equal
    /// or one of them 1). A 2-D `b` is shared by every batch of `a`.
    Matmul,
    /// `x[B.., M, K] @ w[N, K]^T -> [B.., M, N, rK]`.
    Linear,
    /// Elementwise `a + b` (same shapes and dtypes).
    Add,
    /// Elementwise `a - b`.
    Sub,
    /// Elementwise `a * b`.
    Mul,
    /// Elementwise GELU (tanh approximation).
    Gelu,
    /// Elementwise SiLU, `x * sigmoid(x)`.
    Silu,
    /// Sum over value axis `axis`: the output keeps the axis, marked as a reduction axis.
    Sum {
        /// The value axis (index among the input's non-reduction axes).
        axis: usize,
    },
    /// Maximum over value axis `axis` (float inputs); the output keeps it as a reduction axis.
    Max {
        /// The value axis.
        axis: usize,
    },
    /// Minimum over value axis `axis` (float inputs); the output keeps it as a reduction axis.
    Min {
        /// The value axis.
        axis: usize,
    },
    /// Mean over value axis `axis` (float inputs); the output keeps it as a reduction axis.
    Avg {
        /// The value axis.
        axis: usize,
    },
    /// Convert to the output's dtype.
    Cast,
    /// The same elements in row-major order under the declared output shape (equal element
    /// counts). Where an input split cannot be expressed on the output, the input is
    /// replicated along that mesh axis first.
    Reshape,
    /// [`OpKind::Reshape`] that must stay local: where an input split cannot be expressed on
    /// the output, lowering refuses instead of communicating (torch `view`).
    View,
    /// Output axis `k` is input axis `perm[k]` (torch `permute`; `transpose` is a permute
    /// of two axes).
    Permute {
        /// A permutation of the input's value axes.
        perm: Vec<usize>,
    },
    /// Broadcast to the declared output shape: the input is aligned with the output from the
    /// last axis, and every input axis of extent 1 (or missing) is repeated (torch `expand`).
    Expand,
    /// Removes value axis `axis`, which must have extent 1.
    Squeeze {
        /// The removed axis.
        axis: usize,
    },
    /// Inserts an axis of extent 1 before value axis `axis` (`axis == rank` appends).
    Unsqueeze {
        /// The position of the new axis.
        axis: usize,
    },
    /// Elements `start..end` of value axis `axis`.
    Slice {
        /// The sliced axis.
        axis: usize,
        /// First index kept.
        start: u64,
        /// One past the last index kept.
        end: u64,
    },
    /// Element `index` of value axis `axis`; the axis is removed.
    Select {
        /// The selected axis.
        axis: usize,
        /// The index.
        index: u64,
    },
    /// The inputs concatenated along value axis `axis` (every other axis equal).
    Cat {
        /// The concatenated axis.
        axis: usize,
        /// The number of inputs (at least 1).
        inputs: usize,
    },
    /// `exp(x - max) / sum(exp(x - max))` along value axis `axis` (float inputs).
    Softmax {
        /// The normalized axis.
        axis: usize,
    },
    /// `x / sqrt(mean(x^2) + eps) * w` along value axis `axis`, with `w` of shape
    /// `[extent of axis]` (float inputs).
    RmsNorm {
        /// The normalized axis.
        axis: usize,
        /// Added to the mean square.
        eps: Epsilon,
    },
    /// MoE dispatch: `x[B.., T, H], topk_idx[B.., T, K] -> expert_x[B.., E, C, H],
    /// expert_counts[B.., E] (i32), routing[B.., E, C, 2] (i32: source token, top-k slot)`.
    /// Rows of expert `e` are the `(t, k)` with `topk_idx[t, k] == e` (order unspecified; the
    /// reference uses ascending `(t, k)`); rows past the count are padding. Each token travels
    /// once per member hosting one of its experts, encoded as `wire` (see [`crate::moe`]).
    MoeDispatch {
        /// How travelling tokens are encoded (`expert_x` keeps the dtype of `x`).
        wire: MoeWire,
    },
    /// `expert_x[B.., E, C, H], expert_counts[B.., E], w[E, H, F] -> [B.., E, C, F, rH]`: one
    /// GEMM per expert over its valid rows; padding rows are zero.
    GroupedMatmul,
    /// `expert_y[B.., E, C, F], expert_counts[B.., E], routing[B.., E, C, 2],
    /// topk_weights[B.., T, K] -> out[B.., T, F]` with `out[t] = Σ_k w[t, k] · y(t, k)`: each
    /// member hosting some of the token's experts sums its share in `k` order (f32, rounded to
    /// the dtype), the token's member sums those partials in member order (f32, rounded once);
    /// see [`crate::moe`] for the exact order.
    MoeCombine,
    /// An embedder's own op, computed by the kernel it registers under [`CustomOp::kernel`]
    /// (see [`CustomOp`] for the contract).
    Custom(CustomOp),
}

/// An embedder's own level-1 op: `y = custom(x, b, kernel="bias_gelu", args=[1])`.
///
/// The embedder declares the output types (every output has the same value shape `S`, dtypes
/// may differ, no reduction axes) and each input's value shape is a **suffix** of `S`: inputs
/// are aligned with the outputs from the last axis, numpy-style, without size-1 expansion
/// (`x[M, N]` and a bias `b[N]` give `y[M, N]`). The op is **chunk-wise along every axis**:
/// for any aligned chunk of the outputs (rows, columns, any device or Stream split), the
/// kernel computes that chunk from the aligned chunks of the inputs alone. Sharding
/// propagation and resharding treat it like an elementwise op with these aligned axes, so a
/// device split of an output axis requires the same split of every input axis aligned with it.
/// An op that mixes elements along an axis (a softmax over rows, a reduction) is still
/// correct as long as that axis is never split; meshflow cannot check this.
///
/// Lowering turns it into `call_kernel(inputs -> outputs, kernel=KERNEL, args=[ARGS..,
/// SHAPE..])`: the op's `args`, then the local (per-device, per-chunk) extents of the first
/// output, outermost first, so a device kernel knows the sizes of the chunk it is given. On
/// the CPU backend the registered closure also serves as the op's reference (the level-1
/// interpreter calls it once on the full tensors, with the full output shape).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CustomOp {
    /// The name the kernel is registered under with the backend.
    pub kernel: String,
    /// Integer attributes, passed first among the kernel's scalar arguments.
    pub args: Vec<i64>,
    /// The number of inputs.
    pub inputs: usize,
    /// The number of outputs (at least 1).
    pub outputs: usize,
}

impl OpKind {
    /// The op's name in the text format.
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::Set => "set",
            OpKind::Matmul => "matmul",
            OpKind::Linear => "linear",
            OpKind::Add => "add",
            OpKind::Sub => "sub",
            OpKind::Mul => "mul",
            OpKind::Gelu => "gelu",
            OpKind::Silu => "silu",
            OpKind::Sum { .. } => "sum",
            OpKind::Max { .. } => "max",
            OpKind::Min { .. } => "min",
            OpKind::Avg { .. } => "avg",
            OpKind::Cast => "cast",
            OpKind::Reshape => "reshape",
            OpKind::View => "view",
            OpKind::Permute { .. } => "permute",
            OpKind::Expand => "expand",
            OpKind::Squeeze { .. } => "squeeze",
            OpKind::Unsqueeze { .. } => "unsqueeze",
            OpKind::Slice { .. } => "slice",
            OpKind::Select { .. } => "select",
            OpKind::Cat { .. } => "cat",
            OpKind::Softmax { .. } => "softmax",
            OpKind::RmsNorm { .. } => "rms_norm",
            OpKind::MoeDispatch { .. } => "moe_dispatch",
            OpKind::GroupedMatmul => "grouped_matmul",
            OpKind::MoeCombine => "moe_combine",
            OpKind::Custom(_) => "custom",
        }
    }

    /// The attributes as written after the inputs in the text format (`axis=1`,
    /// `kernel="k", args=[1]`, `wire=f8e4m3, scale=token`), empty for an op without
    /// attributes (and for `moe_dispatch` on its default native wire).
    pub fn attributes(&self) -> String {
        match self {
            OpKind::Sum { axis }
            | OpKind::Max { axis }
            | OpKind::Min { axis }
            | OpKind::Avg { axis }
            | OpKind::Softmax { axis }
            | OpKind::Squeeze { axis }
            | OpKind::Unsqueeze { axis }
            | OpKind::Cat { axis, .. } => format!("axis={axis}"),
            OpKind::Permute { perm } => {
                let perm: Vec<String> = perm.iter().map(usize::to_string).collect();
                format!("perm=[{}]", perm.join(", "))
            }
            OpKind::Slice { axis, start, end } => {
                format!("axis={axis}, start={start}, end={end}")
            }
            OpKind::Select { axis, index } => format!("axis={axis}, index={index}"),
            OpKind::RmsNorm { axis, eps } => format!("axis={axis}, eps={eps}"),
            OpKind::MoeDispatch { wire } => wire.to_string(),
            OpKind::Custom(c) => {
                let mut s = format!("kernel=\"{}\"", c.kernel.escape_default());
                if !c.args.is_empty() {
                    let args: Vec<String> = c.args.iter().map(i64::to_string).collect();
                    s.push_str(&format!(", args=[{}]", args.join(", ")));
                }
                s
            }
            _ => String::new(),
        }
    }

    /// `(inputs, outputs)` the op takes.
    pub fn arity(&self) -> (usize, usize) {
        match self {
            OpKind::Set
            | OpKind::Gelu
            | OpKind::Silu
            | OpKind::Sum { .. }
            | OpKind::Max { .. }
            | OpKind::Min { .. }
            | OpKind::Avg { .. }
            | OpKind::Cast
            | OpKind::Reshape
            | OpKind::View
            | OpKind::Permute { .. }
            | OpKind::Expand
            | OpKind::Squeeze { .. }
            | OpKind::Unsqueeze { .. }
            | OpKind::Slice { .. }
            | OpKind::Select { .. }
            | OpKind::Softmax { .. } => (1, 1),
            OpKind::Matmul
            | OpKind::Linear
            | OpKind::Add
            | OpKind::Sub
            | OpKind::Mul
            | OpKind::RmsNorm { .. } => (2, 1),
            OpKind::Cat { inputs, .. } => (*inputs, 1),
            OpKind::MoeDispatch { .. } => (2, 3),
            OpKind::GroupedMatmul => (3, 1),
            OpKind::MoeCombine => (4, 1),
            OpKind::Custom(c) => (c.inputs, c.outputs),
        }
    }

    /// True for the ops that reduce (their output has a reduction axis).
    pub fn is_reduction(&self) -> bool {
        matches!(
            self,
            OpKind::Matmul
                | OpKind::Linear
                | OpKind::Sum { .. }
                | OpKind::Max { .. }
                | OpKind::Min { .. }
                | OpKind::Avg { .. }
                | OpKind::GroupedMatmul
        )
    }

    /// True for the shape ops: they move elements without arithmetic.
    pub fn is_shape_op(&self) -> bool {
        matches!(
            self,
            OpKind::Reshape
                | OpKind::View
                | OpKind::Permute { .. }
                | OpKind::Expand
                | OpKind::Squeeze { .. }
                | OpKind::Unsqueeze { .. }
                | OpKind::Slice { .. }
                | OpKind::Select { .. }
                | OpKind::Cat { .. }
        )
    }
}

/// One op of a program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    /// What it computes.
    pub kind: OpKind,
    /// Input tensors.
    pub inputs: Vec<TensorId>,
    /// Output tensors (each defined by exactly this op).
    pub outputs: Vec<TensorId>,
    /// Where it was written.
    pub loc: SourceLoc,
}

/// A level-1 sharded tensor program.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Program {
    /// Name.
    pub name: String,
    /// Declared meshes.
    pub meshes: Arena<MeshId, MeshDecl>,
    /// Declared tensors, inputs and op results alike.
    pub tensors: Arena<TensorId, TensorDecl>,
    /// Ops in execution order.
    pub ops: Vec<Op>,
    /// Program outputs, in order.
    pub outputs: Vec<TensorId>,
}

impl Program {
    /// An empty program.
    pub fn new(name: impl Into<String>) -> Program {
        Program {
            name: name.into(),
            ..Program::default()
        }
    }

    /// Program inputs, in declaration order.
    pub fn inputs(&self) -> Vec<TensorId> {
        self.tensors.keys_where(|t| t.is_input).collect()
    }

    /// The tensor called `name`.
    pub fn tensor_by_name(&self, name: &str) -> Option<TensorId> {
        self.tensors.find_key(|t| t.name == name)
    }

    /// The mesh called `name`.
    pub fn mesh_by_name(&self, name: &str) -> Option<MeshId> {
        self.meshes.find_key(|m| m.name == name)
    }

    /// The index in [`Program::ops`] of the op defining `tensor`, if any.
    pub fn definition(&self, tensor: TensorId) -> Option<usize> {
        self.ops.iter().position(|op| op.outputs.contains(&tensor))
    }

    /// Indices of the ops that read `tensor`.
    pub fn uses(&self, tensor: TensorId) -> Vec<usize> {
        self.ops
            .iter()
            .enumerate()
            .filter(|(_, op)| op.inputs.contains(&tensor))
            .map(|(i, _)| i)
            .collect()
    }

    /// The number of devices a run needs: the largest device id of any mesh plus one.
    pub fn world_size(&self) -> usize {
        self.meshes
            .values()
            .map(|m| m.mesh.required_world_size())
            .max()
            .unwrap_or(0)
    }

    /// A name not yet used by any tensor, built from `base`.
    pub fn fresh_tensor_name(&self, base: &str) -> String {
        if self.tensor_by_name(base).is_none() {
            return base.to_string();
        }
        (1..)
            .map(|i| format!("{base}_{i}"))
            .find(|n| self.tensor_by_name(n).is_none())
            .unwrap_or_else(|| base.to_string())
    }
}
