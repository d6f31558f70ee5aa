//! What several subcommands share: loading a program with parameters, errors, output.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use meshflow::ir::{parse_program_with, verify_program, Params, Program};

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
    Compile(#[from] meshflow::pipeline::PipelineError),
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

/// The program file and its parameters.
#[derive(Debug, Args)]
pub struct ProgramArgs {
    /// The level-1 program (`.mf`).
    pub file: PathBuf,
    /// Sets the `ranks` parameter.
    #[arg(long)]
    pub ranks: Option<i64>,
    /// Overrides a parameter: `--param name=value` (repeatable).
    #[arg(long = "param", value_name = "NAME=VALUE")]
    pub params: Vec<String>,
}

impl ProgramArgs {
    /// Reads, parses and verifies the program.
    pub fn load(&self) -> Result<Program, CliError> {
        let text = std::fs::read_to_string(&self.file).map_err(|source| CliError::Read {
            path: self.file.clone(),
            source,
        })?;
        let mut params = Params::new();
        if let Some(r) = self.ranks {
            params.insert("ranks".to_string(), r);
        }
        for p in &self.params {
            let (name, value) = p
                .split_once('=')
                .ok_or_else(|| CliError::Usage(format!("--param `{p}`: expected NAME=VALUE")))?;
            let value: i64 = value.trim().parse().map_err(|_| {
                CliError::Usage(format!("--param `{p}`: `{value}` is not an integer"))
            })?;
            params.insert(name.trim().to_string(), value);
        }
        let program = parse_program_with(&text, &params).map_err(|source| CliError::Parse {
            path: self.file.clone(),
            source,
        })?;
        verify_program(&program).map_err(|source| CliError::Verify {
            path: self.file.clone(),
            source,
        })?;
        Ok(program)
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

/// `MESHFLOW_FAULT_EXIT=RANK:N[,RANK:N]` (fault tests of multi-process runs): the process of
/// `RANK` exits at its `N`-th communication (0-based), as if it were killed. `(rank, n)` pairs;
/// empty when the variable is not set.
pub fn fault_exits_from_env() -> Result<Vec<(usize, usize)>, CliError> {
    let Ok(spec) = std::env::var("MESHFLOW_FAULT_EXIT") else {
        return Ok(Vec::new());
    };
    spec.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|item| {
            item.split_once(':')
                .and_then(|(r, n)| Some((r.trim().parse().ok()?, n.trim().parse().ok()?)))
                .ok_or_else(|| {
                    CliError::Usage(format!("MESHFLOW_FAULT_EXIT: `{item}` is not RANK:N"))
                })
        })
        .collect()
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
    /// The pipeline's setting.
    pub fn schedule(self) -> meshflow::pipeline::StreamSchedule {
        match self {
            ScheduleArg::Auto => meshflow::pipeline::StreamSchedule::Auto,
            ScheduleArg::PerIteration => meshflow::pipeline::StreamSchedule::PerIteration,
            ScheduleArg::Prefetch => meshflow::pipeline::StreamSchedule::Prefetch,
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

/// What `lower` and `run` share about the schedule search.
#[derive(Debug, Args)]
pub struct SearchArgs {
    /// How stream loops use the worker streams: `auto` (chosen per loop by the schedule search),
    /// `per-iteration` (each iteration on its own worker, as nvFuser) or `prefetch` (compute on
    /// the main stream, transfers one iteration ahead on a worker).
    #[arg(long, value_enum, default_value_t = ScheduleArg::Auto)]
    pub schedule: ScheduleArg,
    /// The machine profile the search prices plans with: a built-in name (`h200x2`, the
    /// default, or `h100x2`) or a JSON file.
    #[arg(long, value_name = "NAME|FILE")]
    pub profile: Option<String>,
    /// Force the transport instead of letting the search pick it: `nccl` or `copy-engine`.
    #[arg(long, value_parser = search_transport)]
    pub transport: Option<meshflow::Transport>,
}

impl SearchArgs {
    /// The cost model these arguments ask for.
    pub fn cost_model(&self) -> Result<meshflow::CostModel, CliError> {
        let mut model = meshflow::CostModel::default();
        if let Some(p) = &self.profile {
            model.profile = meshflow::pipeline::load_profile(p)?;
        }
        model.transport = self.transport;
        Ok(model)
    }
}
