//! What a compilation is asked to do ([`PassOptions`]) and the state its passes share
//! ([`PassContext`], which borrows the options).

use std::collections::{BTreeMap, BTreeSet};

use meshflow_ir::{LoopVar, Program};

use crate::cost_model::CostModel;
use crate::error::PassError;
use crate::explain::ExplainRecord;
use crate::plan::Plan;
use crate::Transport;

/// How a resharding is decomposed (see `choose_decompositions` and `docs/schedule-search.md`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Decomposition {
    /// One collective (e.g. one `all_gather`, one `reduce_scatter`).
    Collective,
    /// All-gather: a stream loop of broadcasts, rooted at the loop index.
    StreamBroadcast,
    /// Reduce-scatter: a stream loop of reduces, rooted at the loop index (the dual of
    /// [`Decomposition::StreamBroadcast`]).
    StreamReduce,
    /// All-gather: a stream loop of collective permutes to distance `i` at step `i` (from
    /// `swizzle1d`; step 0 is the rank's own chunk).
    Ring,
    /// A ring of neighbours: every step sends to rank + 1 what arrived from rank − 1 (all-gather:
    /// the chunk received the step before; reduce-scatter: the running sum of one chunk, to which
    /// each rank adds its partial product).
    RingForward,
    /// All-gather: a neighbour ring in both directions, half of every chunk each way.
    RingBidirectional,
}

impl Decomposition {
    /// Every variant, in a fixed order (simplest first).
    pub const ALL: [Decomposition; 6] = [
        Decomposition::Collective,
        Decomposition::StreamBroadcast,
        Decomposition::StreamReduce,
        Decomposition::Ring,
        Decomposition::RingForward,
        Decomposition::RingBidirectional,
    ];

    /// The name used in options and explain output.
    pub fn name(self) -> &'static str {
        match self {
            Decomposition::Collective => "collective",
            Decomposition::StreamBroadcast => "broadcast",
            Decomposition::StreamReduce => "reduce",
            Decomposition::Ring => "ring",
            Decomposition::RingForward => "ring_forward",
            Decomposition::RingBidirectional => "ring_bidirectional",
        }
    }
}

impl std::str::FromStr for Decomposition {
    type Err = PassError;
    fn from_str(s: &str) -> Result<Decomposition, PassError> {
        Decomposition::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Decomposition::ALL.iter().map(|d| d.name()).collect();
                PassError::Options(format!(
                    "unknown decomposition `{s}` (expected one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// How the iterations of a stream loop (transfer a chunk, compute on it) use streams.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StreamSchedule {
    /// Chosen per loop by `choose_decompositions` (the schedule of least predicted time).
    #[default]
    Auto,
    /// Every iteration on its own worker stream, round robin over the pool (nvFuser's
    /// schedule; `assign_streams`): iteration i + 1's transfer overlaps iteration i's compute
    /// on another stream.
    PerIteration,
    /// Compute on the main stream, collective permutes one iteration ahead on a worker stream
    /// (`prefetch_transfers`), for ring loops that move one chunk per iteration into its own
    /// slot; a ring whose first transfer is the rank's own chunk computes that chunk straight
    /// from the input. Other loops as [`StreamSchedule::PerIteration`].
    Prefetch,
}

impl StreamSchedule {
    /// The name used in options and explain output.
    pub fn name(self) -> &'static str {
        match self {
            StreamSchedule::Auto => "auto",
            StreamSchedule::PerIteration => "per-iteration",
            StreamSchedule::Prefetch => "prefetch",
        }
    }
}

/// The options of one compilation: what the passes read (through [`PassContext::options`])
/// and what the pass manager does around them.
#[derive(Clone, Debug, PartialEq)]
pub struct PassOptions {
    /// Size of the worker stream pool (default 2, at least 1).
    pub num_streams: usize,
    /// Passes to skip, by name.
    pub disabled_passes: Vec<String>,
    /// Dump the IR after this pass (or `all`).
    pub dump_after: Option<String>,
    /// Verify after every pass (default: on in debug builds).
    pub verify: bool,
    /// Forced decompositions, by the name of the tensor whose schedule the decision sets (the
    /// gathered tensor of an all-gather, the partial sums of a reduce-scatter).
    pub decompositions: BTreeMap<String, Decomposition>,
    /// Forced pieces per step of the reduce-scatter ring (`ring_forward` of partial sums: each
    /// step's compute and add cut into this many row pieces), by the same tensor names as
    /// [`PassOptions::decompositions`]; the search keeps only the plans with that many pieces.
    pub pieces: BTreeMap<String, u64>,
    /// Forces the reduce-scatter ring of running sums to accumulate in place or not
    /// ([`Plan::accumulate`](crate::Plan::accumulate)), by the same tensor names as
    /// [`PassOptions::decompositions`]: `true` leaves only the ring accumulating in place (an
    /// error where it does not apply), `false` drops it from the search.
    pub accumulate: BTreeMap<String, bool>,
    /// The cost model of `choose_decompositions`: the machine profile, and a transport to force.
    pub cost_model: CostModel,
    /// How stream loops use the stream pool (default: chosen per loop by the schedule search).
    pub stream_schedule: StreamSchedule,
    /// Merge consecutive collectives of a planned resharding into one over a flattened team
    /// (`all_gather` of `[S0, S0] -> [R, R]` over `flattened(m, DIDy, DIDx)`; default on), as
    /// DTensor does over a user-created flattened mesh. Off, every step is one collective over
    /// one mesh axis (DTensor without a flattened mesh).
    pub merge_collectives: bool,
}

impl Default for PassOptions {
    fn default() -> PassOptions {
        PassOptions {
            num_streams: 2,
            disabled_passes: Vec::new(),
            dump_after: None,
            verify: cfg!(debug_assertions),
            decompositions: BTreeMap::new(),
            pieces: BTreeMap::new(),
            accumulate: BTreeMap::new(),
            cost_model: CostModel::default(),
            stream_schedule: StreamSchedule::default(),
            merge_collectives: true,
        }
    }
}

impl PassOptions {
    /// Checks the values no pass list is needed for (pass names are checked by the
    /// [`PassManager`](crate::PassManager)).
    pub fn validate(&self) -> Result<(), PassError> {
        if self.num_streams == 0 {
            return Err(PassError::Options(
                "the worker stream pool (--streams) must hold at least 1 stream".into(),
            ));
        }
        if let Some((name, _)) = self.pieces.iter().find(|(_, &p)| p == 0) {
            return Err(PassError::Options(format!(
                "`{name}`: the pieces per ring step (--pieces) must be at least 1"
            )));
        }
        Ok(())
    }
}

/// State shared by the passes of one compilation.
#[derive(Clone, Debug)]
pub struct PassContext<'o> {
    /// The compilation's options, borrowed.
    pub options: &'o PassOptions,
    /// Names of the tensors the user annotated (a schedule, possibly empty). Passes never
    /// change these shardings.
    pub annotated: BTreeSet<String>,
    /// Decisions taken, for `--explain`.
    pub explain: Vec<ExplainRecord>,
    /// The plan `choose_decompositions` took for each decision, by the same tensor names as
    /// [`PassOptions::decompositions`]; `lower_to_host` follows them.
    pub plans: BTreeMap<String, Plan>,
    /// Stream loops (of the host program as `lower_to_host` emits it) that
    /// `prefetch_transfers` reschedules.
    pub prefetch_loops: BTreeSet<LoopVar>,
    /// The transport the plans assume (`None` until `choose_decompositions` ran); the GPU
    /// runtime moves the bytes over it.
    pub transport: Option<Transport>,
}

impl<'o> PassContext<'o> {
    /// A context for compiling `program` with `options`: its annotated tensors are recorded.
    pub fn new(program: &Program, options: &'o PassOptions) -> PassContext<'o> {
        PassContext {
            options,
            annotated: program
                .tensors
                .values()
                .filter(|t| t.schedule.is_some())
                .map(|t| t.name.clone())
                .collect(),
            explain: Vec::new(),
            plans: BTreeMap::new(),
            prefetch_loops: BTreeSet::new(),
            transport: None,
        }
    }

    /// True when the user annotated the tensor called `name`.
    pub fn is_annotated(&self, name: &str) -> bool {
        self.annotated.contains(name)
    }
}
