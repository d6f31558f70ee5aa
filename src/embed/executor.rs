//! [`Executor`]: one rank of a [`Compiled`] program on the caller's backend, with
//! caller-owned tensors ([`Bindings`]).

use std::collections::BTreeMap;
use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use meshflow_ir::host::Role;
use meshflow_ir::{DType, DeviceId};

use super::{Compiled, Error, TensorInfo};
use crate::runtime::backend::{Backend, BackendError};
use crate::runtime::data::TensorData;
use crate::runtime::{EvalOptions, Evaluator};

/// A [`Backend`] that can run on tensors the caller owns: what [`Executor`] needs on top of
/// the backend trait. Implemented by the CPU backend ([`CpuBackend`](crate::runtime::CpuBackend),
/// tensors [`CpuTensor`](super::CpuTensor)) and, with feature `cuda`, the CUDA backend
/// (device buffers the caller allocated).
pub trait Bind: Backend {
    /// A caller-owned tensor, lent to the backend for one run.
    type Tensor<'a>;

    /// Element type and shape of `tensor` (checked against the program before it is lent).
    fn tensor_type(tensor: &Self::Tensor<'_>) -> (DType, Vec<u64>);

    /// Lends `tensor` to the backend for one run: a buffer handle the program reads (an
    /// input) or writes in place (`output`), without a copy where the backend can.
    fn attach(
        &mut self,
        tensor: &mut Self::Tensor<'_>,
        output: bool,
    ) -> Result<Self::Buffer, BackendError>;

    /// Ends the loan after the run, whatever its outcome. `check_written` (an output of a run
    /// that succeeded) asks the backend to report elements the program never wrote, where it
    /// tracks them.
    fn detach(
        &mut self,
        buffer: Self::Buffer,
        tensor: &mut Self::Tensor<'_>,
        check_written: bool,
    ) -> Result<(), BackendError>;

    /// Tells the other ranks of the job that this rank failed, so that they stop at their
    /// next communication instead of waiting for it.
    fn abort_job(&mut self, reason: &str);

    /// Whether the backend's own settings ask for every step to be recorded as a graph (the
    /// CUDA backend's `CudaConfig::graph`); [`Options::graph`](super::Options::graph) asks
    /// for it too.
    fn records_graphs(&self) -> bool {
        false
    }
}

/// The caller's tensors for one run of an [`Executor`], by input or output name. Inputs are
/// read, outputs are written in place. An input this rank holds must be bound; an output
/// may be left unbound (it is then returned by [`Executor::run`]). Bindings of tensors this
/// rank does not hold are ignored, so one set of names can serve every rank.
pub struct Bindings<'a, B: Bind> {
    map: BTreeMap<String, B::Tensor<'a>>,
}

impl<B: Bind> Default for Bindings<'_, B> {
    fn default() -> Self {
        Bindings {
            map: BTreeMap::new(),
        }
    }
}

impl<B: Bind> fmt::Debug for Bindings<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bindings")
            .field("names", &self.map.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl<'a, B: Bind> Bindings<'a, B> {
    /// No bindings.
    pub fn new() -> Self {
        Self::default()
    }

    /// Binds `name` to `tensor` (replacing an earlier binding of that name).
    pub fn bind(&mut self, name: impl Into<String>, tensor: B::Tensor<'a>) -> &mut Self {
        self.map.insert(name.into(), tensor);
        self
    }

    /// Removes and returns the binding of `name`.
    pub fn remove(&mut self, name: &str) -> Option<B::Tensor<'a>> {
        self.map.remove(name)
    }

    /// The bound names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.map.keys().map(String::as_str).collect()
    }

    /// The number of bindings.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is bound.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Runs one rank of a [`Compiled`] program on a backend the caller provides, with the
/// caller's tensors. Create one per rank (a thread, a process or a GPU each); the ranks of
/// one job must run the same number of steps. [`Executor::run`] can be called again for
/// every step: the backend, its streams and its communicators are set up once.
pub struct Executor<'c, B: Bind> {
    compiled: &'c Compiled,
    evaluator: Evaluator<'c, B>,
    rank: DeviceId,
}

impl<B: Bind> fmt::Debug for Executor<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executor")
            .field("program", &self.compiled.host().name)
            .field("rank", &self.rank)
            .finish()
    }
}

impl<'c, B: Bind> Executor<'c, B> {
    /// The executor of `rank` on `backend` (which must be that rank's). Fails when the rank is
    /// outside the job or a kernel the program launches is not registered with the backend
    /// (the other ranks of the job are told, see [`Bind::abort_job`]).
    pub fn new(compiled: &'c Compiled, rank: DeviceId, mut backend: B) -> Result<Self, Error> {
        let world_size = compiled.world_size();
        if rank >= world_size {
            return Err(Error::Rank { rank, world_size });
        }
        if backend.device() != rank {
            return Err(Error::BackendRank {
                rank,
                backend: backend.device(),
            });
        }
        if let Some(kernel) = compiled
            .kernels()
            .into_iter()
            .find(|k| backend.kernel(k).is_none())
        {
            let e = Error::MissingKernel { rank, kernel };
            backend.abort_job(&e.to_string());
            return Err(e);
        }
        let graph = compiled.records_graphs() || backend.records_graphs();
        let mut evaluator = Evaluator::new(compiled.host(), backend, EvalOptions::default())?;
        if graph {
            if let Err(source) = evaluator.backend().check_graph() {
                let e = Error::Runtime(crate::runtime::RuntimeError::Backend { rank, source });
                evaluator.backend_mut().abort_job(&e.to_string());
                return Err(e);
            }
            evaluator.set_graph(true);
        }
        Ok(Executor {
            compiled,
            evaluator,
            rank,
        })
    }

    /// The rank.
    pub fn rank(&self) -> DeviceId {
        self.rank
    }

    /// The program.
    pub fn compiled(&self) -> &'c Compiled {
        self.compiled
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        self.evaluator.backend()
    }

    /// The backend, mutably.
    pub fn backend_mut(&mut self) -> &mut B {
        self.evaluator.backend_mut()
    }

    /// The inputs this rank holds (each must be bound), with their local shapes.
    pub fn inputs(&self) -> Vec<TensorInfo> {
        self.held(self.compiled.inputs())
    }

    /// The outputs this rank holds, with their local shapes.
    pub fn outputs(&self) -> Vec<TensorInfo> {
        self.held(self.compiled.outputs())
    }

    fn held(&self, all: Vec<TensorInfo>) -> Vec<TensorInfo> {
        all.into_iter()
            .filter(|t| t.devices.contains(&self.rank))
            .collect()
    }

    /// Runs the program once on this rank: reads the bound inputs, writes the bound outputs
    /// in place, and returns the outputs this rank holds that were not bound (copied to the
    /// host). Returns when this rank's work is complete. On an error the other ranks of the
    /// job are told to stop; the bound tensors are always given back, even when the run
    /// panics (the panic then continues).
    pub fn run(
        &mut self,
        bindings: &mut Bindings<'_, B>,
    ) -> Result<BTreeMap<String, TensorData>, Error> {
        let result = self.run_inner(bindings);
        if let Err(e) = &result {
            let abort = matches!(e, Error::Runtime(r) if r.is_abort());
            if !abort {
                self.evaluator.backend_mut().abort_job(&e.to_string());
            }
        }
        result
    }

    fn run_inner(
        &mut self,
        bindings: &mut Bindings<'_, B>,
    ) -> Result<BTreeMap<String, TensorData>, Error> {
        let rank = self.rank;
        let held = self.inputs().into_iter().chain(self.outputs());
        let held: BTreeMap<String, TensorInfo> = held.map(|t| (t.name.clone(), t)).collect();
        let binding_error = |name: &str, message: String| Error::Binding {
            rank,
            name: name.to_string(),
            message,
        };
        for name in bindings.map.keys() {
            if self.compiled.tensor(name).is_none() {
                let known: Vec<String> = (self.compiled.inputs().into_iter())
                    .chain(self.compiled.outputs())
                    .map(|t| t.name)
                    .collect();
                return Err(binding_error(
                    name,
                    format!(
                        "the program has no input or output of that name (it has: {})",
                        known.join(", ")
                    ),
                ));
            }
        }
        for info in held.values() {
            match bindings.map.get(&info.name) {
                None if info.role == Role::Input => {
                    return Err(binding_error(&info.name, "input not bound".into()))
                }
                None => {}
                Some(t) => {
                    let (dtype, shape) = B::tensor_type(t);
                    if dtype != info.dtype || shape != info.shape {
                        return Err(binding_error(
                            &info.name,
                            format!(
                                "must be {}{:?} on this rank, is {dtype}{shape:?}",
                                info.dtype, info.shape
                            ),
                        ));
                    }
                }
            }
        }
        // Lend the tensors; on failure give back those already lent.
        let mut lent: Vec<(String, B::Buffer, bool)> = Vec::new();
        let mut failure = None;
        for (name, tensor) in bindings.map.iter_mut() {
            let Some(info) = held.get(name) else { continue };
            let output = info.role == Role::Output;
            match self.evaluator.backend_mut().attach(tensor, output) {
                Ok(buffer) => lent.push((name.clone(), buffer, output)),
                Err(source) => {
                    failure = Some(Error::Backend {
                        rank,
                        name: name.clone(),
                        source,
                    });
                    break;
                }
            }
        }
        let external: BTreeMap<String, B::Buffer> = lent
            .iter()
            .map(|(name, buffer, _)| (name.clone(), *buffer))
            .collect();
        let outcome = match failure {
            Some(e) => Ok(Err(e)),
            None => catch_unwind(AssertUnwindSafe(|| {
                self.evaluator
                    .run_with(&BTreeMap::new(), &external)
                    .map_err(Error::from)
            })),
        };
        let succeeded = matches!(outcome, Ok(Ok(_)));
        let mut returned = Ok(());
        for (name, buffer, output) in lent {
            let Some(tensor) = bindings.map.get_mut(&name) else {
                continue;
            };
            // The padding of an uneven shard's buffer is never written.
            let padded = self
                .compiled
                .host()
                .tensor_by_name(&name)
                .is_some_and(|t| self.compiled.host().is_padded(t));
            let r =
                self.evaluator
                    .backend_mut()
                    .detach(buffer, tensor, output && succeeded && !padded);
            if let (Err(source), Ok(())) = (r, &returned) {
                returned = Err(Error::Backend { rank, name, source });
            }
        }
        match outcome {
            Err(panic) => resume_unwind(panic),
            Ok(result) => {
                let outputs = result?;
                returned?;
                Ok(outputs)
            }
        }
    }
}
