//! What several subcommands share: loading a program with parameters, errors, output.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use meshflow::ir::{parse_host, verify_host, verify_program, HostProgram, Program};
use meshflow::passes::Decomposition;
use meshflow::{Compiled, Format, Options};

/// Errors of the command line (printed as `error: ...`).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A file could not be read.
    #[error("cannot read `{path}`: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The program text does not parse.
    #[error("{path}:{source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parse error (line:col: message).
        source: meshflow::ir::ParseError,
    },
    /// The program does not verify.
    #[error("{path}: the program does not verify:\n{source}")]
    Verify {
        /// The file.
        path: PathBuf,
        /// Every diagnostic.
        source: meshflow::ir::VerifyErrors,
    },
    /// A bad argument value.
    #[error("{0}")]
    Usage(String),
    /// Compilation failed.
    #[error(transparent)]
    Compile(meshflow::Error),
    /// Writing the output failed.
    #[error("cannot write the output: {0}")]
    Write(std::io::Error),
    /// The cross-rank check rejected the program.
    #[error("the cross-rank check rejects the program:\n{0}")]
    Check(String),
    /// A run failed.
    #[error("{0}")]
    Run(String),
    /// The run finished but an output differs from the reference (already reported on stdout).
    #[error("an output differs from the reference")]
    Mismatch,
}

/// The program file and its parameters: every subcommand that reads a program takes these.
#[derive(Clone, Debug, Args)]
pub struct ProgramArgs {
    /// The program: level-1 text (`.mf`) or host IR text (`.mfh`, what `lower` prints),
    /// recognised by its content.
    pub file: PathBuf,
    /// The number of ranks: sets the program's `ranks` parameter (when it declares one) and
    /// the size of the job, which must cover the program's meshes. Default: `WORLD_SIZE` in a
    /// rank started by `meshflow launch` (or torchrun), else the program's own.
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Overrides a parameter: `--param name=value` (repeatable).
    #[arg(long = "param", value_name = "NAME=VALUE")]
    pub params: Vec<String>,
}

/// How a program is compiled: every subcommand that compiles takes these, with the same
/// meaning and defaults.
#[derive(Clone, Debug, Args)]
pub struct CompileArgs {
    /// Size of the worker stream pool (at least 1).
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    pub streams: usize,
    /// How stream loops use the worker streams: `auto` (chosen per loop by the schedule search),
    /// `per-iteration` (each iteration on its own worker, as nvFuser) or `prefetch` (compute on
    /// the main stream, transfers one iteration ahead on a worker).
    #[arg(long, value_enum, default_value_t = ScheduleArg::Auto)]
    pub schedule: ScheduleArg,
    /// The machine profile the schedule search prices plans with: a built-in name (`h200x2`,
    /// `h100x2`) or a JSON file. Default: with `--backend cuda`, the built-in profile of the
    /// GPU model the run executes on (`h200x2` when none describes it); elsewhere (`lower`,
    /// `check`, the CPU backend), `h200x2`: the target is unknown, name it here.
    #[arg(long, value_name = "NAME|FILE")]
    pub profile: Option<String>,
    /// Force the transport instead of letting the schedule search pick it: `nccl` or
    /// `copy-engine`.
    #[arg(long, value_parser = search_transport)]
    pub transport: Option<meshflow::Transport>,
    /// Force a decomposition: `--decompose TENSOR=collective|broadcast|reduce|ring|ring_forward|
    /// ring_bidirectional` (repeatable; TENSOR is the gathered tensor of an all-gather, the
    /// partial sums of a reduce-scatter).
    #[arg(long = "decompose", value_name = "TENSOR=VARIANT")]
    pub decompose: Vec<String>,
    /// Force the pieces per step of a reduce-scatter ring: `--pieces TENSOR=N` (repeatable;
    /// TENSOR is the partial sums; N >= 1).
    #[arg(long = "pieces", value_name = "TENSOR=N")]
    pub pieces: Vec<String>,
    /// Force whether the reduce-scatter ring of running sums accumulates in place:
    /// `--accumulate TENSOR=on|off` (repeatable; TENSOR is the partial sums). `on`: the chunk
    /// GEMM adds onto the running sum that arrived (`linear_accumulate`; only where the partial
    /// sums come from a `linear` read by the reduce-scatter alone, all of one dtype); `off`: a
    /// separate add per step.
    #[arg(long = "accumulate", value_name = "TENSOR=on|off")]
    pub accumulate: Vec<String>,
    /// Skip a pass (repeatable).
    #[arg(long = "disable-pass", value_name = "PASS")]
    pub disable_pass: Vec<String>,
    /// Do not verify between passes.
    #[arg(long)]
    pub no_verify: bool,
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a positive integer")),
    }
}

impl CompileArgs {
    /// The same arguments as command-line words (for the node processes of a multi-process
    /// run).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--streams".to_string(),
            self.streams.to_string(),
            "--schedule".to_string(),
            self.schedule.name().to_string(),
        ];
        if let Some(p) = &self.profile {
            args.extend(["--profile".to_string(), p.clone()]);
        }
        if let Some(t) = self.transport {
            args.extend(["--transport".to_string(), t.name().to_string()]);
        }
        for d in &self.decompose {
            args.extend(["--decompose".to_string(), d.clone()]);
        }
        for p in &self.pieces {
            args.extend(["--pieces".to_string(), p.clone()]);
        }
        for a in &self.accumulate {
            args.extend(["--accumulate".to_string(), a.clone()]);
        }
        for p in &self.disable_pass {
            args.extend(["--disable-pass".to_string(), p.clone()]);
        }
        if self.no_verify {
            args.push("--no-verify".to_string());
        }
        args
    }
}

/// The options of [`meshflow::compile`] that the shared arguments stand for (the defaults
/// for what `compile` leaves out).
pub fn options(program: &ProgramArgs, compile: Option<&CompileArgs>) -> Result<Options, CliError> {
    let mut options = Options::new();
    if let Some(ranks) = program.ranks.or(launched_world_size()?) {
        options = options.with_ranks(ranks);
    }
    for p in &program.params {
        let (name, value) = p
            .split_once('=')
            .ok_or_else(|| CliError::Usage(format!("--param `{p}`: expected NAME=VALUE")))?;
        let value: i64 = value
            .trim()
            .parse()
            .map_err(|_| CliError::Usage(format!("--param `{p}`: `{value}` is not an integer")))?;
        options = options.param(name.trim(), value);
    }
    let Some(compile) = compile else {
        return Ok(options);
    };
    options = options
        .streams(compile.streams)
        .stream_schedule(compile.schedule.schedule())
        .verify_each_pass(!compile.no_verify);
    if let Some(p) = &compile.profile {
        let profile = meshflow::pipeline::load_profile(p)
            .map_err(|e| CliError::Usage(format!("--profile: {e}")))?;
        options = options.profile(profile);
    }
    if let Some(t) = compile.transport {
        options = options.transport(t);
    }
    for d in &compile.decompose {
        let (tensor, variant) = d.split_once('=').ok_or_else(|| {
            CliError::Usage(format!("--decompose `{d}`: expected TENSOR=VARIANT"))
        })?;
        let variant: Decomposition = variant
            .parse()
            .map_err(|e: meshflow::passes::PassError| CliError::Usage(e.to_string()))?;
        options = options.decomposition(tensor, variant);
    }
    for p in &compile.pieces {
        let (tensor, n) = p
            .split_once('=')
            .ok_or_else(|| CliError::Usage(format!("--pieces `{p}`: expected TENSOR=N")))?;
        let n: u64 = n.trim().parse().map_err(|_| {
            CliError::Usage(format!("--pieces `{p}`: `{n}` is not a positive integer"))
        })?;
        options = options.pieces(tensor.trim(), n);
    }
    for a in &compile.accumulate {
        let (tensor, on) = a.split_once('=').ok_or_else(|| {
            CliError::Usage(format!("--accumulate `{a}`: expected TENSOR=on|off"))
        })?;
        let on = match on.trim() {
            "on" | "true" => true,
            "off" | "false" => false,
            other => {
                return Err(CliError::Usage(format!(
                    "--accumulate `{a}`: `{other}` is neither on nor off"
                )))
            }
        };
        options = options.accumulate(tensor.trim(), on);
    }
    for p in &compile.disable_pass {
        options = options.disable_pass(p.clone());
    }
    Ok(options)
}

/// `options` for a program lowered to run on the GPUs of this process (`--backend cuda`):
/// unless `--profile` was given, plans are priced with the built-in profile of their model
/// ([`Options::device`], [`meshflow::pipeline::choose_profile`]): GPU 0's, or the one
/// `MESHFLOW_GPU_MODEL` names ([`meshflow::pipeline::target_gpu_model`]). Where no GPU answers,
/// the default stays (the run itself then says why it cannot start). The ranks of a
/// multi-process run then agree on the profile (see `rank`).
pub fn on_gpus(options: Options) -> Options {
    match meshflow::pipeline::target_gpu_model() {
        Ok(name) => options.device(&name),
        Err(e) => {
            if cfg!(feature = "cuda") {
                tracing::warn!("no GPU model to choose the machine profile by: {e}");
            }
            options
        }
    }
}

/// The `profile:` line of `--explain`: the machine profile the plans were priced with and
/// why, with the `--profile` argument when one was given (nothing for host IR).
pub fn profile_line(compile: &CompileArgs, compiled: &Compiled) -> String {
    let Some(reason) = compiled.profile_reason() else {
        return String::new();
    };
    match &compile.profile {
        Some(arg) => format!("profile: {reason} (--profile {arg})\n"),
        None => format!("profile: {reason}\n"),
    }
}

/// `WORLD_SIZE` when this process is a rank started by `meshflow launch` (or torchrun: `RANK`
/// is set too).
fn launched_world_size() -> Result<Option<usize>, CliError> {
    let (Ok(world), Ok(_)) = (std::env::var("WORLD_SIZE"), std::env::var("RANK")) else {
        return Ok(None);
    };
    match world.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(Some(n)),
        _ => Err(CliError::Usage(format!(
            "WORLD_SIZE=`{world}`: expected a positive number of ranks"
        ))),
    }
}

/// A program read from a file: level-1 text or host IR, told apart by content.
pub enum Input {
    /// A verified level-1 program.
    Program(Program),
    /// A verified host program.
    Host(HostProgram),
}

impl CompileArgs {
    /// Refuses, for host IR input, the arguments that only change how a level-1 program is
    /// lowered (host IR is not lowered again).
    pub fn refuse_for_host(&self, file: &Path) -> Result<(), CliError> {
        let mut given = Vec::new();
        if self.schedule != ScheduleArg::Auto {
            given.push("--schedule");
        }
        if self.profile.is_some() {
            given.push("--profile");
        }
        if self.transport.is_some() {
            given.push("--transport");
        }
        if !self.decompose.is_empty() {
            given.push("--decompose");
        }
        if !self.pieces.is_empty() {
            given.push("--pieces");
        }
        if !self.accumulate.is_empty() {
            given.push("--accumulate");
        }
        if !self.disable_pass.is_empty() {
            given.push("--disable-pass");
        }
        if self.no_verify {
            given.push("--no-verify");
        }
        refuse_lowering_flags(file, &given)
    }
}

/// The error for lowering flags given with host IR input (nothing when `given` is empty).
pub fn refuse_lowering_flags(file: &Path, given: &[&str]) -> Result<(), CliError> {
    if given.is_empty() {
        return Ok(());
    }
    let verb = if given.len() == 1 { "applies" } else { "apply" };
    Err(CliError::Usage(format!(
        "{} is host IR, which is not lowered again: {} {verb} to level-1 programs only",
        file.display(),
        given.join(", ")
    )))
}

impl ProgramArgs {
    /// Reads the file.
    pub fn text(&self) -> Result<String, CliError> {
        std::fs::read_to_string(&self.file).map_err(|source| CliError::Read {
            path: self.file.clone(),
            source,
        })
    }

    /// Reads, parses (with the parameters of `options`) and verifies the level-1 program.
    pub fn load(&self, options: &Options) -> Result<Program, CliError> {
        let program = meshflow::parse(&self.text()?, options).map_err(|e| self.error(e))?;
        verify_program(&program).map_err(|source| CliError::Verify {
            path: self.file.clone(),
            source,
        })?;
        Ok(program)
    }

    /// Reads, parses and verifies the program in either text format ([`meshflow::format_of`]:
    /// by content, not by extension). `--param` is refused for host IR, which has none.
    pub fn load_any(&self, options: &Options) -> Result<Input, CliError> {
        let text = self.text()?;
        if meshflow::format_of(&text) != Some(Format::Host) {
            return self.load(options).map(Input::Program);
        }
        if !options.params().is_empty() {
            return Err(CliError::Usage(format!(
                "{}: {}",
                self.file.display(),
                meshflow::Error::HostParams {
                    params: self.params.clone(),
                }
            )));
        }
        let host = parse_host(&text).map_err(|source| CliError::Parse {
            path: self.file.clone(),
            source,
        })?;
        verify_host(&host).map_err(|source| CliError::Verify {
            path: self.file.clone(),
            source,
        })?;
        Ok(Input::Host(host))
    }

    /// Compiles a level-1 input, or wraps a host one, with `options` (the cross-rank check
    /// runs when `options` ask for it).
    pub fn compile(&self, input: Input, options: &Options) -> Result<Compiled, CliError> {
        match input {
            Input::Program(p) => meshflow::compile(&p, options),
            Input::Host(h) => Compiled::from_host(h, options),
        }
        .map_err(|e| self.error(e))
    }

    /// A front-door error about this program, with the file named where it helps.
    pub fn error(&self, e: meshflow::Error) -> CliError {
        match e {
            meshflow::Error::Parse(source) => CliError::Parse {
                path: self.file.clone(),
                source,
            },
            meshflow::Error::Verify(source) => CliError::Verify {
                path: self.file.clone(),
                source,
            },
            meshflow::Error::Check(e) => CliError::Check(e.to_string()),
            meshflow::Error::WorldSize { needed, ranks } => CliError::Usage(format!(
                "the program's meshes use {needed} devices but only {ranks} ranks were requested"
            )),
            e => CliError::Compile(e),
        }
    }
}

/// Writes `text` to stdout.
pub fn print_out(text: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(CliError::Write)
}

/// Writes `text` to stderr.
pub fn print_err(text: &str) -> Result<(), CliError> {
    std::io::stderr()
        .lock()
        .write_all(text.as_bytes())
        .map_err(CliError::Write)
}

/// `MESHFLOW_FAULT_EXIT=RANK:N[,RANK:N]` (feature `fault-injection`, the fault tests of
/// multi-process runs): the process of `RANK` exits at its `N`-th communication (0-based), as
/// if it were killed. `(rank, n)` pairs; empty when the variable is not set.
#[cfg(feature = "fault-injection")]
pub fn fault_exits_from_env() -> Result<Vec<(usize, usize)>, CliError> {
    meshflow::runtime::faults::exits_from_env().map_err(CliError::Usage)
}

/// `--schedule`: how stream loops use the worker streams.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ScheduleArg {
    /// Chosen per loop by the schedule search (the predicted fastest).
    #[default]
    Auto,
    /// Every iteration on its own worker stream (nvFuser's schedule).
    PerIteration,
    /// Compute on the main stream, each transfer one iteration ahead on a worker stream.
    Prefetch,
}

impl ScheduleArg {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleArg::Auto => "auto",
            ScheduleArg::PerIteration => "per-iteration",
            ScheduleArg::Prefetch => "prefetch",
        }
    }

    /// The pipeline's setting.
    pub fn schedule(self) -> meshflow::pipeline::StreamSchedule {
        match self {
            ScheduleArg::Auto => meshflow::pipeline::StreamSchedule::Auto,
            ScheduleArg::PerIteration => meshflow::pipeline::StreamSchedule::PerIteration,
            ScheduleArg::Prefetch => meshflow::pipeline::StreamSchedule::Prefetch,
        }
    }
}

/// An output file opened before a run, so that a path that cannot be written fails before
/// anything runs; written after the run. A file this created is removed again if it is never
/// written (the run failed); an existing file is left as it was until then.
pub struct OutputFile {
    path: PathBuf,
    what: &'static str,
    file: Option<std::fs::File>,
    created: bool,
}

impl OutputFile {
    /// Opens `path` for writing (creating it if needed, without truncating it yet); `what`
    /// names it in errors ("trace", "timeline").
    pub fn create(path: &Path, what: &'static str) -> Result<OutputFile, CliError> {
        let created = !path.exists();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| {
                CliError::Usage(format!("cannot write the {what} `{}`: {e}", path.display()))
            })?;
        Ok(OutputFile {
            path: path.to_path_buf(),
            what,
            file: Some(file),
            created,
        })
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces the file's content with `text`.
    pub fn write(mut self, text: &str) -> Result<(), CliError> {
        let failed = |e: std::io::Error| {
            CliError::Run(format!(
                "cannot write the {} `{}`: {e}",
                self.what,
                self.path.display()
            ))
        };
        let Some(mut file) = self.file.take() else {
            return Err(failed(std::io::Error::other("already written")));
        };
        file.set_len(0)
            .and_then(|()| file.write_all(text.as_bytes()))
            .and_then(|()| file.flush())
            .map_err(failed)
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        if self.file.take().is_some() && self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// `--transport`: the transport the plans assume (and the GPU runtime uses): one the search
/// prices, `nccl` or `copy-engine`.
fn search_transport(s: &str) -> Result<meshflow::Transport, String> {
    match s
        .parse::<meshflow::Transport>()
        .map_err(|e| e.to_string())?
    {
        t @ (meshflow::Transport::Nccl | meshflow::Transport::CopyEngine) => Ok(t),
        t => Err(format!(
            "the schedule search prices nccl and copy-engine plans, not {t}"
        )),
    }
}
