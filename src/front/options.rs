//! [`Options`] of [`compile`](super::compile) and [`parse`].

use std::time::Duration;

use meshflow_ir::{parse_program_with, Params, Program};
use meshflow_kernels::proxy::WireChoice;
use meshflow_passes::{CostModel, Decomposition, Profile, Transport};

use super::agree;
use crate::error::Error;
use crate::pipeline::{choose_profile, PassOptions, ProfileChoice, StreamSchedule};
use crate::runtime::rendezvous::Rendezvous;

/// How to compile: the job's size, pass-list changes, the worker-stream count, decomposition
/// and transport choices, and whether to run the static cross-rank check.
///
/// ```
/// use meshflow::{Decomposition, Options};
///
/// let options = Options::for_ranks(8)
///     .streams(3)
///     .decomposition("ag", Decomposition::Ring)
///     .disable_pass("defer_waits");
/// assert_eq!(options.ranks(), Some(8));
/// assert_eq!(options.pass_options().num_streams, 3);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    ranks: Option<usize>,
    params: Params,
    passes: PassOptions,
    check: bool,
    graph: bool,
    wire: Option<WireChoice>,
    /// Why the cost model has its profile ([`ProfileChoice::reason`]).
    profile_reason: String,
    /// True once a profile was given ([`Options::profile`], [`Options::cost_model`]): a GPU
    /// named with [`Options::device`] then changes nothing.
    profile_given: bool,
    /// The GPU model named with [`Options::device`], if any.
    device: Option<String>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            ranks: None,
            params: Params::new(),
            passes: PassOptions::default(),
            check: true,
            graph: false,
            wire: None,
            profile_reason: ProfileChoice::unknown_target().reason,
            profile_given: false,
            device: None,
        }
    }
}

impl Options {
    /// The defaults: the program's own world size, 2 worker streams, every pass, decompositions,
    /// stream schedules and the transport chosen by the schedule search on the built-in `h200x2`
    /// profile (see [`Options::device`] for GPUs of another model), the cross-rank check on.
    pub fn new() -> Options {
        Options::default()
    }

    /// Options for a job of `ranks` ranks: [`parse`] sets the program's `ranks` parameter
    /// (when it declares one), and [`compile`](super::compile) fails with
    /// [`Error::WorldSize`] when the program's meshes span more ranks. Ranks the meshes do not
    /// cover hold nothing and run an empty program.
    pub fn for_ranks(ranks: usize) -> Options {
        Options {
            ranks: Some(ranks),
            ..Options::default()
        }
    }

    /// The parameters set with [`Options::param`].
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// Sets the job's size, as [`Options::for_ranks`] does.
    pub fn with_ranks(mut self, ranks: usize) -> Options {
        self.ranks = Some(ranks);
        self
    }

    /// The job's size, when set.
    pub fn ranks(&self) -> Option<usize> {
        self.ranks
    }

    /// Overrides a `param` of program text read by [`parse`].
    pub fn param(mut self, name: impl Into<String>, value: i64) -> Options {
        self.params.insert(name.into(), value);
        self
    }

    /// The size of the worker-stream pool the host program uses (`assign_streams`; default 2,
    /// at least 1).
    pub fn streams(mut self, streams: usize) -> Options {
        self.passes.num_streams = streams;
        self
    }

    /// How stream loops use the worker streams (default: one worker per iteration, as
    /// nvFuser; [`StreamSchedule::Prefetch`]: ring
    /// loops compute on the main stream with each permute one iteration ahead on a worker).
    pub fn stream_schedule(mut self, schedule: StreamSchedule) -> Options {
        self.passes.stream_schedule = schedule;
        self
    }

    /// Skips a pass by name (see [`pass_names`](crate::pipeline::pass_names); the verifiers
    /// and `lower_to_host` cannot be disabled).
    pub fn disable_pass(mut self, name: impl Into<String>) -> Options {
        self.passes.disabled_passes.push(name.into());
        self
    }

    /// Forces how the resharding decided by the level-1 tensor `tensor` (the gathered tensor of
    /// an all-gather, the partial sums of a reduce-scatter) is decomposed — one collective, a
    /// stream loop of broadcasts or reduces, a distance, forwarding or bidirectional ring —
    /// instead of letting the schedule search choose.
    pub fn decomposition(mut self, tensor: impl Into<String>, how: Decomposition) -> Options {
        self.passes.decompositions.insert(tensor.into(), how);
        self
    }

    /// Forces the pieces per step of the reduce-scatter ring of the partial sums `tensor`
    /// (`ring_forward`: each step's GEMM and add cut into `pieces` row pieces, the add of a
    /// piece running under the GEMM of the next) instead of letting the schedule search choose.
    pub fn pieces(mut self, tensor: impl Into<String>, pieces: u64) -> Options {
        self.passes.pieces.insert(tensor.into(), pieces);
        self
    }

    /// Forces whether the reduce-scatter ring of the partial sums `tensor` accumulates in place
    /// (`on`: the running sum lands in the step's accumulator and the chunk GEMM adds onto it,
    /// `linear_accumulate`; only where the partial sums come from a `linear` read by the
    /// reduce-scatter alone, all of one dtype) or adds separately (`off`), instead of letting
    /// the schedule search choose. `on` leaves only the accumulating ring.
    pub fn accumulate(mut self, tensor: impl Into<String>, on: bool) -> Options {
        self.passes.accumulate.insert(tensor.into(), on);
        self
    }

    /// Forces the transport the plans assume (and the GPU runtime uses) instead of letting
    /// the schedule search pick it.
    pub fn transport(mut self, transport: Transport) -> Options {
        self.passes.cost_model.transport = Some(transport);
        self
    }

    /// The machine profile the schedule search prices plans with (default: the built-in
    /// profile of the GPU named with [`Options::device`], else the built-in `h200x2`; see
    /// [`Profile::builtin`] and [`Profile::from_json`]). A given profile wins over the GPU.
    pub fn profile(self, profile: Profile) -> Options {
        self.profile_choice(choose_profile(Some(profile), None), true)
    }

    /// The GPU model the program will run on, as the driver names it (`NVIDIA H100 80GB
    /// HBM3`; `meshflow::kernels::Device::name`): unless a profile was given
    /// ([`Options::profile`], before or after), plans are priced with the built-in profile of
    /// that model, or the default `h200x2` when no built-in profile describes it
    /// ([`choose_profile`]). `meshflow run --backend cuda` names the GPU it runs on.
    pub fn device(mut self, name: &str) -> Options {
        self.device = Some(name.to_string());
        if self.profile_given {
            return self;
        }
        self.profile_choice(choose_profile(None, Some(name)), false)
    }

    /// The GPU model named with [`Options::device`], if any.
    pub fn device_name(&self) -> Option<&str> {
        self.device.as_deref()
    }

    /// The machine profile rank `rank` would price its plans with on its own, as it publishes
    /// it to agree with the other ranks ([`agree_profile`](agree::agree_profile)).
    pub fn profile_claim(&self, rank: usize) -> agree::ProfileClaim {
        agree::ProfileClaim {
            rank,
            given: self.profile_given,
            device: self.device.clone(),
            reason: self.profile_reason.clone(),
            profile: self.passes.cost_model.profile.clone(),
        }
    }

    /// Agrees on the machine profile with the other ranks of a job of `world` ranks whose
    /// processes each lower the program themselves (`meshflow launch`, torchrun, several
    /// nodes), meeting at `rendezvous`; call it on every rank before [`compile`](super::compile)
    /// (see [`agree`]). Ranks whose GPU models differ take rank 0's profile (the ranks that
    /// switch log a warning naming both GPU models and profiles, and
    /// [`Options::profile_reason`] says so); a profile given to some ranks wins; ranks given
    /// different profiles all fail with [`Error::Agreement`] naming them. The agreed profile
    /// then counts as given ([`Options::device`] changes nothing any more). Waits up to
    /// `timeout` for the other ranks.
    pub fn agree_profile(
        self,
        rendezvous: &dyn Rendezvous,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Options, Error> {
        let mine = self.profile_claim(rank);
        let agreed = agree::agree_profile(rendezvous, &mine, world, timeout)?;
        Ok(self.agreed_profile(&mine, agreed))
    }

    /// Prices with `agreed` (the claim the ranks agreed on; `mine` is this rank's own).
    fn agreed_profile(self, mine: &agree::ProfileClaim, agreed: agree::ProfileClaim) -> Options {
        let reason = match agree::switch_warning(mine, &agreed) {
            None => agreed.reason,
            Some(warning) => {
                tracing::warn!("{warning}");
                format!(
                    "{}, rank {}'s, which every rank takes (this rank's own: {})",
                    agreed.reason, agreed.rank, mine.reason
                )
            }
        };
        self.profile_choice(
            ProfileChoice {
                profile: agreed.profile,
                reason,
            },
            true,
        )
    }

    fn profile_choice(mut self, choice: ProfileChoice, given: bool) -> Options {
        self.passes.cost_model.profile = choice.profile;
        self.profile_reason = choice.reason;
        self.profile_given |= given;
        self
    }

    /// Why plans are priced with the profile they are (`h100x2: built-in profile of NVIDIA
    /// H100 80GB HBM3`; see [`ProfileChoice::reason`]).
    pub fn profile_reason(&self) -> &str {
        &self.profile_reason
    }

    /// The whole cost model of `choose_decompositions` (its profile counts as given).
    pub fn cost_model(self, model: CostModel) -> Options {
        let CostModel { profile, transport } = model;
        let mut o = self.profile(profile);
        o.passes.cost_model.transport = transport;
        o
    }

    /// Verifies the IR after every pass (default: on in debug builds).
    pub fn verify_each_pass(mut self, on: bool) -> Options {
        self.passes.verify = on;
        self
    }

    /// Keeps a dump of the IR after pass `pass` (or `all`), in
    /// [`Compiled::dumps`](super::Compiled::dumps).
    pub fn dump_after(mut self, pass: impl Into<String>) -> Options {
        self.passes.dump_after = Some(pass.into());
        self
    }

    /// Runs the static cross-rank check on the host program (default on).
    pub fn check(mut self, on: bool) -> Options {
        self.check = on;
        self
    }

    /// True when the cross-rank check runs.
    pub fn checks(&self) -> bool {
        self.check
    }

    /// Records every step an [`Executor`](crate::Executor) runs as a CUDA graph and replays
    /// it (default off). A backend or program that cannot be recorded (the CPU backend; GPU
    /// transports that need the host during a step: the copy engine, the host proxy, MoE over
    /// NVLink, when forced) is refused with the reason when the executor is made; unforced,
    /// the GPU backend then selects transports that replay.
    pub fn graph(mut self, on: bool) -> Options {
        self.graph = on;
        self
    }

    /// True when steps are recorded as CUDA graphs.
    pub fn records_graphs(&self) -> bool {
        self.graph
    }

    /// The wire of the host proxy for GPU runs split into nodes (`tcp`, `ibverbs`, `auto`; see
    /// [`WireChoice`]); applied to the backend settings by `CudaJob::for_program`.
    pub fn wire(mut self, wire: WireChoice) -> Options {
        self.wire = Some(wire);
        self
    }

    /// The wire chosen with [`Options::wire`], if any.
    pub fn proxy_wire(&self) -> Option<WireChoice> {
        self.wire
    }

    /// The options the passes read.
    pub fn pass_options(&self) -> &PassOptions {
        &self.passes
    }

    /// The pass options, mutably (every knob of [`PassOptions`]).
    pub fn pass_options_mut(&mut self) -> &mut PassOptions {
        &mut self.passes
    }

    /// The ranks a program needs, checked against [`Options::ranks`]; returns the job size.
    pub(super) fn job_size(&self, needed: usize) -> Result<usize, Error> {
        match self.ranks {
            Some(ranks) if ranks < needed => Err(Error::WorldSize { needed, ranks }),
            Some(ranks) => Ok(ranks),
            None => Ok(needed),
        }
    }
}

/// Parses level-1 program text with the parameters of `options`: its `param`s, and `ranks`
/// from [`Options::for_ranks`] when the program declares `param ranks` (a program that does
/// not is parsed with its own sizes, and [`compile`](super::compile) checks its world size).
pub fn parse(text: &str, options: &Options) -> Result<Program, Error> {
    let Some(ranks) = options.ranks else {
        return Ok(parse_program_with(text, &options.params)?);
    };
    let mut params = options.params.clone();
    params
        .entry("ranks".to_string())
        .or_insert(i64::try_from(ranks).unwrap_or(i64::MAX));
    match parse_program_with(text, &params) {
        Ok(p) => Ok(p),
        // The only error the extra override can add is "not declared", reported after the
        // whole text parsed: then parse without it.
        Err(e) if e.message.starts_with("parameter `ranks` is not declared") => {
            Ok(parse_program_with(text, &options.params)?)
        }
        Err(e) => Err(e.into()),
    }
}
