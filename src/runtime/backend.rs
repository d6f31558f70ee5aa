//! The [`Backend`] trait: what the [`Evaluator`](super::evaluator::Evaluator) needs from a
//! device runtime.
//!
//! The trait is shaped for a GPU runtime (CUDA streams and events, cuBLAS, NCCL) and is also
//! implemented by the embedded CPU [`CpuBackend`](super::cpu::CpuBackend):
//!
//! - **Buffers** are opaque handles ([`Backend::Buffer`]). Allocation returns at once on the
//!   host; deallocation is deferred by the backend until the work already enqueued on the
//!   buffer has completed.
//! - **Views** ([`TensorView`]) are `(buffer, element offset, shape, strides)` built by the
//!   evaluator (`shard_by_stream` makes a view of a chunk of its parent).
//! - **Streams** are numbered by [`StreamIndex`]: the main stream and a bounded pool of worker
//!   streams. Compute runs on the current stream in order.
//! - **Communications** are posted on the current stream ([`Backend::post`]) and return a
//!   handle; [`Backend::wait`] makes the *current stream* wait for it (stream-ordered, no host
//!   block). [`Backend::synchronize`] makes the current stream wait for everything enqueued on
//!   another stream so far (an event record there plus a stream wait here).
//! - **Groups**: between [`Backend::begin_group`] and [`Backend::end_group`] posts are issued
//!   together (NCCL group semantics); `end_group` returns a handle covering all of them.
//! - [`Backend::prepare`] receives, once per program, the teams this rank takes part in and
//!   what it posts under every communication label ([`PlanInfo`]): a GPU backend creates its
//!   communicators there and selects the transport of every communication.
//!
//! Everything the evaluator hands a backend is named by a typed handle: buffers
//! ([`Backend::Buffer`]), host tensors ([`HostTensorId`]), streams ([`StreamIndex`]), teams
//! ([`TeamId`]), communication labels ([`CommLabel`], each standing for one [`CommId`] of the
//! program) and kernels ([`KernelId`]).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use meshflow_ir::{Arena, CommId, CommKind, ComputeOp, DType, DeviceId, HostTensorId, ReduceOp};
use meshflow_passes::Transport;

use super::cpu_ops::OpError;
use super::data::TensorData;

/// A stream of one rank: `0` is the main stream, `1..=pool` the worker streams.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamIndex(pub usize);

impl StreamIndex {
    /// The main stream.
    pub const MAIN: StreamIndex = StreamIndex(0);

    /// Worker stream `i` of the pool (`i` already reduced modulo the pool size).
    pub fn worker(i: usize) -> StreamIndex {
        StreamIndex(i + 1)
    }
}

impl fmt::Display for StreamIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => f.write_str("main"),
            w => write!(f, "worker {}", w - 1),
        }
    }
}

/// A view of a buffer: `(buffer, element offset, shape, strides)`, plus the host tensor it
/// stands for (for diagnostics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorView<Buf> {
    /// The host tensor (or view) this is.
    pub tensor: HostTensorId,
    /// The underlying buffer.
    pub buffer: Buf,
    /// Element type.
    pub dtype: DType,
    /// Offset of the first element, in elements.
    pub offset: u64,
    /// Shape.
    pub shape: Vec<u64>,
    /// Strides, in elements.
    pub strides: Vec<u64>,
}

impl<Buf> TensorView<Buf> {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// The position of an instruction in the pre-order listing of its host program: the order of
/// [`HostProgram::walk`](meshflow_ir::HostProgram::walk), counted from 0, a loop before its
/// body. Host instructions are a tree of blocks, not an arena, so this position is how the
/// runtime names one (the evaluator keeps its instructions in an arena keyed by it). Printed
/// `#n`; each instruction has one, however many times a loop runs it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PreorderIndex(pub u32);

impl meshflow_ir::EntityRef for PreorderIndex {
    fn new(index: usize) -> Self {
        PreorderIndex(u32::try_from(index).expect("more than u32::MAX instructions"))
    }
    fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for PreorderIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Where an instruction is: its position in program pre-order and the values of its enclosing
/// loop variables (outermost first).
#[derive(Copy, Clone, Debug)]
pub struct InstCtx<'a> {
    /// The instruction's position in program pre-order.
    pub preorder: PreorderIndex,
    /// Values of the enclosing loop variables, outermost first.
    pub iteration: &'a [i64],
}

meshflow_ir::entity_ref!(
    /// A team this rank takes part in: a dense index among the rank's teams of one prepared
    /// program (see [`PlanInfo::teams`]).
    TeamId,
    "team"
);

meshflow_ir::entity_ref!(
    /// A communication label of one prepared program: a dense index standing for one
    /// [`CommId`] of the host program (see [`PlanInfo::comms`]).
    CommLabel,
    "label"
);

meshflow_ir::entity_ref!(
    /// A registered kernel, resolved by name once per program ([`Backend::kernel`]).
    KernelId,
    "kernel"
);

/// A team this rank takes part in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TeamInfo {
    /// The team's handle (its index in [`PlanInfo::teams`]).
    pub id: TeamId,
    /// Members in team order.
    pub members: Vec<DeviceId>,
    /// This rank's index in `members`.
    pub my_index: usize,
}

/// What a rank posts under a communication label.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommOp {
    /// A collective of `kind`, reducing with `op` where it reduces, on `dtype` elements.
    Collective {
        /// The collective.
        kind: CommKind,
        /// The reduction (`Sum` when the instruction names none).
        op: ReduceOp,
        /// The element type of its buffers.
        dtype: DType,
    },
    /// A collective permute.
    Permute,
    /// An MoE dispatch.
    MoeDispatch,
    /// An MoE combine.
    MoeCombine,
    /// The end of a coalescing group (its label covers every member).
    Group,
}

/// A communication label of a prepared program, as this rank sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommInfo {
    /// The label in the host program.
    pub comm: CommId,
    /// The instruction name (`all_gather`, `collective_permute`, `end_coalescing`, ...).
    pub name: &'static str,
    /// What this rank posts under it; `None` when it posts nothing (the label is only waited
    /// on here, or this rank is not in the team).
    pub op: Option<CommOp>,
    /// The team it runs in (`None` for a group's end and for labels this rank does not post).
    pub team: Option<TeamId>,
    /// Whether it is posted inside a coalescing group.
    pub grouped: bool,
    /// For an MoE dispatch or combine this rank posts: which of the pair carries the top-k
    /// weights.
    pub moe_weights: Option<MoeWeightsAt>,
}

/// Which instruction of an MoE step hands the top-k weights to the transport: the dispatch
/// (they travel with the token rows) or the combine (a GPU engine first copies them to every
/// peer there: one more exchange). The evaluator chooses the dispatch when the combine's
/// weights are a program input nothing writes; see `runtime/evaluator/moe_weights.rs`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MoeWeightsAt {
    /// The dispatch carries them.
    Dispatch,
    /// The combine carries them.
    Combine,
}

impl MoeWeightsAt {
    /// `dispatch` or `combine`.
    pub fn name(self) -> &'static str {
        match self {
            MoeWeightsAt::Dispatch => "dispatch",
            MoeWeightsAt::Combine => "combine",
        }
    }
}

/// What a backend learns about a program before it runs.
#[derive(Clone, Debug)]
pub struct PlanInfo<'a> {
    /// The teams this rank takes part in.
    pub teams: &'a Arena<TeamId, TeamInfo>,
    /// Every communication label of the program.
    pub comms: &'a Arena<CommLabel, CommInfo>,
}

impl PlanInfo<'_> {
    /// The number of communication labels.
    pub fn comm_labels(&self) -> usize {
        self.comms.len()
    }

    /// The team `id`.
    pub fn team(&self, id: TeamId) -> Option<&TeamInfo> {
        self.teams.get(id)
    }
}

/// A communication to post. Buffers a rank does not hold are `None`.
#[derive(Debug)]
pub enum CommRequest<'a, Buf> {
    /// A collective (see [`CommKind::contract`] for its buffer contract).
    Collective {
        /// The communication label.
        label: CommLabel,
        /// The collective.
        kind: CommKind,
        /// The team.
        team: &'a TeamInfo,
        /// Send buffer.
        input: Option<&'a TensorView<Buf>>,
        /// Receive buffer.
        output: Option<&'a TensorView<Buf>>,
        /// Team-relative root, for rooted kinds.
        root: Option<usize>,
        /// Reduction operator (`Sum` when the instruction names none).
        op: ReduceOp,
    },
    /// Send `input` to `send_peer`, receive `output` from `recv_peer` (team indices).
    Permute {
        /// The communication label.
        label: CommLabel,
        /// The team.
        team: &'a TeamInfo,
        /// Team index to send to.
        send_peer: usize,
        /// Team index to receive from.
        recv_peer: usize,
        /// Send buffer.
        input: &'a TensorView<Buf>,
        /// Receive buffer.
        output: &'a TensorView<Buf>,
    },
    /// MoE dispatch (see [`InstKind::MoeDispatch`](meshflow_ir::InstKind::MoeDispatch)).
    MoeDispatch {
        /// The communication label.
        label: CommLabel,
        /// The expert-parallel team.
        team: &'a TeamInfo,
        /// Tokens `[B.., T, H]`.
        x: &'a TensorView<Buf>,
        /// Expert ids `[B.., T, K]`.
        topk_idx: &'a TensorView<Buf>,
        /// Rows per local expert `[B.., L, C, H]`.
        expert_x: &'a TensorView<Buf>,
        /// Counts `[B.., L]`.
        expert_counts: &'a TensorView<Buf>,
        /// Routing `[B.., L, C, 2]`.
        routing: &'a TensorView<Buf>,
        /// How travelling tokens are encoded.
        wire: meshflow_ir::MoeWire,
        /// The weights `[B.., T, K]` of the combine that follows, when they travel with the
        /// dispatch ([`MoeWeightsAt::Dispatch`]); that combine names the same view. A backend
        /// may send them now or ignore them (the combine still names them).
        topk_weights: Option<&'a TensorView<Buf>>,
    },
    /// MoE combine (see [`InstKind::MoeCombine`](meshflow_ir::InstKind::MoeCombine)).
    MoeCombine {
        /// The communication label.
        label: CommLabel,
        /// The expert-parallel team.
        team: &'a TeamInfo,
        /// Expert outputs `[B.., L, C, F]`.
        expert_y: &'a TensorView<Buf>,
        /// Counts `[B.., L]`.
        expert_counts: &'a TensorView<Buf>,
        /// Routing `[B.., L, C, 2]`.
        routing: &'a TensorView<Buf>,
        /// Weights `[B.., T, K]`.
        topk_weights: &'a TensorView<Buf>,
        /// Combined tokens `[B.., T, F]`.
        out: &'a TensorView<Buf>,
    },
}

impl<Buf> CommRequest<'_, Buf> {
    /// The communication label.
    pub fn label(&self) -> CommLabel {
        match self {
            CommRequest::Collective { label, .. }
            | CommRequest::Permute { label, .. }
            | CommRequest::MoeDispatch { label, .. }
            | CommRequest::MoeCombine { label, .. } => *label,
        }
    }

    /// The team.
    pub fn team(&self) -> &TeamInfo {
        match self {
            CommRequest::Collective { team, .. }
            | CommRequest::Permute { team, .. }
            | CommRequest::MoeDispatch { team, .. }
            | CommRequest::MoeCombine { team, .. } => team,
        }
    }

    /// The instruction name (`all_gather`, `collective_permute`, ...).
    pub fn name(&self) -> &'static str {
        match self {
            CommRequest::Collective { kind, .. } => kind.name(),
            CommRequest::Permute { .. } => "collective_permute",
            CommRequest::MoeDispatch { .. } => "moe_dispatch",
            CommRequest::MoeCombine { .. } => "moe_combine",
        }
    }
}

/// One side of a race: an access and where it happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessSite {
    /// The instruction's position in program pre-order.
    pub preorder: PreorderIndex,
    /// Loop variable values at the access.
    pub iteration: Arc<[i64]>,
    /// True for a write.
    pub write: bool,
    /// The communication label when the access was made by a communication.
    pub comm_label: Option<CommLabel>,
    /// The stream it was enqueued on.
    pub stream: StreamIndex,
}

/// Two accesses to overlapping elements of one buffer that are not ordered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaceReport {
    /// The tensor accessed by the later instruction.
    pub tensor: HostTensorId,
    /// The earlier access (in host order).
    pub earlier: AccessSite,
    /// The later access.
    pub later: AccessSite,
}

/// Why a backend operation failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BackendError {
    /// A kernel failed.
    #[error(transparent)]
    Op(#[from] OpError),
    /// An unordered access (see [`RaceReport`]); the evaluator prints it with both
    /// instructions.
    #[error("race between instructions {} and {}", .0.earlier.preorder, .0.later.preorder)]
    Race(Box<RaceReport>),
    /// A peer did not send within the timeout.
    #[error("timed out after {waited:?} waiting for rank {peer} ({what})")]
    Timeout {
        /// The rank waited for.
        peer: DeviceId,
        /// How long.
        waited: Duration,
        /// What was expected.
        what: String,
    },
    /// Another rank failed, so this one stopped.
    #[error("aborted because rank {failed_rank} failed: {reason}")]
    Aborted {
        /// The rank that failed first.
        failed_rank: DeviceId,
        /// Its error.
        reason: String,
    },
    /// A fault injected for testing.
    #[error("injected {kind} at communication #{n}")]
    InjectedFault {
        /// The communication count at which it fired.
        n: usize,
        /// `error` or `stall`.
        kind: &'static str,
    },
    /// Invalid use (wrong buffers, sizes, handles).
    #[error("{0}")]
    Invalid(String),
    /// A device runtime call failed (a GPU backend: CUDA driver, cuBLAS, NVRTC, NCCL).
    #[error("rank {rank}: {call} failed: {message}")]
    Device {
        /// The rank.
        rank: DeviceId,
        /// The operation or library call (`ncclAllGather`, `cublasGemmEx`, `cuMemAlloc`, ...).
        call: String,
        /// The library's error text.
        message: String,
    },
    /// A kernel registered by the embedder failed.
    #[error("kernel `{name}` failed: {message}")]
    Kernel {
        /// The kernel.
        name: String,
        /// Its message.
        message: String,
    },
}

/// A device runtime the evaluator drives; one instance per rank.
pub trait Backend {
    /// An opaque buffer handle.
    type Buffer: Copy + Eq + fmt::Debug;
    /// A posted communication (or group).
    type Comm: Clone + fmt::Debug;

    /// This rank's device id.
    fn device(&self) -> DeviceId;
    /// The number of worker streams in the pool (at least 1).
    fn stream_pool_size(&self) -> usize;
    /// Called once per program before it runs.
    fn prepare(&mut self, info: &PlanInfo<'_>) -> Result<(), BackendError>;

    /// Allocates a row-major buffer of `shape` (host-immediate; contents undefined).
    fn allocate(&mut self, dtype: DType, shape: &[u64]) -> Result<Self::Buffer, BackendError>;
    /// Releases a buffer once the work enqueued on it is done.
    fn deallocate(&mut self, buffer: Self::Buffer) -> Result<(), BackendError>;
    /// Copies host data into a whole buffer (ordered before everything enqueued later).
    fn upload(&mut self, buffer: Self::Buffer, data: &TensorData) -> Result<(), BackendError>;
    /// Copies a view to the host, after all enqueued work (host-blocking).
    fn download(&mut self, view: &TensorView<Self::Buffer>) -> Result<TensorData, BackendError>;
    /// [`Backend::download`] of a padded buffer (uneven shards): the program leaves its
    /// padding unwritten, so a backend that checks that outputs are fully written skips the
    /// check here.
    fn download_padded(
        &mut self,
        view: &TensorView<Self::Buffer>,
    ) -> Result<TensorData, BackendError> {
        self.download(view)
    }

    /// Makes `stream` current.
    fn set_current_stream(&mut self, stream: StreamIndex) -> Result<(), BackendError>;
    /// The current stream waits for everything enqueued on `stream` so far.
    fn synchronize(&mut self, stream: StreamIndex, ctx: InstCtx<'_>) -> Result<(), BackendError>;

    /// Enqueues a compute op on the current stream.
    fn compute(
        &mut self,
        op: &ComputeOp,
        inputs: &[&TensorView<Self::Buffer>],
        outputs: &[&TensorView<Self::Buffer>],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError>;
    /// Resolves a registered kernel by name.
    fn kernel(&self, name: &str) -> Option<KernelId>;
    /// Enqueues a registered kernel on the current stream.
    fn call_kernel(
        &mut self,
        kernel: KernelId,
        inputs: &[&TensorView<Self::Buffer>],
        outputs: &[&TensorView<Self::Buffer>],
        args: &[i64],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError>;

    /// Posts a communication on the current stream.
    fn post(
        &mut self,
        request: &CommRequest<'_, Self::Buffer>,
        ctx: InstCtx<'_>,
    ) -> Result<Self::Comm, BackendError>;
    /// Starts a group of communications issued together.
    fn begin_group(&mut self) -> Result<(), BackendError>;
    /// Issues the group; the handle (labelled `label`) covers every member.
    fn end_group(&mut self, label: CommLabel, ctx: InstCtx<'_>)
        -> Result<Self::Comm, BackendError>;
    /// The current stream waits for `comm`.
    fn wait(&mut self, comm: &Self::Comm, ctx: InstCtx<'_>) -> Result<(), BackendError>;
    /// Blocks the host until all enqueued work is done.
    fn finish(&mut self) -> Result<(), BackendError>;

    /// Whether `moe_dispatch` can encode travelling tokens as `wire` here. The evaluator
    /// refuses a dispatch this backend cannot encode, with an error naming it, rather than
    /// letting it move other bits than the program says. Default: only
    /// [`MoeWire::Native`](meshflow_ir::MoeWire::Native).
    fn supports_moe_wire(&self, wire: meshflow_ir::MoeWire) -> bool {
        wire == meshflow_ir::MoeWire::Native
    }

    /// Which transport executes the communications of `label` on this rank, as selected when
    /// the program was prepared (for traces and reports); `None` where the backend has no
    /// transports (the CPU backend) or the rank posts nothing under the label.
    fn transport_of(&self, label: CommLabel) -> Option<Transport> {
        let _ = label;
        None
    }

    /// Whether the prepared program can be recorded as a replayable graph: backends that
    /// cannot record (the default, and a GPU program whose transports need the host during a
    /// step) say why.
    fn check_graph(&self) -> Result<(), BackendError> {
        Err(BackendError::Invalid(
            "this backend does not record graphs (graph capture needs the CUDA backend)".into(),
        ))
    }

    /// Starts recording the device work of one step of the program as a replayable graph
    /// (the evaluator then issues the step once and calls [`Backend::end_graph`]); refused
    /// as [`Backend::check_graph`] says.
    fn begin_graph(&mut self) -> Result<(), BackendError> {
        self.check_graph()
    }

    /// Ends the recording started by [`Backend::begin_graph`] and enqueues `replays` replays
    /// of it (0: the step failed; drop the recording).
    fn end_graph(&mut self, replays: usize) -> Result<(), BackendError> {
        let _ = replays;
        Err(BackendError::Invalid(
            "this backend does not record graphs".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An instruction's position prints `#n`, as race reports always printed it.
    #[test]
    fn race_reports_name_instructions_by_position() {
        let site = |at, write| AccessSite {
            preorder: PreorderIndex(at),
            iteration: Arc::from(&[1_i64][..]),
            write,
            comm_label: None,
            stream: StreamIndex::MAIN,
        };
        let err = BackendError::Race(Box::new(RaceReport {
            tensor: <HostTensorId as meshflow_ir::EntityRef>::new(0),
            earlier: site(3, true),
            later: site(12, false),
        }));
        assert_eq!(err.to_string(), "race between instructions #3 and #12");
    }
}
