//! THE ordered list of passes, and [`compile`].
//!
//! | # | pass | level | what it does |
//! |---|---|---|---|
//! | 1 | `verify_program` | 1 | rejects invalid input (cannot be disabled) |
//! | 2 | `propagate_shardings` | 1 | fills in unannotated schedules (weights first, then backward) |
//! | 3 | `decompose_reshardings` | 1 | rfactors partial-sum outputs; inserts `set`s so each resharding is one decision-table row |
//! | 4 | `choose_decompositions` | 1 | the schedule search: decomposition, chunks, stream schedule and transport of least predicted time (machine profile) |
//! | 5 | `lower_to_host` | 1 -> host | stream loops, communications, compute (cannot be disabled) |
//! | 6 | `prefetch_transfers` | host | ring loops planned (or forced) with the prefetch schedule: transfers one iteration ahead on a worker, compute on the main stream |
//! | 7 | `simplify_indices` | host | egg: affine-mod canonical index expressions; proves ring peers inverse |
//! | 8 | `assign_streams` | host | worker-stream pool around loops with communication and compute |
//! | 9 | `insert_allocations` | host | allocate/deallocate at the dominating block |
//! | 10 | `defer_waits` | host | waits just before first use; ring buffers for per-iteration temporaries |
//! | 11 | `verify_host` | host | checks the result (cannot be disabled) |
//!
//! `choose_decompositions` runs at level 1 (after the decomposition, before lowering, unlike
//! DESIGN.md's sketch) because what it decides is a schedule: the Stream split (and swizzle)
//! of a resharding's output, which the lowering then turns into a loop. `simplify_indices`
//! runs right after lowering so later passes see canonical indices, and `assign_streams` runs
//! before `insert_allocations` so buffers are allocated outside the fork/join of a loop.

use std::collections::BTreeMap;

use meshflow_ir::{HostProgram, Program};
use meshflow_passes::passes::{
    AssignStreams, ChooseDecompositions, DecomposeReshardings, DeferWaits, InsertAllocations,
    LowerToHost, PrefetchTransfers, PropagateShardings, SimplifyIndices, VerifyHost, VerifyProgram,
};
pub use meshflow_passes::StreamSchedule;
use meshflow_passes::{
    CostModel, Decomposition, Dump, ExplainRecord, Pass, PassContext, PassError, PassManager,
    PassTiming, Plan, Transport,
};

/// The passes, in order.
pub fn passes() -> Vec<Pass> {
    vec![
        Pass::Program(Box::new(VerifyProgram)),
        Pass::Program(Box::new(PropagateShardings)),
        Pass::Program(Box::new(DecomposeReshardings)),
        Pass::Program(Box::new(ChooseDecompositions)),
        Pass::Lower(Box::new(LowerToHost)),
        Pass::Host(Box::new(PrefetchTransfers)),
        Pass::Host(Box::new(SimplifyIndices)),
        Pass::Host(Box::new(AssignStreams)),
        Pass::Host(Box::new(InsertAllocations)),
        Pass::Host(Box::new(DeferWaits)),
        Pass::Host(Box::new(VerifyHost)),
    ]
}

/// The pass names, in order.
pub fn pass_names() -> Vec<&'static str> {
    passes().iter().map(Pass::name).collect()
}

/// Options of [`compile`].
#[derive(Clone, Debug, PartialEq)]
pub struct CompileOptions {
    /// Size of the worker stream pool (default 2).
    pub num_streams: usize,
    /// Passes to skip, by name.
    pub disabled_passes: Vec<String>,
    /// Dump the IR after this pass (or `all`).
    pub dump_after: Option<String>,
    /// Verify after every pass (default: on in debug builds).
    pub verify: bool,
    /// Forced decompositions, by the name of the resharding's output tensor.
    pub decompositions: BTreeMap<String, Decomposition>,
    /// The cost model of `choose_decompositions`: the machine profile, and a transport to force.
    pub cost_model: CostModel,
    /// How stream loops use the stream pool (default: chosen per loop by the schedule search).
    pub stream_schedule: StreamSchedule,
}

impl Default for CompileOptions {
    fn default() -> CompileOptions {
        CompileOptions {
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

/// What [`compile`] produces.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The level-1 program after propagation, decomposition and choices (what was lowered).
    pub program: Program,
    /// The host program.
    pub host: HostProgram,
    /// Wall time of every pass, in order.
    pub timings: Vec<PassTiming>,
    /// The decisions of `choose_decompositions` (printed by `--explain`).
    pub explain: Vec<ExplainRecord>,
    /// The plan of each decision, by the name of the tensor it is about.
    pub plans: BTreeMap<String, Plan>,
    /// The transport the plans assume (`None` when the program has no priced decision); the GPU
    /// runtime should move the bytes over it.
    pub transport: Option<Transport>,
    /// IR dumps requested with `dump_after`.
    pub dumps: Vec<Dump>,
}

/// Why [`compile`] failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineError {
    /// A pass (or the pass manager) failed.
    #[error(transparent)]
    Pass(#[from] PassError),
}

/// A machine profile by built-in name (`h200x2`, `h100x2`) or JSON file path.
pub fn load_profile(name_or_path: &str) -> Result<meshflow_passes::Profile, PipelineError> {
    if meshflow_passes::profile::BUILTIN.contains(&name_or_path) {
        return Ok(meshflow_passes::Profile::builtin(name_or_path)?);
    }
    let text = std::fs::read_to_string(name_or_path).map_err(|e| {
        PassError::Options(format!(
            "profile `{name_or_path}` is neither a built-in profile ({}) nor a readable file: {e}",
            meshflow_passes::profile::BUILTIN.join(", ")
        ))
    })?;
    Ok(meshflow_passes::Profile::from_json(&text)?)
}

/// Runs the pipeline on `program`.
pub fn compile(program: &Program, options: &CompileOptions) -> Result<Compiled, PipelineError> {
    if options.num_streams == 0 {
        return Err(PassError::Options("--streams must be at least 1".into()).into());
    }
    let mut manager = PassManager::new(passes()).with_verify(options.verify);
    for name in &options.disabled_passes {
        manager.disable(name)?;
    }
    if let Some(which) = &options.dump_after {
        manager.dump_after(which)?;
    }
    let mut cx = PassContext::new(program);
    cx.num_streams = options.num_streams;
    cx.decompositions = options.decompositions.clone();
    cx.cost_model = options.cost_model.clone();
    cx.stream_schedule = options.stream_schedule;
    let out = manager.run(program.clone(), &mut cx)?;
    Ok(Compiled {
        program: out.program,
        host: out.host,
        timings: out.timings,
        explain: cx.explain,
        plans: cx.plans,
        transport: cx.transport,
        dumps: out.dumps,
    })
}
