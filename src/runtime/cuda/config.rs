//! Settings of the CUDA backend ([`CudaConfig`], [`CopyStream`]), the caller's GPU resources
//! ([`CudaResources`]) and the abort signal the ranks of one run share ([`AbortSignal`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshflow_ir::DeviceId;
use meshflow_kernels::nccl::Comm;
use meshflow_kernels::proxy::WireChoice;
use meshflow_kernels::{AbortWord, Device, Stream};
use meshflow_passes::Transport;

use super::user_kernels::CudaKernels;

/// Which stream runs a copy-engine pull. A deferred pull ([`CudaConfig::defer_pulls`]) runs on
/// a companion stream of the posting stream, joined to it at the post, and the stream chosen
/// here joins the companion once the pull is enqueued.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum CopyStream {
    /// The stream the communication is posted on (ordered like an NCCL call there).
    #[default]
    Current,
    /// A copy stream of the rank: the pull starts once the posting stream has reached the
    /// post, and only a `wait` orders later work after it.
    Dedicated,
}

/// Settings of the CUDA backend.
#[derive(Clone, Debug)]
pub struct CudaConfig {
    /// Worker streams per rank (the main stream comes on top).
    pub stream_pool: usize,
    /// How long the host waits for the device at the end of a run, and for peers in the
    /// rendezvous, before giving up with an error.
    pub timeout: Duration,
    /// Record one [`Interval`](super::Interval) per compute op and communication.
    pub profile: bool,
    /// Kernels for `call_kernel`.
    pub kernels: CudaKernels,
    /// The transport to force, where it can carry a communication; `None` (the default):
    /// chosen per team when a program is prepared (see the selection rules in
    /// `src/runtime/transport_rules.rs` and `docs/architecture.md`):
    /// - `Nccl`: NCCL for every communication (ranks of other nodes still go through the
    ///   host proxy);
    /// - `CopyEngine`: collective permutes, broadcasts and sum reduce-scatters over the copy
    ///   engine; a team whose GPUs do not reach each other's memory (peer access in one
    ///   process, or CUDA IPC between processes of one host) is an error;
    /// - `Nvlink`: MoE dispatch and combine over the NVLink kernels; a team that cannot use
    ///   them is an error;
    /// - `HostProxy` cannot be forced: the split into nodes selects it.
    pub transport: Option<Transport>,
    /// Which stream runs copy-engine pulls.
    pub copy_stream: CopyStream,
    /// Defer a copy-engine pull whose sender's offer has not arrived when it is posted,
    /// instead of blocking the host there until it does (the compute after it in program
    /// order then launches at once; the pull is enqueued at a `wait` on it, before any host
    /// wait that may block, or when its offer is found later: see
    /// `src/runtime/cuda/deferred.rs`). Default: off, unless the environment variable
    /// `MESHFLOW_DEFER_PULLS` is `1`, `on`, `true` or `yes`. Measured on 2x H200 at 8192^3
    /// (`bench/results/2026-11-26-h200x2.md`), one process per GPU: AG+GEMM's prefetched
    /// ring 772.0 / 787.3 µs with it against 792.5 µs without, but GEMM+RS's accumulating
    /// ring 821.7 / 836.0 µs against 776.6 µs (a deferred pull that finds its offer only at
    /// its `wait` starts late), so it stays opt-in.
    pub defer_pulls: bool,
    /// Host program steps per run of an in-process launch ([`run_cuda_timed`](super::run_cuda_timed)):
    /// the program body runs this many times back to back between one upload of the inputs
    /// and one download of the outputs, and the run's device time is divided by it (at least 1).
    pub steps: usize,
    /// Record one step as a CUDA graph per run and replay it `steps` times (see
    /// [`Evaluator::set_graph`](crate::runtime::Evaluator::set_graph)). Programs whose
    /// transports need the host during a step (copy engine, host proxy) are refused with the
    /// reason; MoE over NVLink replays (its step number lives on the device). The run's device
    /// time ([`CudaBackend::last_run_us`](super::CudaBackend::last_run_us)) is then that of
    /// the replays; profiling intervals are not recorded.
    pub graph: bool,
    /// Split the ranks of a launch into nodes of this many consecutive ranks: collective
    /// permutes and MoE dispatch/combine between ranks of different nodes go through the
    /// inter-node host proxy, the rest stays on NCCL. `None`: `MESHFLOW_NODE_SIZE` when it is
    /// set, else one node.
    pub node_size: Option<usize>,
    /// The wire of the host proxy in runs split into nodes (TCP, ibverbs, or the best one
    /// available).
    pub wire: WireChoice,
    /// Fault tests only: the process exits at once with
    /// [`FAULT_EXIT_STATUS`](crate::runtime::cpu::FAULT_EXIT_STATUS) when this rank posts its
    /// n-th communication (0-based), as a killed process would.
    pub exit_at_comm: Option<usize>,
}

impl Default for CudaConfig {
    fn default() -> CudaConfig {
        CudaConfig {
            stream_pool: 4,
            timeout: Duration::from_secs(120),
            profile: false,
            kernels: CudaKernels::new(),
            transport: None,
            copy_stream: CopyStream::Current,
            defer_pulls: defer_pulls_default(std::env::var(DEFER_PULLS_ENV).ok().as_deref()),
            steps: 1,
            graph: false,
            node_size: None,
            wire: WireChoice::default(),
            exit_at_comm: None,
        }
    }
}

/// The environment variable that turns [`CudaConfig::defer_pulls`] on by default.
pub(crate) const DEFER_PULLS_ENV: &str = "MESHFLOW_DEFER_PULLS";

/// [`CudaConfig::defer_pulls`] by default, given the value of [`DEFER_PULLS_ENV`].
fn defer_pulls_default(env: Option<&str>) -> bool {
    matches!(
        env.map(|v| v.trim().to_ascii_lowercase()).as_deref(),
        Some("1" | "on" | "true" | "yes")
    )
}

/// GPU resources the caller owns, for [`CudaBackend::with_resources`](super::CudaBackend::with_resources).
#[derive(Debug)]
pub struct CudaResources {
    /// The GPU (its primary context, the one the CUDA runtime and PyTorch use).
    pub device: Device,
    /// The caller's stream (see `Stream::from_raw_borrowed`): the rank's main stream, so the
    /// program runs in order with the caller's work on it. `None`: a stream of meshflow's. Runs
    /// recorded as CUDA graphs ([`CudaConfig::graph`]) need a stream that can be captured: not
    /// the legacy default stream (a caller on it forks a stream of its own from it, as the
    /// Python executor does).
    pub stream: Option<Stream>,
    /// Communicators the caller created (see `Comm::from_raw_borrowed`), each with the team it
    /// serves: the team's members (global ranks) in team order, its rank in the communicator
    /// being this rank's index there.
    pub comms: Vec<(Vec<DeviceId>, Comm)>,
}

/// A flag the ranks of one run share: set by the first rank that fails, so that the others
/// stop waiting for it (and abort their NCCL communicators) instead of hanging. Setting it also
/// raises the device abort words it watches ([`AbortSignal::watch`]), so that kernels waiting
/// for a peer give up even while their rank's host thread is blocked in a CUDA call.
#[derive(Clone, Debug, Default)]
pub struct AbortSignal {
    flag: Arc<AtomicBool>,
    first: Arc<Mutex<Option<(DeviceId, String)>>>,
    words: Arc<Mutex<Vec<AbortWord>>>,
}

impl AbortSignal {
    /// A signal that is not set.
    pub fn new() -> AbortSignal {
        AbortSignal::default()
    }

    /// Records that `rank` failed (the first report wins).
    pub fn abort(&self, rank: DeviceId, reason: impl Into<String>) {
        let mut first = self.first.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() {
            *first = Some((rank, reason.into()));
        }
        self.flag.store(true, Ordering::SeqCst);
        drop(first);
        for w in self.words.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            w.raise();
        }
    }

    /// Raises `word` when the signal is set (at once if it is set already).
    pub fn watch(&self, word: AbortWord) {
        let mut words = self.words.lock().unwrap_or_else(|p| p.into_inner());
        if self.is_aborted() {
            word.raise();
        }
        words.push(word);
    }

    /// Whether some rank failed.
    pub fn is_aborted(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// The first failure: rank and reason.
    pub fn first(&self) -> Option<(DeviceId, String)> {
        self.first.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::defer_pulls_default;

    #[test]
    fn deferral_is_off_unless_the_environment_turns_it_on() {
        assert!(!defer_pulls_default(None));
        for on in ["1", "on", "ON", "true", "yes", " 1 "] {
            assert!(defer_pulls_default(Some(on)), "{on:?}");
        }
        for off in ["0", "off", "false", "no", ""] {
            assert!(!defer_pulls_default(Some(off)), "{off:?}");
        }
    }
}
