//! [`compile`] and what it produces: [`Compiled`], the host program with what it came from.

use std::collections::BTreeMap;

use meshflow_ir::host::Role;
use meshflow_ir::{parse_host, verify_host, DType, DeviceId, HostProgram, InstKind, Program};
use meshflow_passes::{Dump, ExplainRecord, PassTiming, Plan, Transport};

use super::Options;
use crate::check::{check_program, CheckReport};
use crate::error::Error;
use crate::runtime::data::TensorData;
use crate::runtime::shard::Sharding;

/// A host program ready to run, with the level-1 program it was lowered from (absent when
/// loaded from text) and the compiler's reports.
#[derive(Clone, Debug)]
pub struct Compiled {
    program: Option<Program>,
    host: HostProgram,
    world_size: usize,
    check: Option<CheckReport>,
    timings: Vec<PassTiming>,
    explain: Vec<ExplainRecord>,
    plans: BTreeMap<String, Plan>,
    transport: Option<Transport>,
    /// Why the plans were priced with their machine profile (`None`: loaded from text).
    profile_reason: Option<String>,
    dumps: Vec<Dump>,
    /// How it runs: graphs and the proxy wire, from the options.
    run: RunSettings,
}

/// The run settings of [`Options`] a compiled program keeps for its executors.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
struct RunSettings {
    pub graph: bool,
    pub wire: Option<meshflow_kernels::proxy::WireChoice>,
}

impl RunSettings {
    fn of(options: &Options) -> RunSettings {
        RunSettings {
            graph: options.records_graphs(),
            wire: options.proxy_wire(),
        }
    }
}

/// An input or output of a host program, as one rank sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The name (the level-1 tensor's).
    pub name: String,
    /// [`Role::Input`] or [`Role::Output`].
    pub role: Role,
    /// Element type.
    pub dtype: DType,
    /// The local (per-rank) shape: what a binding must have.
    pub shape: Vec<u64>,
    /// The ranks that hold it (its mesh's devices).
    pub devices: Vec<DeviceId>,
}

/// Lowers a level-1 program to a host program: runs every pass of the
/// [pipeline](crate::pipeline) with `options`, checks the program fits the job
/// ([`Options::for_ranks`]) and, unless disabled, runs the static cross-rank check.
pub fn compile(program: &Program, options: &Options) -> Result<Compiled, Error> {
    let world_size = options.job_size(program.world_size())?;
    let out = crate::pipeline::pipeline().run(program.clone(), options.pass_options())?;
    let check = options
        .checks()
        .then(|| check_program(&out.host, world_size))
        .transpose()?;
    Ok(Compiled {
        program: Some(out.program),
        host: out.host,
        world_size,
        check,
        timings: out.timings,
        explain: out.explain,
        plans: out.plans,
        transport: out.transport,
        profile_reason: Some(options.profile_reason().to_string()),
        dumps: out.dumps,
        run: RunSettings::of(options),
    })
}

impl Compiled {
    /// Loads a host program from its text ([`Compiled::host_text`]): parses, verifies, checks
    /// the job size against `options` and runs the cross-rank check unless disabled. The
    /// pass options of `options` do not apply (nothing is lowered).
    pub fn from_host_text(text: &str, options: &Options) -> Result<Compiled, Error> {
        let host = parse_host(text)?;
        verify_host(&host)?;
        Compiled::from_host(host, options)
    }

    /// Wraps an already built and verified host program (see [`Compiled::from_host_text`]).
    pub fn from_host(host: HostProgram, options: &Options) -> Result<Compiled, Error> {
        let world_size = options.job_size(host.world_size())?;
        let check = options
            .checks()
            .then(|| check_program(&host, world_size))
            .transpose()?;
        Ok(Compiled {
            program: None,
            host,
            world_size,
            check,
            timings: Vec::new(),
            explain: Vec::new(),
            plans: BTreeMap::new(),
            transport: None,
            profile_reason: None,
            dumps: Vec::new(),
            run: RunSettings::of(options),
        })
    }

    /// The host program.
    pub fn host(&self) -> &HostProgram {
        &self.host
    }

    /// The host program in its text format (`.mfh`); [`Compiled::from_host_text`] reads it
    /// back.
    pub fn host_text(&self) -> String {
        self.host.to_string()
    }

    /// The level-1 program as lowered (after propagation and decomposition), when compiled
    /// here rather than loaded from text.
    pub fn program(&self) -> Option<&Program> {
        self.program.as_ref()
    }

    /// The level-1 program as lowered, or [`Error::NoProgram`] for a host program loaded from
    /// text.
    pub fn level1(&self) -> Result<&Program, Error> {
        self.program.as_ref().ok_or(Error::NoProgram {
            what: "the lowered level-1 program",
        })
    }

    /// Whether executors record every step as a CUDA graph ([`Options::graph`]).
    pub fn records_graphs(&self) -> bool {
        self.run.graph
    }

    /// The wire of the host proxy chosen with [`Options::wire`], if any.
    pub fn proxy_wire(&self) -> Option<meshflow_kernels::proxy::WireChoice> {
        self.run.wire
    }

    /// The number of ranks of the job (one executor each).
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The cross-rank check's summary, when it ran.
    pub fn check_report(&self) -> Option<&CheckReport> {
        self.check.as_ref()
    }

    /// Wall time of every pass.
    pub fn timings(&self) -> &[PassTiming] {
        &self.timings
    }

    /// The decisions of `choose_decompositions` (what `meshflow lower --explain` prints).
    pub fn explain(&self) -> &[ExplainRecord] {
        &self.explain
    }

    /// The plan the schedule search took for each decision, by the name of the tensor it is
    /// about (empty when loaded from text).
    pub fn plans(&self) -> &BTreeMap<String, Plan> {
        &self.plans
    }

    /// The transport the plans assume (`None` when nothing was priced, or loaded from text):
    /// a GPU job should move the bytes over it (`CudaConfig::transport`).
    pub fn transport(&self) -> Option<Transport> {
        self.transport
    }

    /// The machine profile the plans were priced with and why (`h100x2: built-in profile of
    /// NVIDIA H100 80GB HBM3`; [`Options::profile_reason`]); `None` when loaded from text.
    pub fn profile_reason(&self) -> Option<&str> {
        self.profile_reason.as_deref()
    }

    /// IR dumps asked for with [`Options::dump_after`].
    pub fn dumps(&self) -> &[Dump] {
        &self.dumps
    }

    /// The names of the kernels the host program launches (`call_kernel`, from `custom`
    /// ops), sorted: every backend must register them.
    pub fn kernels(&self) -> Vec<String> {
        let mut names = Vec::new();
        self.host.walk(&mut |inst, _| {
            if let InstKind::CallKernel { kernel, .. } = &inst.kind {
                names.push(kernel.clone());
            }
        });
        names.sort();
        names.dedup();
        names
    }

    /// The program's inputs, in declaration order, with their local shapes.
    pub fn inputs(&self) -> Vec<TensorInfo> {
        self.infos(Role::Input)
    }

    /// The program's outputs, in declaration order, with their local shapes.
    pub fn outputs(&self) -> Vec<TensorInfo> {
        self.infos(Role::Output)
    }

    /// The input or output called `name`.
    pub fn tensor(&self, name: &str) -> Option<TensorInfo> {
        self.inputs()
            .into_iter()
            .chain(self.outputs())
            .find(|t| t.name == name)
    }

    fn infos(&self, role: Role) -> Vec<TensorInfo> {
        self.host
            .tensors
            .values()
            .filter(|d| d.role == role)
            .map(|d| TensorInfo {
                name: d.name.clone(),
                role,
                dtype: d.dtype,
                shape: d.shape.clone(),
                devices: self
                    .host
                    .meshes
                    .get(d.mesh)
                    .map(|m| m.mesh.devices().to_vec())
                    .unwrap_or_default(),
            })
            .collect()
    }

    /// Cuts a full (unsharded) tensor of the level-1 tensor `name` into the local tensor of
    /// every rank that holds it, by its layout. A partial program input (one with reduction
    /// axes) takes its unreduced data, reduction axes included; each rank gets the sum over its
    /// chunk of them.
    pub fn scatter(
        &self,
        name: &str,
        full: &TensorData,
    ) -> Result<BTreeMap<DeviceId, TensorData>, Error> {
        if let Some(program) = self.program.as_ref() {
            if let Some(t) = program.tensor_by_name(name) {
                if crate::runtime::shard_partial::is_partial_input(program, t) {
                    return Ok(crate::runtime::shard_partial::scatter_partial(
                        program, t, full,
                    )?);
                }
            }
        }
        Ok(self.sharding(name, "scatter")?.scatter(full)?)
    }

    /// Assembles the full tensor of the level-1 tensor `name` from the local tensors of the
    /// ranks that hold it (replicas must agree).
    pub fn gather(
        &self,
        name: &str,
        locals: &BTreeMap<DeviceId, TensorData>,
    ) -> Result<TensorData, Error> {
        Ok(self.sharding(name, "gather")?.gather(locals)?)
    }

    fn sharding(&self, name: &str, what: &'static str) -> Result<Sharding, Error> {
        let program = self.program.as_ref().ok_or(Error::NoProgram { what })?;
        let t = program
            .tensor_by_name(name)
            .ok_or_else(|| Error::UnknownTensor(name.to_string()))?;
        Ok(Sharding::of(program, t)?)
    }
}
