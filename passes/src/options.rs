//! What a compilation is asked to do ([`PassOptions`]) and the state its passes share
//! ([`PassContext`], which borrows the options).

use std::collections::{BTreeMap, BTreeSet};

use meshflow_ir::Program;

use crate::cost_model::CostModel;
use crate::error::PassError;
use crate::explain::ExplainRecord;

/// How a resharding into an unannotated tensor is decomposed (see `choose_decompositions`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Decomposition {
    /// One collective (e.g. one `all_gather`).
    Collective,
    /// A stream loop of broadcasts, rooted at the loop index.
    StreamBroadcast,
    /// A stream loop of collective permutes (a ring, from `swizzle1d`).
    Ring,
}

impl Decomposition {
    /// Every variant, in a fixed order.
    pub const ALL: [Decomposition; 3] = [
        Decomposition::Collective,
        Decomposition::StreamBroadcast,
        Decomposition::Ring,
    ];

    /// The name used in options and explain output.
    pub fn name(self) -> &'static str {
        match self {
            Decomposition::Collective => "collective",
            Decomposition::StreamBroadcast => "broadcast",
            Decomposition::Ring => "ring",
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
                PassError::Options(format!(
                    "unknown decomposition `{s}` (expected collective, broadcast or ring)"
                ))
            })
    }
}

/// How the iterations of a stream loop (transfer a chunk, compute on it) use streams.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum StreamSchedule {
    /// Every iteration on its own worker stream, round robin over the pool (nvFuser's
    /// schedule; `assign_streams`): iteration i + 1's transfer overlaps iteration i's compute
    /// on another stream.
    #[default]
    PerIteration,
    /// Compute on the main stream, collective permutes one iteration ahead on a worker stream
    /// (`prefetch_transfers`), for ring loops that move one chunk per iteration into its own
    /// slot; a ring whose first transfer is the rank's own chunk computes that chunk straight
    /// from the input. Other loops as [`StreamSchedule::PerIteration`].
    Prefetch,
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
    /// Forced decompositions, by the name of the resharding's output tensor.
    pub decompositions: BTreeMap<String, Decomposition>,
    /// The cost model of `choose_decompositions`.
    pub cost_model: CostModel,
    /// How stream loops use the stream pool (default: one worker per iteration, as nvFuser).
    pub stream_schedule: StreamSchedule,
}

impl Default for PassOptions {
    fn default() -> PassOptions {
        PassOptions {
            num_streams: 2,
            disabled_passes: Vec::new(),
            dump_after: None,
            verify: cfg!(debug_assertions),
            decompositions: BTreeMap::new(),
            cost_model: CostModel::default(),
            stream_schedule: StreamSchedule::default(),
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
        }
    }

    /// True when the user annotated the tensor called `name`.
    pub fn is_annotated(&self, name: &str) -> bool {
        self.annotated.contains(name)
    }
}
