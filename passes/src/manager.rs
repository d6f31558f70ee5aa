//! The pass manager: runs level-1 passes, the phase change and host passes in that order —
//! an order the types enforce — verifies between passes, dumps IR on request, times every
//! pass (a `tracing` span per pass, plus [`PassTiming`]s in the result) and skips disabled
//! passes.
//!
//! A compilation between two passes is a [`Stage`]: `Stage<Program>` before the phase change,
//! `Stage<Lowered>` after it. Each pass consumes the stage and returns the next one; only
//! [`Stage::lower`] turns a level-1 stage into a host stage, so a host pass cannot run before
//! the lowering, nor a level-1 pass after it:
//!
//! ```compile_fail
//! use meshflow_passes::passes::SimplifyIndices;
//! use meshflow_passes::{PassOptions, Stage};
//! # fn f(p: meshflow_ir::Program) -> Result<(), meshflow_passes::PassError> {
//! let options = PassOptions::default();
//! Stage::start(p, &options)?.then(&SimplifyIndices)?; // a host pass on a level-1 program
//! # Ok(()) }
//! ```
//!
//! [`PassManager`] holds a whole pipeline in three typed lists (level-1 passes, the lowering,
//! host passes), so its pass names are known before anything runs.

use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use meshflow_ir::{verify_host, verify_program, HostProgram, Program, VerifyErrors};

use crate::error::PassError;
use crate::explain::ExplainRecord;
pub use crate::options::{Decomposition, PassContext, PassOptions, StreamSchedule};
use crate::plan::Plan;
use crate::Transport;

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

/// The phase change: level 1 to host IR. It cannot be disabled.
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

/// The IR after the phase change: the host program, with the level-1 program it was lowered
/// from.
#[derive(Clone, Debug)]
pub struct Lowered {
    /// The level-1 program as it entered the phase change.
    pub program: Program,
    /// The host program.
    pub host: HostProgram,
}

/// The IR a [`Stage`] holds between two passes: it verifies and prints itself.
pub trait Ir {
    /// Runs the verifier of this level.
    fn verify(&self) -> Result<(), VerifyErrors>;
    /// The text format of this level.
    fn text(&self) -> String;
}

impl Ir for Program {
    fn verify(&self) -> Result<(), VerifyErrors> {
        verify_program(self)
    }
    fn text(&self) -> String {
        self.to_string()
    }
}

impl Ir for Lowered {
    fn verify(&self) -> Result<(), VerifyErrors> {
        verify_host(&self.host)
    }
    fn text(&self) -> String {
        self.host.to_string()
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

impl DumpAfter {
    fn of(options: &PassOptions) -> Option<DumpAfter> {
        options.dump_after.as_deref().map(|which| match which {
            "all" => DumpAfter::All,
            name => DumpAfter::Pass(name.to_string()),
        })
    }

    fn wants(&self, pass: &str) -> bool {
        match self {
            DumpAfter::All => true,
            DumpAfter::Pass(p) => p == pass,
        }
    }
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

/// What a compilation produces.
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
    /// The decisions of `choose_decompositions` (printed by `--explain`).
    pub explain: Vec<ExplainRecord>,
    /// The plan of each decision, by the name of the tensor it is about.
    pub plans: BTreeMap<String, Plan>,
    /// The transport the plans assume (`None` when the program has no priced decision).
    pub transport: Option<Transport>,
}

/// A compilation between two passes, holding IR `L`: [`Program`] before the phase change,
/// [`Lowered`] after it (see the module docs).
pub struct Stage<'o, L> {
    ir: L,
    cx: PassContext<'o>,
    dump: Option<DumpAfter>,
    timings: Vec<PassTiming>,
    dumps: Vec<Dump>,
}

impl<'o> Stage<'o, Program> {
    /// Starts compiling `program` with `options` (checked with [`PassOptions::validate`]).
    pub fn start(program: Program, options: &'o PassOptions) -> Result<Self, PassError> {
        options.validate()?;
        Ok(Stage {
            cx: PassContext::new(&program, options),
            ir: program,
            dump: DumpAfter::of(options),
            timings: Vec::new(),
            dumps: Vec::new(),
        })
    }

    /// Runs a level-1 pass (unless disabled).
    pub fn then(mut self, pass: &dyn ProgramPass) -> Result<Self, PassError> {
        let name = pass.name();
        if self.skipped(name) {
            return Ok(self);
        }
        let span = tracing::info_span!("pass", name, wall_us = tracing::field::Empty);
        let start = Instant::now();
        {
            let _entered = span.enter();
            pass.run(&mut self.ir, &mut self.cx)?;
        }
        self.after(name, start, &span)?;
        Ok(self)
    }

    /// Runs the phase change: the level-1 stage becomes a host stage.
    pub fn lower(self, pass: &dyn LowerPass) -> Result<Stage<'o, Lowered>, PassError> {
        let name = pass.name();
        let Stage {
            ir: program,
            mut cx,
            dump,
            timings,
            dumps,
        } = self;
        let span = tracing::info_span!("pass", name, wall_us = tracing::field::Empty);
        let start = Instant::now();
        let host = {
            let _entered = span.enter();
            pass.run(&program, &mut cx)?
        };
        let mut next = Stage {
            ir: Lowered { program, host },
            cx,
            dump,
            timings,
            dumps,
        };
        next.after(name, start, &span)?;
        Ok(next)
    }

    /// The level-1 program so far.
    pub fn program(&self) -> &Program {
        &self.ir
    }
}

impl<'o> Stage<'o, Lowered> {
    /// Runs a host pass (unless disabled).
    pub fn then(mut self, pass: &dyn HostPass) -> Result<Self, PassError> {
        let name = pass.name();
        if self.skipped(name) {
            return Ok(self);
        }
        let span = tracing::info_span!("pass", name, wall_us = tracing::field::Empty);
        let start = Instant::now();
        {
            let _entered = span.enter();
            pass.run(&mut self.ir.host, &mut self.cx)?;
        }
        self.after(name, start, &span)?;
        Ok(self)
    }

    /// The host program so far.
    pub fn host(&self) -> &HostProgram {
        &self.ir.host
    }

    /// Ends the compilation.
    pub fn finish(self) -> PassOutput {
        PassOutput {
            program: self.ir.program,
            host: self.ir.host,
            timings: self.timings,
            dumps: self.dumps,
            explain: self.cx.explain,
            plans: self.cx.plans,
            transport: self.cx.transport,
        }
    }
}

impl<L: Ir> Stage<'_, L> {
    /// Records a disabled pass as skipped; true when `name` is disabled.
    fn skipped(&mut self, name: &'static str) -> bool {
        if !self.cx.options.disabled_passes.iter().any(|d| d == name) {
            return false;
        }
        tracing::debug!(pass = name, "pass disabled");
        self.timings.push(PassTiming {
            pass: name,
            wall: Duration::ZERO,
            ran: false,
        });
        true
    }

    /// Times, verifies and dumps after the pass `name`.
    fn after(
        &mut self,
        name: &'static str,
        start: Instant,
        span: &tracing::Span,
    ) -> Result<(), PassError> {
        let wall = start.elapsed();
        span.record("wall_us", wall.as_micros() as u64);
        tracing::debug!(
            pass = name,
            wall_us = wall.as_micros() as u64,
            "pass finished"
        );
        self.timings.push(PassTiming {
            pass: name,
            wall,
            ran: true,
        });
        if self.cx.options.verify {
            self.ir.verify().map_err(|errors| PassError::Verify {
                pass: name.to_string(),
                errors,
            })?;
        }
        if self.dump.as_ref().is_some_and(|d| d.wants(name)) {
            self.dumps.push(Dump {
                after: name,
                text: self.ir.text(),
            });
        }
        Ok(())
    }
}

/// A whole pipeline: level-1 passes, the phase change, host passes (see the module docs).
pub struct PassManager {
    level1: Vec<Box<dyn ProgramPass>>,
    lower: Box<dyn LowerPass>,
    host: Vec<Box<dyn HostPass>>,
}

impl PassManager {
    /// A pipeline of `level1` passes, the lowering `lower`, then `host` passes.
    pub fn new(
        level1: Vec<Box<dyn ProgramPass>>,
        lower: Box<dyn LowerPass>,
        host: Vec<Box<dyn HostPass>>,
    ) -> PassManager {
        PassManager {
            level1,
            lower,
            host,
        }
    }

    /// The pass names, in order.
    pub fn pass_names(&self) -> Vec<&'static str> {
        let mut names: Vec<_> = self.level1.iter().map(|p| p.name()).collect();
        names.push(self.lower.name());
        names.extend(self.host.iter().map(|p| p.name()));
        names
    }

    /// Why a pass may not be disabled (`Err` for a name not in the pipeline).
    fn required(&self, name: &str) -> Result<Option<&'static str>, PassError> {
        if let Some(p) = self.level1.iter().find(|p| p.name() == name) {
            return Ok(p.required());
        }
        if self.lower.name() == name {
            return Ok(Some("it is the phase change from level 1 to the host IR"));
        }
        if let Some(p) = self.host.iter().find(|p| p.name() == name) {
            return Ok(p.required());
        }
        Err(PassError::UnknownPass {
            name: name.to_string(),
            valid: self.pass_names().join(", "),
        })
    }

    /// Checks `options` against this pipeline: values, and every pass name they mention.
    pub fn check_options(&self, options: &PassOptions) -> Result<(), PassError> {
        options.validate()?;
        for name in &options.disabled_passes {
            if let Some(reason) = self.required(name)? {
                return Err(PassError::CannotDisable {
                    name: name.clone(),
                    reason: reason.to_string(),
                });
            }
        }
        match options.dump_after.as_deref() {
            None | Some("all") => {}
            Some(name) => {
                self.required(name)?;
            }
        }
        Ok(())
    }

    /// Runs every enabled pass on `program`.
    pub fn run(&self, program: Program, options: &PassOptions) -> Result<PassOutput, PassError> {
        self.check_options(options)?;
        let mut stage = Stage::start(program, options)?;
        for pass in &self.level1 {
            stage = stage.then(pass.as_ref())?;
        }
        let mut stage = stage.lower(self.lower.as_ref())?;
        for pass in &self.host {
            stage = stage.then(pass.as_ref())?;
        }
        Ok(stage.finish())
    }
}
