//! What several subcommands share: loading a program with parameters, errors, output.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use meshflow::ir::{verify_program, Program};
use meshflow::passes::Decomposition;
use meshflow::Options;

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
    /// The program: level-1 text (`.mf`).
    pub file: PathBuf,
    /// The number of ranks: sets the program's `ranks` parameter (when it declares one) and
    /// the size of the job, which must cover the program's meshes.
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
    /// How stream loops use the worker streams: `per-iteration` (each iteration on its own
    /// worker, as nvFuser) or `prefetch` (compute on the main stream, transfers one iteration
    /// ahead on a worker).
    #[arg(long, value_enum, default_value_t = ScheduleArg::PerIteration)]
    pub schedule: ScheduleArg,
    /// Force a decomposition: `--decompose TENSOR=collective|broadcast|ring` (repeatable).
    #[arg(long = "decompose", value_name = "TENSOR=VARIANT")]
    pub decompose: Vec<String>,
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
        for d in &self.decompose {
            args.extend(["--decompose".to_string(), d.clone()]);
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
    if let Some(ranks) = program.ranks {
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
    for d in &compile.decompose {
        let (tensor, variant) = d.split_once('=').ok_or_else(|| {
            CliError::Usage(format!("--decompose `{d}`: expected TENSOR=VARIANT"))
        })?;
        let variant: Decomposition = variant
            .parse()
            .map_err(|e: meshflow::passes::PassError| CliError::Usage(e.to_string()))?;
        options = options.decomposition(tensor, variant);
    }
    for p in &compile.disable_pass {
        options = options.disable_pass(p.clone());
    }
    Ok(options)
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
    /// Every iteration on its own worker stream (nvFuser's schedule).
    #[default]
    PerIteration,
    /// Compute on the main stream, each transfer one iteration ahead on a worker stream.
    Prefetch,
}

impl ScheduleArg {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleArg::PerIteration => "per-iteration",
            ScheduleArg::Prefetch => "prefetch",
        }
    }

    /// The pipeline's setting.
    pub fn schedule(self) -> meshflow::pipeline::StreamSchedule {
        match self {
            ScheduleArg::PerIteration => meshflow::pipeline::StreamSchedule::PerIteration,
            ScheduleArg::Prefetch => meshflow::pipeline::StreamSchedule::Prefetch,
        }
    }
}
