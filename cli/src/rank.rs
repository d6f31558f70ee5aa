//! One rank of a multi-process GPU run (`meshflow launch --nproc N -- meshflow run FILE
//! --backend cuda`, torchrun, several nodes): every process lowers the program itself, so the
//! rank meets the others at the job's rendezvous *before* lowering. There the ranks agree on
//! the machine profile (rank 0's where their GPU models differ, see
//! [`meshflow::front::agree`]), and after lowering each checks that it lowered the same host
//! program as rank 0, so that a job whose ranks would run different programs fails with an
//! error naming them instead of hanging. The run then uses the same rendezvous.

use std::sync::Arc;
use std::time::Duration;

use meshflow::front::agree::{check_same_program, ProgramFingerprint};
use meshflow::runtime::rendezvous::{Rendezvous, TcpRendezvous, TorchrunEnv};
use meshflow::{Compiled, Options};

use super::common::CliError;

/// The least time a GPU rank waits for its peers (communicator setup can take seconds).
pub const MIN_TIMEOUT: Duration = Duration::from_secs(60);

/// This process's rank of a multi-process run, connected to the job's rendezvous.
pub struct LaunchedRank {
    /// The torchrun variables: rank, world size, GPU, the store's address.
    pub env: TorchrunEnv,
    /// The job's rendezvous (rank 0 serves it).
    pub rendezvous: Arc<dyn Rendezvous>,
    /// How long the rank waits for the others (at least [`MIN_TIMEOUT`]).
    pub timeout: Duration,
}

impl LaunchedRank {
    /// The rank this process is, from the torchrun variables, connected to the rendezvous of
    /// its job (waiting up to `timeout`, at least [`MIN_TIMEOUT`], for the store); `None`
    /// outside a multi-process run.
    pub fn connect(timeout: Duration) -> Result<Option<LaunchedRank>, CliError> {
        let Some(env) = TorchrunEnv::from_env().map_err(|e| CliError::Usage(e.to_string()))? else {
            return Ok(None);
        };
        let timeout = timeout.max(MIN_TIMEOUT);
        let store = TcpRendezvous::connect(&env, timeout).map_err(|e| {
            CliError::Run(format!(
                "rank {} of {}: the rendezvous: {e}",
                env.rank, env.world_size
            ))
        })?;
        Ok(Some(LaunchedRank {
            env,
            rendezvous: Arc::new(store),
            timeout,
        }))
    }

    /// `options` with the machine profile the ranks agree on
    /// ([`Options::agree_profile`]).
    pub fn agree(&self, options: Options) -> Result<Options, CliError> {
        options
            .agree_profile(
                self.rendezvous.as_ref(),
                self.env.rank,
                self.env.world_size,
                self.timeout,
            )
            .map_err(|e| self.failed(e))
    }

    /// Checks that this rank lowered the same host program as rank 0, and waits until every
    /// rank has checked (so that every rank of a job that fails the check stops here, with
    /// the reason).
    pub fn check(&self, compiled: &Compiled) -> Result<(), CliError> {
        check_same_program(
            self.rendezvous.as_ref(),
            self.env.rank,
            self.env.world_size,
            &ProgramFingerprint::of(compiled),
            self.timeout,
        )
        // The reason names the rank already.
        .map_err(|e| CliError::Run(e.to_string()))?;
        self.rendezvous
            .barrier(
                "meshflow/agree/program/checked",
                self.env.world_size,
                self.timeout,
            )
            .map_err(|e| self.failed(format!("checking the lowered program: {e}")))
    }

    fn failed(&self, e: impl std::fmt::Display) -> CliError {
        CliError::Run(format!("rank {}: {e}", self.env.rank))
    }
}
