//! [`Error`]: every way compiling, loading and running through the front door can fail.

use meshflow_ir::program::BuildError;
use meshflow_ir::{DeviceId, MeshError, ParseError, VerifyErrors};
use meshflow_passes::PassError;

use crate::check::CheckErrors;
use crate::runtime::backend::BackendError;
use crate::runtime::data::DataError;
use crate::runtime::shard::ShardError;
use crate::runtime::RuntimeError;

/// Why an embedding call failed. The layers' own errors are wrapped unchanged (`#[from]`), so
/// `?` works on every meshflow call; the other variants are the embedding API's own checks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Program text (level 1 or host) does not parse; line and column inside.
    #[error("parse error at {0}")]
    Parse(#[from] ParseError),
    /// A program does not verify (every problem, with its location).
    #[error("{0}")]
    Verify(#[from] VerifyErrors),
    /// A [`ProgramBuilder`](meshflow_ir::ProgramBuilder) call failed.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// A device mesh is malformed.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// A host tensor cannot be made (shape and data disagree).
    #[error(transparent)]
    Data(#[from] DataError),
    /// A pass failed, or the options name an unknown pass.
    #[error(transparent)]
    Compile(#[from] PassError),
    /// The host program's communications do not match across ranks (the static check).
    #[error("cross-rank check failed: {0}")]
    Check(#[from] CheckErrors),
    /// A rank's run failed (names the rank, the instruction and the loop iteration).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// Cutting or assembling a full tensor by its layout failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// The program needs more ranks than the job has.
    #[error("the program needs {needed} ranks but the job has {ranks}")]
    WorldSize {
        /// Ranks the program's meshes span.
        needed: usize,
        /// Ranks of the job ([`Options::for_ranks`](crate::Options::for_ranks)).
        ranks: usize,
    },
    /// A rank outside the job.
    #[error("rank {rank} is not in the job of {world_size} ranks")]
    Rank {
        /// The rank asked for.
        rank: DeviceId,
        /// The job's size.
        world_size: usize,
    },
    /// The backend handed to an executor belongs to another rank.
    #[error("the executor is for rank {rank} but its backend is rank {backend}'s")]
    BackendRank {
        /// The executor's rank.
        rank: DeviceId,
        /// The backend's rank.
        backend: DeviceId,
    },
    /// The host program launches a kernel the backend does not have.
    #[error(
        "rank {rank}: the program launches kernel `{kernel}`, which is not registered with the \
         backend"
    )]
    MissingKernel {
        /// The rank.
        rank: DeviceId,
        /// The kernel name.
        kernel: String,
    },
    /// A binding is missing, unknown or of the wrong type.
    #[error("rank {rank}: binding `{name}`: {message}")]
    Binding {
        /// The rank.
        rank: DeviceId,
        /// The input or output.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// Lending a caller-owned tensor to the backend, or taking it back, failed.
    #[error("rank {rank}: caller-owned `{name}`: {source}")]
    Backend {
        /// The rank.
        rank: DeviceId,
        /// The input or output.
        name: String,
        /// The backend's error.
        source: BackendError,
    },
    /// A level-1 operation on a [`Compiled`](crate::Compiled) loaded from host text.
    #[error("{what} needs the level-1 program, which a host program loaded from text lacks")]
    NoProgram {
        /// What was asked.
        what: &'static str,
    },
    /// Parameters given for host IR text, which has none (its sizes are concrete).
    #[error(
        "host IR text has no parameters (its sizes are concrete): {} applies to level-1 programs only",
        params.iter().map(|p| format!("`{p}`")).collect::<Vec<_>>().join(", ")
    )]
    HostParams {
        /// The parameters given.
        params: Vec<String>,
    },
    /// The ranks of a multi-process job could not agree on what they lower (different given
    /// machine profiles, different host programs), or the rendezvous failed meanwhile.
    #[error(transparent)]
    Agreement(#[from] crate::front::agree::AgreeError),
    /// No level-1 tensor (or host input/output) of that name.
    #[error("no tensor `{0}` in the program")]
    UnknownTensor(String),
    /// A CUDA, cuBLAS or NCCL call of the kernels layer failed (e.g. wrapping a raw handle).
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Device(#[from] meshflow_kernels::KernelError),
    /// Setting up the CUDA backend on the caller's resources failed.
    #[cfg(feature = "cuda")]
    #[error("rank {rank}: {source}")]
    Cuda {
        /// The rank.
        rank: DeviceId,
        /// The backend's error.
        source: BackendError,
    },
}
