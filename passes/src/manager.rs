//! The pass manager: runs an ordered list of passes over a level-1 program, through the phase
//! change, over the host program; verifies between passes, dumps IR on request, times every
//! pass (a `tracing` span per pass, plus [`PassTiming`]s in the result) and skips disabled
//! passes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use meshflow_ir::{verify_host, verify_program, HostProgram, LoopVar, Program};

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

/// State shared by the passes of one compilation.
#[derive(Clone, Debug)]
pub struct PassContext {
    /// Size of the worker stream pool (at least 1).
    pub num_streams: usize,
    /// Names of the tensors the user annotated (a schedule, possibly empty). Passes never
    /// change these shardings.
    pub annotated: BTreeSet<String>,
    /// Forced decompositions, by the name of the tensor whose schedule the decision sets (the
    /// gathered tensor of an all-gather, the partial sums of a reduce-scatter).
    pub decompositions: BTreeMap<String, Decomposition>,
    /// The cost model of `choose_decompositions`.
    pub cost_model: CostModel,
    /// Decisions taken, for `--explain`.
    pub explain: Vec<ExplainRecord>,
    /// How stream loops place their transfers and compute on streams.
    pub stream_schedule: StreamSchedule,
    /// The plan `choose_decompositions` took for each decision, by the same tensor names as
    /// [`PassContext::decompositions`]; `lower_to_host` follows them.
    pub plans: BTreeMap<String, Plan>,
    /// Stream loops (of the host program as `lower_to_host` emits it) that
    /// `prefetch_transfers` reschedules.
    pub prefetch_loops: BTreeSet<LoopVar>,
    /// The transport the plans assume (`None` until `choose_decompositions` ran); the GPU
    /// runtime moves the bytes over it.
    pub transport: Option<Transport>,
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

impl PassContext {
    /// A context for compiling `program`: its annotated tensors are recorded.
    pub fn new(program: &Program) -> PassContext {
        PassContext {
            num_streams: 2,
            annotated: program
                .tensors
                .values()
                .filter(|t| t.schedule.is_some())
                .map(|t| t.name.clone())
                .collect(),
            decompositions: BTreeMap::new(),
            cost_model: CostModel::default(),
            explain: Vec::new(),
            stream_schedule: StreamSchedule::default(),
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

/// A level-1 to level-1 pass.
pub trait ProgramPass {
    /// The pass's name (a verb phrase in snake case).
    fn name(&self) -> &'static str;
    /// Why the pass cannot be disabled, if it cannot.
    fn required(&self) -> Option<&'static str> {
        None
    }
    /// Runs the pass.
    fn run(&self, program: &mut Program, cx: &mut PassContext) -> Result<(), PassError>;
}

/// The phase change: level 1 to host IR.
pub trait LowerPass {
    /// The pass's name.
    fn name(&self) -> &'static str;
    /// Runs the pass.
    fn run(&self, program: &Program, cx: &mut PassContext) -> Result<HostProgram, PassError>;
}

/// A host to host pass.
pub trait HostPass {
    /// The pass's name.
    fn name(&self) -> &'static str;
    /// Why the pass cannot be disabled, if it cannot.
    fn required(&self) -> Option<&'static str> {
        None
    }
    /// Runs the pass.
    fn run(&self, host: &mut HostProgram, cx: &mut PassContext) -> Result<(), PassError>;
}

/// One entry of the pass list.
pub enum Pass {
    /// A level-1 pass.
    Program(Box<dyn ProgramPass>),
    /// The phase change.
    Lower(Box<dyn LowerPass>),
    /// A host pass.
    Host(Box<dyn HostPass>),
}

impl Pass {
    /// The pass's name.
    pub fn name(&self) -> &'static str {
        match self {
            Pass::Program(p) => p.name(),
            Pass::Lower(p) => p.name(),
            Pass::Host(p) => p.name(),
        }
    }

    /// Why the pass cannot be disabled, if it cannot.
    pub fn required(&self) -> Option<&'static str> {
        match self {
            Pass::Program(p) => p.required(),
            Pass::Lower(_) => Some("it is the phase change from level 1 to the host IR"),
            Pass::Host(p) => p.required(),
        }
    }
}

/// Which passes' output to dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DumpAfter {
    /// After every pass.
    All,
    /// After the named pass.
    Pass(String),
}

/// The wall time of one pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassTiming {
    /// The pass.
    pub pass: &'static str,
    /// Wall time (zero when skipped).
    pub wall: Duration,
    /// False when the pass was disabled.
    pub ran: bool,
}

/// The IR printed after a pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dump {
    /// The pass.
    pub after: &'static str,
    /// The printed IR (level 1 or host).
    pub text: String,
}

/// What a run of the pass manager produces.
#[derive(Clone, Debug)]
pub struct PassOutput {
    /// The level-1 program as it entered the phase change.
    pub program: Program,
    /// The host program.
    pub host: HostProgram,
    /// One entry per pass, in order.
    pub timings: Vec<PassTiming>,
    /// Requested dumps, in order.
    pub dumps: Vec<Dump>,
}

/// Runs passes in order (see the module docs).
pub struct PassManager {
    passes: Vec<Pass>,
    verify: bool,
    dump_after: Option<DumpAfter>,
    disabled: BTreeSet<&'static str>,
}

impl PassManager {
    /// A manager for `passes`. Verification between passes is on in debug builds.
    pub fn new(passes: Vec<Pass>) -> PassManager {
        PassManager {
            passes,
            verify: cfg!(debug_assertions),
            dump_after: None,
            disabled: BTreeSet::new(),
        }
    }

    /// Turns verification after each pass on or off.
    pub fn with_verify(mut self, verify: bool) -> PassManager {
        self.verify = verify;
        self
    }

    /// The pass names, in order.
    pub fn pass_names(&self) -> Vec<&'static str> {
        self.passes.iter().map(Pass::name).collect()
    }

    fn find(&self, name: &str) -> Result<&Pass, PassError> {
        self.passes
            .iter()
            .find(|p| p.name() == name)
            .ok_or_else(|| PassError::UnknownPass {
                name: name.to_string(),
                valid: self.pass_names().join(", "),
            })
    }

    /// Dumps the IR after the pass called `which`, or after every pass for `all`.
    pub fn dump_after(&mut self, which: &str) -> Result<(), PassError> {
        self.dump_after = Some(if which == "all" {
            DumpAfter::All
        } else {
            DumpAfter::Pass(self.find(which)?.name().to_string())
        });
        Ok(())
    }

    /// Disables the pass called `name`.
    pub fn disable(&mut self, name: &str) -> Result<(), PassError> {
        let pass = self.find(name)?;
        if let Some(reason) = pass.required() {
            return Err(PassError::CannotDisable {
                name: name.to_string(),
                reason: reason.to_string(),
            });
        }
        let name = pass.name();
        self.disabled.insert(name);
        Ok(())
    }

    fn wants_dump(&self, pass: &str) -> bool {
        match &self.dump_after {
            Some(DumpAfter::All) => true,
            Some(DumpAfter::Pass(p)) => p == pass,
            None => false,
        }
    }

    /// Runs every enabled pass.
    pub fn run(&self, program: Program, cx: &mut PassContext) -> Result<PassOutput, PassError> {
        let mut program = program;
        let mut host: Option<HostProgram> = None;
        let mut timings = Vec::with_capacity(self.passes.len());
        let mut dumps = Vec::new();
        for pass in &self.passes {
            let name = pass.name();
            if self.disabled.contains(name) {
                tracing::debug!(pass = name, "pass disabled");
                timings.push(PassTiming {
                    pass: name,
                    wall: Duration::ZERO,
                    ran: false,
                });
                continue;
            }
            let span = tracing::info_span!("pass", name, wall_us = tracing::field::Empty);
            let _entered = span.enter();
            let start = Instant::now();
            match (pass, host.as_mut()) {
                (Pass::Program(p), None) => p.run(&mut program, cx)?,
                (Pass::Lower(p), None) => host = Some(p.run(&program, cx)?),
                (Pass::Host(p), Some(h)) => p.run(h, cx)?,
                (Pass::Program(_) | Pass::Lower(_), Some(_)) => {
                    return Err(PassError::internal(
                        name,
                        "a level-1 pass is listed after the phase change",
                    ))
                }
                (Pass::Host(_), None) => {
                    return Err(PassError::internal(
                        name,
                        "a host pass is listed before the phase change",
                    ))
                }
            }
            let wall = start.elapsed();
            span.record("wall_us", wall.as_micros() as u64);
            tracing::debug!(wall_us = wall.as_micros() as u64, "pass finished");
            timings.push(PassTiming {
                pass: name,
                wall,
                ran: true,
            });
            if self.verify {
                let result = match &host {
                    None => verify_program(&program),
                    Some(h) => verify_host(h),
                };
                result.map_err(|errors| PassError::Verify {
                    pass: name.to_string(),
                    errors,
                })?;
            }
            if self.wants_dump(name) {
                let text = match &host {
                    None => program.to_string(),
                    Some(h) => h.to_string(),
                };
                dumps.push(Dump { after: name, text });
            }
        }
        let host = host.ok_or_else(|| {
            PassError::internal(
                "pass_manager",
                "the pass list has no lowering to the host IR",
            )
        })?;
        Ok(PassOutput {
            program,
            host,
            timings,
            dumps,
        })
    }
}
