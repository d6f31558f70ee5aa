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
    /// When a copy-engine pull whose sender's offer has not arrived at its post is deferred
    /// instead of blocking the host there (see [`DeferPulls`] and
    /// `src/runtime/cuda/deferred.rs`). Default: [`DeferPulls::BeforeCompute`], unless the
    /// environment variable `MESHFLOW_DEFER_PULLS` names another policy.
    pub defer_pulls: DeferPulls,
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
            defer_pulls: DeferPulls::from_env(std::env::var(DEFER_PULLS_ENV).ok().as_deref()),
            steps: 1,
            graph: false,
            node_size: None,
            wire: WireChoice::default(),
            exit_at_comm: None,
        }
    }
}

/// When a copy-engine pull is deferred ([`CudaConfig::defer_pulls`]): a pull whose sender's
/// offer has not arrived when it is posted either blocks the host there until the offer comes,
/// or is queued and finished later (at a `wait` on it, before any host wait that may block, or
/// when its offer is found at a later post or compute launch), so that the compute after it in
/// program order launches at once. Only pulls that need nothing after their post are ever
/// deferred (see `src/runtime/cuda/transport/copy_engine.rs`).
///
/// Measured on 2x H200 at 8192^3 with one process per GPU (`bench/results/2026-11-26-h200x2.md`):
/// deferring every pull helped AG+GEMM's prefetched ring (772.0 / 787.3 µs against 792.5 µs
/// without), whose first pull precedes the run's first compute and whose sender's offer, a TCP
/// hop away, arrives after the start barrier's skew; but it hurt GEMM+RS's accumulating ring
/// (821.7 / 836.0 µs against 776.6 µs), whose pulls follow its computes. On 2x H100 in one
/// call (`bench/results/2026-11-26-h100x2.md`), AG+GEMM / GEMM+RS: never 784.5 / 784.8 µs,
/// before the first compute 771.3 / 783.7 µs, always 787.3 / 808.2 µs.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeferPulls {
    /// Every pull blocks the host at its post until its offer is there.
    Never,
    /// Pulls posted before the run has launched its first compute op are deferred; later
    /// pulls block as with [`Never`](Self::Never). The run's first compute never waits for a
    /// peer's host, and the steady state is unchanged.
    #[default]
    BeforeCompute,
    /// Every pull whose offer has not arrived is deferred.
    Always,
}

impl DeferPulls {
    /// The policy named `text`: `never` (or `0`, `off`, `false`, `no`), `before-compute`, or
    /// `always` (or `1`, `on`, `true`, `yes`); case and surrounding blanks do not matter.
    pub fn parse(text: &str) -> Option<DeferPulls> {
        match text.trim().to_ascii_lowercase().as_str() {
            "never" | "0" | "off" | "false" | "no" => Some(DeferPulls::Never),
            "before-compute" => Some(DeferPulls::BeforeCompute),
            "always" | "1" | "on" | "true" | "yes" => Some(DeferPulls::Always),
            _ => None,
        }
    }

    /// The policy of [`DEFER_PULLS_ENV`]'s value `env`: the default when it is unset, and (with
    /// a warning) when it names no policy.
    pub(crate) fn from_env(env: Option<&str>) -> DeferPulls {
        let Some(text) = env else {
            return DeferPulls::default();
        };
        DeferPulls::parse(text).unwrap_or_else(|| {
            tracing::warn!(
                "{DEFER_PULLS_ENV}={text:?} names no policy (never, before-compute, always): \
                 using {:?}",
                DeferPulls::default()
            );
            DeferPulls::default()
        })
    }

    /// Whether a pull posted now is deferred when its offer is missing, `computed` saying
    /// whether the run has launched a compute op yet.
    pub(crate) fn defers(self, computed: bool) -> bool {
        match self {
            DeferPulls::Never => false,
            DeferPulls::BeforeCompute => !computed,
            DeferPulls::Always => true,
        }
    }
}

/// The environment variable that sets [`CudaConfig::defer_pulls`] by default.
pub(crate) const DEFER_PULLS_ENV: &str = "MESHFLOW_DEFER_PULLS";

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
    use super::DeferPulls;

    #[test]
    fn the_environment_names_the_deferral_policy() {
        assert_eq!(DeferPulls::from_env(None), DeferPulls::BeforeCompute);
        for on in ["1", "on", "ON", "true", "yes", " 1 ", "always"] {
            assert_eq!(DeferPulls::from_env(Some(on)), DeferPulls::Always, "{on:?}");
        }
        for off in ["0", "off", "false", "no", "Never"] {
            assert_eq!(
                DeferPulls::from_env(Some(off)),
                DeferPulls::Never,
                "{off:?}"
            );
        }
        assert_eq!(
            DeferPulls::from_env(Some(" before-compute ")),
            DeferPulls::BeforeCompute
        );
        // A value that names nothing keeps the default (with a warning).
        for junk in ["", "sometimes"] {
            assert_eq!(DeferPulls::parse(junk), None, "{junk:?}");
            assert_eq!(DeferPulls::from_env(Some(junk)), DeferPulls::default());
        }
    }

    #[test]
    fn before_compute_defers_only_until_the_first_compute() {
        assert!(DeferPulls::BeforeCompute.defers(false));
        assert!(!DeferPulls::BeforeCompute.defers(true));
        assert!(DeferPulls::Always.defers(true) && DeferPulls::Always.defers(false));
        assert!(!DeferPulls::Never.defers(true) && !DeferPulls::Never.defers(false));
    }
}
