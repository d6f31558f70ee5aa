//! Level 2: the host IR, one program for every rank.
//!
//! A [`HostProgram`] declares meshes and tensors (with **local**, per-device shapes) and a
//! structured body of [`Inst`]s. Every rank runs the same program; what differs between ranks
//! is only the value of `my(mesh, pt)` and `rank` in scalar expressions and whether the rank
//! holds a tensor (a tensor exists on the devices of its mesh). See the crate docs for the
//! execution model (streams, communications and waits).

pub mod contract;
pub mod expr;
pub mod operands;

use std::fmt;

pub use contract::{BufferContract, BufferUse, MemberBuffers, Side, SizeViolation, Sizing};
pub use expr::{BinOp, EvalError, Expr, ExprEnv, LoopVar};
pub use operands::TensorUse;

use crate::dtype::DType;
use crate::entity::Arena;
use crate::mesh::{DeviceId, DeviceMesh, ParallelType};
use crate::moe::MoeWire;
use crate::program::{MeshDecl, MeshId};
use crate::span::SourceLoc;

crate::entity_ref!(
    /// Handle of a host tensor (a buffer or a view).
    HostTensorId,
    "h"
);

/// A saved stream, printed `s0`, `s1`, ...
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamVar(pub u32);

impl fmt::Display for StreamVar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}

/// The label of a communication (or coalescing group), printed `c0`, `c1`, ...; a `wait`
/// names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CommId(pub u32);

impl fmt::Display for CommId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "c{}", self.0)
    }
}

/// What a host tensor is for.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Bound by the caller before the program runs.
    Input,
    /// Allocated by the program (or bound to a caller-owned buffer) and returned.
    Output,
    /// A temporary buffer (`allocate`) or a view (`shard_by_stream`).
    Internal,
}

/// A host tensor declaration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostTensor {
    /// Name, unique in the program.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Local (per-device) shape, row-major and contiguous unless the tensor is a view.
    pub shape: Vec<u64>,
    /// The devices that hold this tensor.
    pub mesh: MeshId,
    /// Input, output or internal.
    pub role: Role,
    /// Where it was declared.
    pub loc: SourceLoc,
}

impl HostTensor {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.numel() * self.dtype.size_bytes() as u64
    }
}

/// Which stream an instruction names.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StreamRef {
    /// A stream saved by `get_current_stream`.
    Var(StreamVar),
    /// Worker stream number `expr` from the bounded pool (the index is taken modulo the
    /// pool size at run time).
    Worker(Expr),
}

/// The devices taking part in a communication.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Team {
    /// The slice of `mesh` along `pt` through the executing device (rank-agnostic).
    Slice {
        /// The mesh.
        mesh: MeshId,
        /// A device parallel type.
        pt: ParallelType,
    },
    /// The flattened sub-mesh of `mesh` over several device parallel types through the
    /// executing device (rank-agnostic): the devices whose coordinates differ from its own only
    /// on the axes of `pts`, in row-major order of those axes. `pts` lists at least two
    /// distinct device parallel types, outermost mesh axis first (`DIDz, DIDy, DIDx`), e.g.
    /// `flattened(m, DIDy, DIDx)`: one collective over what would be consecutive collectives
    /// over `slice(m, DIDx)` and `slice(m, DIDy)` (DTensor's flattened mesh).
    Flattened {
        /// The mesh.
        mesh: MeshId,
        /// The device parallel types, outermost mesh axis first.
        pts: Vec<ParallelType>,
    },
    /// Every device of `mesh`, in row-major order.
    Mesh(MeshId),
    /// An explicit list of devices (used across meshes).
    Devices(Vec<DeviceId>),
}

impl Team {
    /// The team as seen from `device`, in team order, or `None` when `device` is not in it.
    pub fn resolve(
        &self,
        meshes: &Arena<MeshId, MeshDecl>,
        device: DeviceId,
    ) -> Option<Vec<DeviceId>> {
        let members = match self {
            Team::Slice { mesh, pt } => meshes.get(*mesh)?.mesh.team(device, *pt)?,
            Team::Flattened { mesh, pts } => meshes.get(*mesh)?.mesh.flattened_team(device, pts)?,
            Team::Mesh(mesh) => meshes.get(*mesh)?.mesh.devices().to_vec(),
            Team::Devices(devices) => devices.clone(),
        };
        members.contains(&device).then_some(members)
    }

    /// The team size as seen from a member (the same for every member).
    pub fn size(&self, meshes: &Arena<MeshId, MeshDecl>) -> Option<usize> {
        match self {
            Team::Slice { mesh, pt } => meshes.get(*mesh)?.mesh.size_of(*pt),
            Team::Flattened { mesh, pts } => {
                let mesh = &meshes.get(*mesh)?.mesh;
                pts.iter().map(|&pt| mesh.size_of(pt)).product()
            }
            Team::Mesh(mesh) => Some(meshes.get(*mesh)?.mesh.size()),
            Team::Devices(devices) => Some(devices.len()),
        }
    }
}

/// A reduction operator.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Mean: the sum divided by the team size.
    Avg,
}

impl ReduceOp {
    /// The name in the text format.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }
}

/// The kind of a collective [`InstKind::Communication`].
///
/// Buffers (team size `d`, team-relative root `r`). A *chunk* is one of `d` equal contiguous
/// pieces of a buffer's row-major elements (NCCL's convention): the buffer's shape does not
/// matter, so `[1, 12]` over 4 members is 4 chunks of 3 elements, and `[2, 6]` 4 chunks of 3.
/// The lowering stages an exchanged axis to the front (a `permute`) when the chunks would not
/// be slabs along it.
/// - `all_gather`: `out` = `d` chunks, chunk `j` from member `j`.
/// - `reduce_scatter`: `in` = `d` chunks; member `j` gets the reduction of chunk `j`.
/// - `all_reduce`: `out` = the reduction of every member's `in`.
/// - `broadcast`: `out` on every member = `in` of member `r`.
/// - `gather`: on `r`, `out` = `d` chunks, chunk `j` from member `j`.
/// - `scatter`: member `j`'s `out` = chunk `j` of `r`'s `in`.
/// - `reduce`: on `r`, `out` = the reduction of every member's `in`.
/// - `send_recv`: a team of two; member `r` sends `in`, the other receives into `out`.
/// - `all_to_all`: `in` and `out` are `d` chunks; member `j`'s chunk `k` goes to member `k`'s
///   chunk `j`.
///
/// [`CommKind::contract`] states the same as data ([`BufferContract`]): which buffers each
/// member takes and touches, how their sizes relate and which split into chunks.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CommKind {
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-reduce.
    AllReduce,
    /// Broadcast from a root.
    Broadcast,
    /// Gather to a root.
    Gather,
    /// Scatter from a root.
    Scatter,
    /// Reduce to a root.
    Reduce,
    /// A transfer from the root to the other member of a two-device team.
    SendRecv,
    /// Uniform all-to-all.
    AllToAll,
}

impl CommKind {
    /// Every kind, in a fixed order.
    pub const ALL: [CommKind; 9] = [
        CommKind::AllGather,
        CommKind::ReduceScatter,
        CommKind::AllReduce,
        CommKind::Broadcast,
        CommKind::Gather,
        CommKind::Scatter,
        CommKind::Reduce,
        CommKind::SendRecv,
        CommKind::AllToAll,
    ];

    /// The name in the text format.
    pub fn name(self) -> &'static str {
        match self {
            CommKind::AllGather => "all_gather",
            CommKind::ReduceScatter => "reduce_scatter",
            CommKind::AllReduce => "all_reduce",
            CommKind::Broadcast => "broadcast",
            CommKind::Gather => "gather",
            CommKind::Scatter => "scatter",
            CommKind::Reduce => "reduce",
            CommKind::SendRecv => "send_recv",
            CommKind::AllToAll => "all_to_all",
        }
    }

    /// True for the kinds that need a root.
    pub fn is_rooted(self) -> bool {
        matches!(
            self,
            CommKind::Broadcast
                | CommKind::Gather
                | CommKind::Scatter
                | CommKind::Reduce
                | CommKind::SendRecv
        )
    }

    /// True for the kinds that reduce.
    pub fn is_reduction(self) -> bool {
        matches!(
            self,
            CommKind::AllReduce | CommKind::ReduceScatter | CommKind::Reduce
        )
    }
}

/// A local compute op (runs on the current stream of every device that holds its tensors).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ComputeOp {
    /// `out = in` (same number of elements).
    Copy,
    /// `a[B.., M, K] @ b[K, N] or [B.., K, N] -> [B.., M, N]`.
    Matmul,
    /// `x[B.., M, K] @ w[N, K]^T -> [B.., M, N]`.
    Linear,
    /// `out += x[B.., M, K] @ w[N, K]^T`, `out` `[B.., M, N]`: a linear that accumulates into
    /// its output, which it reads as well as writes (the running sum of a reduce-scatter ring
    /// lands in `out`, and the chunk's GEMM adds onto it in place). Every element is rounded
    /// once: `round(out + sum_k x[.., m, k] * w[n, k])`, the sum of products and the add taken
    /// in `f32` (cuBLAS with `beta = 1` and `C = D = out`), then rounded to the dtype.
    LinearAccumulate,
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// GELU (tanh approximation).
    Gelu,
    /// SiLU.
    Silu,
    /// Sum over `axis` (the axis is removed).
    Sum {
        /// The axis.
        axis: usize,
    },
    /// Convert to the output's dtype.
    Cast,
    /// `out = in` with axes permuted: output axis `k` is input axis `perm[k]`.
    Permute {
        /// A permutation of the input's axes.
        perm: Vec<usize>,
    },
    /// `expert_x[B.., L, C, H], counts[B.., L], w[L, H, F] -> [B.., L, C, F]`, rows past the
    /// count set to zero.
    GroupedMatmul,
    /// Maximum over `axis` (the axis is removed).
    Max {
        /// The axis.
        axis: usize,
    },
    /// Minimum over `axis` (the axis is removed).
    Min {
        /// The axis.
        axis: usize,
    },
    /// Mean over `axis` (the axis is removed).
    Avg {
        /// The axis.
        axis: usize,
    },
    /// Broadcast to the output's shape: the input is aligned with the output from the last
    /// axis and every input axis of extent 1 (or missing) is repeated.
    Expand,
    /// `out = in[.., start..start + n, ..]` along `axis`, where `n` is the output's extent there
    /// (every other axis equal).
    Slice {
        /// The sliced axis.
        axis: usize,
        /// The first index copied.
        start: u64,
    },
    /// The inputs concatenated along `axis`.
    Cat {
        /// The axis.
        axis: usize,
        /// The number of inputs.
        inputs: usize,
    },
    /// Softmax along `axis`.
    Softmax {
        /// The axis.
        axis: usize,
    },
    /// `rms_norm(x, w)`: `x / sqrt(mean(x^2 along axis) + eps) * w`, `w` of shape
    /// `[extent of axis]`.
    RmsNorm {
        /// The normalized axis.
        axis: usize,
        /// Added to the mean square.
        eps: crate::program::Epsilon,
    },
}

impl ComputeOp {
    /// The name in the text format.
    pub fn name(&self) -> &'static str {
        match self {
            ComputeOp::Copy => "copy",
            ComputeOp::Matmul => "matmul",
            ComputeOp::Linear => "linear",
            ComputeOp::LinearAccumulate => "linear_accumulate",
            ComputeOp::Add => "add",
            ComputeOp::Sub => "sub",
            ComputeOp::Mul => "mul",
            ComputeOp::Gelu => "gelu",
            ComputeOp::Silu => "silu",
            ComputeOp::Sum { .. } => "sum",
            ComputeOp::Cast => "cast",
            ComputeOp::Permute { .. } => "permute",
            ComputeOp::GroupedMatmul => "grouped_matmul",
            ComputeOp::Max { .. } => "max",
            ComputeOp::Min { .. } => "min",
            ComputeOp::Avg { .. } => "avg",
            ComputeOp::Expand => "expand",
            ComputeOp::Slice { .. } => "slice",
            ComputeOp::Cat { .. } => "cat",
            ComputeOp::Softmax { .. } => "softmax",
            ComputeOp::RmsNorm { .. } => "rms_norm",
        }
    }

    /// The attributes as written after the tensors in the text format (`axis=1`,
    /// `perm=[1, 0]`), empty for an op without attributes.
    pub fn attributes(&self) -> String {
        match self {
            ComputeOp::Sum { axis }
            | ComputeOp::Max { axis }
            | ComputeOp::Min { axis }
            | ComputeOp::Avg { axis }
            | ComputeOp::Softmax { axis }
            | ComputeOp::Cat { axis, .. } => format!("axis={axis}"),
            ComputeOp::Permute { perm } => {
                let perm: Vec<String> = perm.iter().map(usize::to_string).collect();
                format!("perm=[{}]", perm.join(", "))
            }
            ComputeOp::Slice { axis, start } => format!("axis={axis}, start={start}"),
            ComputeOp::RmsNorm { axis, eps } => format!("axis={axis}, eps={eps}"),
            ComputeOp::Copy
            | ComputeOp::Matmul
            | ComputeOp::Linear
            | ComputeOp::LinearAccumulate
            | ComputeOp::Add
            | ComputeOp::Sub
            | ComputeOp::Mul
            | ComputeOp::Gelu
            | ComputeOp::Silu
            | ComputeOp::Cast
            | ComputeOp::GroupedMatmul
            | ComputeOp::Expand => String::new(),
        }
    }

    /// True when the op reads its output's previous contents as well as writing it
    /// ([`ComputeOp::LinearAccumulate`]): the output must hold defined values before it runs.
    pub fn reads_output(&self) -> bool {
        match self {
            ComputeOp::LinearAccumulate => true,
            ComputeOp::Copy
            | ComputeOp::Matmul
            | ComputeOp::Linear
            | ComputeOp::Add
            | ComputeOp::Sub
            | ComputeOp::Mul
            | ComputeOp::Gelu
            | ComputeOp::Silu
            | ComputeOp::Sum { .. }
            | ComputeOp::Cast
            | ComputeOp::Permute { .. }
            | ComputeOp::GroupedMatmul
            | ComputeOp::Max { .. }
            | ComputeOp::Min { .. }
            | ComputeOp::Avg { .. }
            | ComputeOp::Expand
            | ComputeOp::Slice { .. }
            | ComputeOp::Cat { .. }
            | ComputeOp::Softmax { .. }
            | ComputeOp::RmsNorm { .. } => false,
        }
    }

    /// `(inputs, outputs)`.
    pub fn arity(&self) -> (usize, usize) {
        match self {
            ComputeOp::Copy
            | ComputeOp::Gelu
            | ComputeOp::Silu
            | ComputeOp::Sum { .. }
            | ComputeOp::Cast
            | ComputeOp::Permute { .. }
            | ComputeOp::Max { .. }
            | ComputeOp::Min { .. }
            | ComputeOp::Avg { .. }
            | ComputeOp::Expand
            | ComputeOp::Slice { .. }
            | ComputeOp::Softmax { .. } => (1, 1),
            ComputeOp::Matmul
            | ComputeOp::Linear
            | ComputeOp::LinearAccumulate
            | ComputeOp::Add
            | ComputeOp::Sub
            | ComputeOp::Mul
            | ComputeOp::RmsNorm { .. } => (2, 1),
            ComputeOp::Cat { inputs, .. } => (*inputs, 1),
            ComputeOp::GroupedMatmul => (3, 1),
        }
    }
}

/// One host instruction with its source location.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inst {
    /// What it does.
    pub kind: InstKind,
    /// Where it was written.
    pub loc: SourceLoc,
}

impl Inst {
    /// An instruction with no source location.
    pub fn new(kind: InstKind) -> Inst {
        Inst {
            kind,
            loc: SourceLoc::NONE,
        }
    }
}

impl From<InstKind> for Inst {
    fn from(kind: InstKind) -> Inst {
        Inst::new(kind)
    }
}

/// A sequence of instructions.
pub type Block = Vec<Inst>;

/// The host instruction set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstKind {
    /// Creates a buffer for `tensor` (uninitialized contents).
    Allocate {
        /// The tensor (not an input, not a view).
        tensor: HostTensorId,
    },
    /// Releases the buffer of `tensor` once the work already enqueued on it is done.
    Deallocate {
        /// The tensor.
        tensor: HostTensorId,
    },
    /// `for index in start..stop { body }` (step 1).
    ForLoop {
        /// The loop variable.
        index: LoopVar,
        /// First value.
        start: Expr,
        /// One past the last value.
        stop: Expr,
        /// The body.
        body: Block,
    },
    /// Saves the current stream in `dst`.
    GetCurrentStream {
        /// The variable.
        dst: StreamVar,
    },
    /// Makes `stream` the current stream.
    SetCurrentStream {
        /// The stream.
        stream: StreamRef,
    },
    /// The current stream waits for everything enqueued on `stream` so far.
    Synchronize {
        /// The stream waited for.
        stream: StreamRef,
    },
    /// `out` becomes a view of chunk `index` of `input`: `input` is cut into `chunks` equal
    /// chunks along `axis`.
    ShardByStream {
        /// The view.
        out: HostTensorId,
        /// The tensor viewed.
        input: HostTensorId,
        /// The axis cut.
        axis: usize,
        /// The number of chunks.
        chunks: u64,
        /// The chunk index, in `0..chunks`.
        index: Expr,
    },
    /// `out` becomes a view of elements `[start, start + length)` of `input` along `axis`: a
    /// per-rank piece of a padded buffer (the valid part of an uneven shard, or one member's
    /// slot). `start` and `length` are evaluated per rank and iteration; `out`'s declared
    /// extent along `axis` is its capacity, at least every `length`.
    Narrow {
        /// The view.
        out: HostTensorId,
        /// The tensor viewed.
        input: HostTensorId,
        /// The axis narrowed.
        axis: usize,
        /// First element along `axis`.
        start: Expr,
        /// Number of elements along `axis`.
        length: Expr,
    },
    /// A collective over `team`, posted on the current stream (see [`CommKind`]).
    Communication {
        /// The label a `wait` names.
        id: CommId,
        /// The collective.
        kind: CommKind,
        /// The devices taking part.
        team: Team,
        /// The send buffer.
        input: HostTensorId,
        /// The receive buffer.
        output: HostTensorId,
        /// Team-relative root, for rooted kinds.
        root: Option<Expr>,
        /// Reduction operator, for reducing kinds.
        op: Option<ReduceOp>,
    },
    /// Each team member sends `input` to team index `send_peer` and receives `output` from
    /// team index `recv_peer` (a local copy when both are itself).
    CollectivePermute {
        /// The label a `wait` names.
        id: CommId,
        /// The devices taking part.
        team: Team,
        /// Team index to send to.
        send_peer: Expr,
        /// Team index to receive from.
        recv_peer: Expr,
        /// The send buffer.
        input: HostTensorId,
        /// The receive buffer.
        output: HostTensorId,
    },
    /// The current stream waits until communication (or group) `comm`'s latest instance is
    /// complete.
    Wait {
        /// The communication.
        comm: CommId,
    },
    /// Starts a group of communications issued together.
    StartCoalescing,
    /// Ends the group started by the matching `start_coalescing`; `id` labels the group.
    EndCoalescing {
        /// The group's label.
        id: CommId,
    },
    /// MoE dispatch over `team`: every token of `x` travels once to each team member owning
    /// one of its experts `topk_idx[t, ..]`, encoded as `wire`, and fans out to those experts'
    /// rows there (see [`crate::moe`]).
    MoeDispatch {
        /// The label a `wait` names.
        id: CommId,
        /// The expert-parallel team.
        team: Team,
        /// Tokens `[B.., T, H]`.
        x: HostTensorId,
        /// Global expert ids `[B.., T, K]`.
        topk_idx: HostTensorId,
        /// Rows per local expert `[B.., L, C, H]`.
        expert_x: HostTensorId,
        /// Valid rows per local expert `[B.., L]` (i32).
        expert_counts: HostTensorId,
        /// Source of each row `[B.., L, C, 2]` (i32: team-global token, top-k slot).
        routing: HostTensorId,
        /// How travelling tokens are encoded.
        wire: MoeWire,
    },
    /// MoE combine over `team`: each member sums the weighted outputs of a token's experts it
    /// holds into one row, which goes back to the token's member and is added there in member
    /// order (see [`crate::moe`]).
    MoeCombine {
        /// The label a `wait` names.
        id: CommId,
        /// The expert-parallel team.
        team: Team,
        /// Expert outputs `[B.., L, C, F]`.
        expert_y: HostTensorId,
        /// Valid rows per local expert `[B.., L]`.
        expert_counts: HostTensorId,
        /// Source of each row `[B.., L, C, 2]`.
        routing: HostTensorId,
        /// Weights `[B.., T, K]`.
        topk_weights: HostTensorId,
        /// Combined tokens `[B.., T, F]`.
        out: HostTensorId,
    },
    /// A local compute op.
    Compute {
        /// The op.
        op: ComputeOp,
        /// Inputs.
        inputs: Vec<HostTensorId>,
        /// Outputs (written in place).
        outputs: Vec<HostTensorId>,
    },
    /// Calls a kernel registered by name with the backend (an embedder's own kernel).
    CallKernel {
        /// The registered name.
        kernel: String,
        /// Inputs.
        inputs: Vec<HostTensorId>,
        /// Outputs (written in place).
        outputs: Vec<HostTensorId>,
        /// Scalar arguments.
        args: Vec<Expr>,
    },
}

impl InstKind {
    /// The instruction's name in the text format.
    pub fn name(&self) -> &'static str {
        match self {
            InstKind::Allocate { .. } => "allocate",
            InstKind::Deallocate { .. } => "deallocate",
            InstKind::ForLoop { .. } => "for",
            InstKind::GetCurrentStream { .. } => "get_current_stream",
            InstKind::SetCurrentStream { .. } => "set_current_stream",
            InstKind::Synchronize { .. } => "synchronize",
            InstKind::ShardByStream { .. } => "shard_by_stream",
            InstKind::Narrow { .. } => "narrow",
            InstKind::Communication { kind, .. } => kind.name(),
            InstKind::CollectivePermute { .. } => "collective_permute",
            InstKind::Wait { .. } => "wait",
            InstKind::StartCoalescing => "start_coalescing",
            InstKind::EndCoalescing { .. } => "end_coalescing",
            InstKind::MoeDispatch { .. } => "moe_dispatch",
            InstKind::MoeCombine { .. } => "moe_combine",
            InstKind::Compute { op, .. } => op.name(),
            InstKind::CallKernel { .. } => "call_kernel",
        }
    }
}

/// A host program.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct HostProgram {
    /// Name.
    pub name: String,
    /// Declared meshes.
    pub meshes: Arena<MeshId, MeshDecl>,
    /// Declared tensors: inputs, outputs, temporaries and views.
    pub tensors: Arena<HostTensorId, HostTensor>,
    /// The body.
    pub body: Block,
}

impl HostProgram {
    /// An empty program.
    pub fn new(name: impl Into<String>) -> HostProgram {
        HostProgram {
            name: name.into(),
            ..HostProgram::default()
        }
    }

    /// Adds a mesh.
    pub fn add_mesh(&mut self, name: impl Into<String>, mesh: DeviceMesh) -> MeshId {
        self.meshes.push(MeshDecl {
            name: name.into(),
            mesh,
            loc: SourceLoc::NONE,
        })
    }

    /// Adds a tensor.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<u64>,
        mesh: MeshId,
        role: Role,
    ) -> HostTensorId {
        self.tensors.push(HostTensor {
            name: name.into(),
            dtype,
            shape,
            mesh,
            role,
            loc: SourceLoc::NONE,
        })
    }

    /// Inputs in declaration order.
    pub fn inputs(&self) -> Vec<HostTensorId> {
        self.with_role(Role::Input)
    }

    /// Outputs in declaration order.
    pub fn outputs(&self) -> Vec<HostTensorId> {
        self.with_role(Role::Output)
    }

    fn with_role(&self, role: Role) -> Vec<HostTensorId> {
        self.tensors.keys_where(|t| t.role == role).collect()
    }

    /// The tensor called `name`.
    pub fn tensor_by_name(&self, name: &str) -> Option<HostTensorId> {
        self.tensors.find_key(|t| t.name == name)
    }

    /// The mesh called `name`.
    pub fn mesh_by_name(&self, name: &str) -> Option<MeshId> {
        self.meshes.find_key(|m| m.name == name)
    }

    /// The number of devices a run needs.
    pub fn world_size(&self) -> usize {
        self.meshes
            .values()
            .map(|m| m.mesh.required_world_size())
            .max()
            .unwrap_or(0)
    }

    /// Visits every instruction in program order (pre-order), with its loop depth.
    pub fn walk<'a>(&'a self, f: &mut impl FnMut(&'a Inst, usize)) {
        fn rec<'a>(block: &'a Block, depth: usize, f: &mut impl FnMut(&'a Inst, usize)) {
            for inst in block {
                f(inst, depth);
                if let InstKind::ForLoop { body, .. } = &inst.kind {
                    rec(body, depth + 1, f);
                }
            }
        }
        rec(&self.body, 0, f);
    }

    /// A loop variable not used anywhere in the program.
    pub fn fresh_loop_var(&self) -> LoopVar {
        let mut next = 0;
        self.walk(&mut |inst, _| {
            if let InstKind::ForLoop { index, .. } = &inst.kind {
                next = next.max(index.0 + 1);
            }
        });
        LoopVar(next)
    }

    /// A stream variable not used anywhere in the program.
    pub fn fresh_stream_var(&self) -> StreamVar {
        let mut next = 0;
        self.walk(&mut |inst, _| {
            if let InstKind::GetCurrentStream { dst } = &inst.kind {
                next = next.max(dst.0 + 1);
            }
        });
        StreamVar(next)
    }

    /// A communication label not used anywhere in the program.
    pub fn fresh_comm_id(&self) -> CommId {
        let mut next = 0;
        self.walk(&mut |inst, _| {
            if let Some(id) = inst.kind.comm_id() {
                next = next.max(id.0 + 1);
            }
        });
        CommId(next)
    }

    /// True when `t` is viewed through a `narrow` (directly or through other views): its
    /// buffer is padded for uneven shards, and the program need not write the padding.
    pub fn is_padded(&self, t: HostTensorId) -> bool {
        let mut parent = std::collections::HashMap::new();
        let mut narrowed = Vec::new();
        self.walk(&mut |inst, _| match &inst.kind {
            InstKind::ShardByStream { out, input, .. } => {
                parent.insert(*out, *input);
            }
            InstKind::Narrow { out, input, .. } => {
                parent.insert(*out, *input);
                narrowed.push(*input);
            }
            _ => {}
        });
        narrowed.into_iter().any(|mut v| {
            for _ in 0..=parent.len() {
                if v == t {
                    return true;
                }
                match parent.get(&v) {
                    Some(&p) => v = p,
                    None => return false,
                }
            }
            false
        })
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
