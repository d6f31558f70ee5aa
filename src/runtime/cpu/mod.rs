//! [`CpuBackend`]: the embedded CPU backend. N ranks run as threads of one process on host
//! memory, with real data movement (a shared [`Fabric`] of mailboxes) and real arithmetic
//! ([`cpu_ops`]).
//!
//! Execution is eager and in host order, but the asynchronous semantics of the host IR are
//! modelled and checked: streams, `synchronize`, posting and `wait` maintain vector clocks
//! (module `race`), and every buffer access is checked against happens-before. Reading a
//! communication's output (or overwriting its input) before the matching `wait`, or using a
//! chunk written on another stream without `synchronize`, is a race error naming both
//! instructions. Race checking can be switched off ([`CpuConfig::race_check`]).

mod comm;
pub mod fabric;
mod kernels;
mod race;

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use meshflow_ir::{Arena, ComputeOp, DType, DeviceId, EntityRef};

pub use fabric::{Fabric, Payload, RemoteLink};
pub use kernels::{CpuKernelFn, CpuKernels};

use super::backend::{
    AccessSite, Backend, BackendError, CommLabel, CommRequest, InstCtx, KernelId, PlanInfo,
    RaceReport, StreamIndex, TeamId, TensorView,
};
use super::cpu_ops;
use super::data::{Storage, TensorData};
use super::view::{View, ViewMut};
use crate::ordering::{Access, Clocks, Scope, Shadow};

#[cfg(feature = "fault-injection")]
pub use crate::runtime::faults::{Fault, FaultKind, FAULT_EXIT_STATUS};

/// Settings of the CPU backend.
#[derive(Clone, Debug)]
pub struct CpuConfig {
    /// Worker streams per rank.
    pub stream_pool: usize,
    /// How long a receive waits for its peer.
    pub timeout: Duration,
    /// Check every buffer access against happens-before.
    pub race_check: bool,
    /// Fill fresh buffers with NaN / [`INT_POISON`](crate::runtime::data::INT_POISON) and
    /// track which elements get written: reading back a program output with elements the
    /// program never wrote on a rank that holds it is then an error naming the output.
    pub poison: bool,
    /// Injected faults (tests only).
    #[cfg(feature = "fault-injection")]
    pub faults: Vec<Fault>,
    /// Kernels for `call_kernel`.
    pub kernels: CpuKernels,
    /// Most bytes of buffers one rank may hold allocated at once (`None`: no limit beyond
    /// what the host can allocate). An allocation beyond it, or one the host cannot satisfy,
    /// is an error naming its size, never an abort.
    pub memory_limit: Option<u64>,
    /// Most messages one rank may have sent to another that the receiver has not taken yet;
    /// a further send waits for room (up to [`timeout`](Self::timeout)), like NCCL's bounded
    /// buffers. Without a bound, a rank that only sends (a pipeline's first stage, run step
    /// after step by an embedder) runs ahead of its receivers and its messages pile up
    /// without limit. At least 1.
    pub max_in_flight: usize,
}

impl Default for CpuConfig {
    fn default() -> CpuConfig {
        CpuConfig {
            stream_pool: 4,
            timeout: Duration::from_secs(5),
            race_check: true,
            poison: true,
            #[cfg(feature = "fault-injection")]
            faults: Vec::new(),
            kernels: CpuKernels::new(),
            memory_limit: None,
            max_in_flight: 256,
        }
    }
}

/// Buffers held, and their bytes (see [`CpuBackend::live_buffers`], [`Fabric::in_flight`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct BufferStats {
    /// Number of buffers (or messages).
    pub buffers: usize,
    /// Their total size in bytes.
    pub bytes: u64,
}

impl BufferStats {
    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.buffers == 0 && self.bytes == 0
    }
}

impl fmt::Display for BufferStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} buffer(s), {} bytes", self.buffers, self.bytes)
    }
}

/// A CPU buffer handle: a slot and its generation (so a stale handle is detected).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct CpuBuffer {
    slot: u32,
    generation: u32,
}

#[derive(Debug)]
struct HostBuf {
    storage: Storage,
    shape: Vec<u64>,
    accesses: Shadow<AccessSite>,
    /// Which elements have been written (tracked when allocations are poisoned), so that
    /// reading back an output the program never wrote is an error, not silent garbage.
    written: Option<Vec<bool>>,
    /// Bytes counted in [`CpuBackend::live_buffers`] for this buffer (its storage when made;
    /// an exported buffer's storage is moved out before it is released).
    bytes: u64,
}

/// Calls `f` on the element offset of every element of a strided view.
fn for_each_offset(offset: u64, shape: &[u64], strides: &[u64], f: &mut impl FnMut(u64)) {
    if shape.contains(&0) {
        return;
    }
    let mut index = vec![0u64; shape.len()];
    loop {
        let off = offset + index.iter().zip(strides).map(|(i, s)| i * s).sum::<u64>();
        f(off);
        let mut k = shape.len();
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            index[k] += 1;
            if index[k] < shape[k] {
                break;
            }
            index[k] = 0;
        }
    }
}

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    buf: Option<HostBuf>,
}

/// A posted CPU communication: the clock its completion stands for (when race checking).
#[derive(Clone, Debug)]
pub struct CpuComm {
    clock: Option<Arc<[u32]>>,
}

#[derive(Debug)]
struct CpuTeam {
    fingerprint: u64,
    seq: u64,
}

/// A started member of a coalescing group and its completion clock.
type GroupMember = (comm::Exchange, Option<Arc<[u32]>>);

/// The embedded CPU backend for one rank.
#[derive(Debug)]
pub struct CpuBackend {
    device: DeviceId,
    fabric: Arc<Fabric>,
    pool: usize,
    timeout: Duration,
    race_check: bool,
    poison: bool,
    #[cfg(feature = "fault-injection")]
    faults: Vec<Fault>,
    kernels: CpuKernels,
    memory_limit: Option<u64>,
    max_in_flight: usize,
    live: BufferStats,
    comm_labels: usize,
    slots: Vec<Slot>,
    free: Vec<u32>,
    current: StreamIndex,
    teams: Arena<TeamId, CpuTeam>,
    clocks: Option<Clocks>,
    group: Option<Vec<GroupMember>>,
    #[cfg(feature = "fault-injection")]
    posted: usize,
    race_cost: RaceCheckCost,
}

/// What race checking has cost a rank (see [`CpuBackend::race_check_cost`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RaceCheckCost {
    /// Buffer accesses checked.
    pub accesses: u64,
    /// Access records and runs visited while checking and recording them.
    pub work: u64,
}

impl CpuBackend {
    /// The backend of rank `device` on a shared fabric.
    pub fn new(device: DeviceId, fabric: Arc<Fabric>, config: &CpuConfig) -> CpuBackend {
        CpuBackend {
            device,
            fabric,
            pool: config.stream_pool.max(1),
            timeout: config.timeout,
            race_check: config.race_check,
            poison: config.poison,
            #[cfg(feature = "fault-injection")]
            faults: config
                .faults
                .iter()
                .filter(|f| f.rank == device)
                .copied()
                .collect(),
            kernels: config.kernels.clone(),
            memory_limit: config.memory_limit,
            max_in_flight: config.max_in_flight,
            live: BufferStats::default(),
            comm_labels: 0,
            slots: Vec::new(),
            free: Vec::new(),
            current: StreamIndex::MAIN,
            teams: Arena::new(),
            clocks: None,
            group: None,
            #[cfg(feature = "fault-injection")]
            posted: 0,
            race_cost: RaceCheckCost::default(),
        }
    }

    /// The fabric this rank uses.
    pub fn fabric(&self) -> &Arc<Fabric> {
        &self.fabric
    }

    /// The buffers this rank holds allocated now. The [`Evaluator`](crate::runtime::Evaluator)
    /// releases every buffer at the end of each run, so between runs this is empty.
    pub fn live_buffers(&self) -> BufferStats {
        self.live
    }

    fn insert(&mut self, buf: HostBuf) -> Result<CpuBuffer, BackendError> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot::default());
                u32::try_from(self.slots.len() - 1)
                    .map_err(|_| BackendError::Invalid("too many buffers".into()))?
            }
        };
        self.live.buffers += 1;
        self.live.bytes += buf.bytes;
        let s = &mut self.slots[slot as usize];
        s.buf = Some(buf);
        Ok(CpuBuffer {
            slot,
            generation: s.generation,
        })
    }

    /// Makes a buffer of `data`'s storage, moved in without a copy (used for caller-owned
    /// tensors; give it back with [`CpuBackend::export`]). `data` is left empty meanwhile.
    /// With poisoning on, its elements count as written when `written` (an input) and as not
    /// yet written otherwise (an output).
    pub fn import(
        &mut self,
        data: &mut TensorData,
        written: bool,
    ) -> Result<CpuBuffer, BackendError> {
        let storage = std::mem::replace(data.storage_mut(), Storage::F32(Vec::new()));
        let n = storage.len();
        let buf = HostBuf {
            bytes: storage.size_bytes(),
            storage,
            shape: data.shape().to_vec(),
            accesses: Shadow::new(),
            written: self.poison.then(|| vec![written; n]),
        };
        self.insert(buf)
    }

    /// Moves the storage of a buffer made by [`CpuBackend::import`] back into `data` (no copy)
    /// and releases the buffer. With poisoning on and `check_written`, an element the program
    /// never wrote is an error (reported after the storage is back in `data`).
    pub fn export(
        &mut self,
        buffer: CpuBuffer,
        data: &mut TensorData,
        check_written: bool,
    ) -> Result<(), BackendError> {
        let b = self.buf_mut(buffer)?;
        let storage = std::mem::replace(&mut b.storage, Storage::F32(Vec::new()));
        let unwritten = b
            .written
            .as_ref()
            .map_or(0, |w| w.iter().filter(|&&x| !x).count());
        *data.storage_mut() = storage;
        self.deallocate(buffer)?;
        if check_written && unwritten > 0 {
            return Err(BackendError::Invalid(format!(
                "{unwritten} of the {} elements of this output were never written by the \
                 program on this rank",
                data.numel()
            )));
        }
        Ok(())
    }

    fn buf(&self, b: CpuBuffer) -> Result<&HostBuf, BackendError> {
        self.slots
            .get(b.slot as usize)
            .filter(|s| s.generation == b.generation)
            .and_then(|s| s.buf.as_ref())
            .ok_or_else(|| BackendError::Invalid(format!("use of a released buffer {b:?}")))
    }

    fn buf_mut(&mut self, b: CpuBuffer) -> Result<&mut HostBuf, BackendError> {
        self.slots
            .get_mut(b.slot as usize)
            .filter(|s| s.generation == b.generation)
            .and_then(|s| s.buf.as_mut())
            .ok_or_else(|| BackendError::Invalid(format!("use of a released buffer {b:?}")))
    }

    fn view<'a>(&'a self, v: &'a TensorView<CpuBuffer>) -> Result<View<'a>, BackendError> {
        let b = self.buf(v.buffer)?;
        View::new(
            &b.storage,
            v.offset,
            Cow::Borrowed(&v.shape),
            Cow::Borrowed(&v.strides),
        )
        .map_err(|e| BackendError::Invalid(e.to_string()))
    }

    /// Takes the storages of `views`' buffers out of their slots (they must be distinct).
    fn take_storages(
        &mut self,
        views: &[&TensorView<CpuBuffer>],
    ) -> Result<Vec<Storage>, BackendError> {
        for (i, a) in views.iter().enumerate() {
            if views[..i].iter().any(|b| b.buffer == a.buffer) {
                return Err(BackendError::Invalid(
                    "two outputs of one instruction share a buffer".into(),
                ));
            }
        }
        let mut out = Vec::with_capacity(views.len());
        for v in views {
            let b = self.buf_mut(v.buffer)?;
            out.push(std::mem::replace(&mut b.storage, Storage::F32(Vec::new())));
        }
        Ok(out)
    }

    /// Puts back the storages taken for writing and records which elements were written.
    fn put_storages(&mut self, views: &[&TensorView<CpuBuffer>], storages: Vec<Storage>) {
        for (v, s) in views.iter().zip(storages) {
            if let Ok(b) = self.buf_mut(v.buffer) {
                b.storage = s;
                if let Some(written) = b.written.as_mut() {
                    for_each_offset(v.offset, &v.shape, &v.strides, &mut |o| {
                        if let Some(w) = written.get_mut(o as usize) {
                            *w = true;
                        }
                    });
                }
            }
        }
    }

    /// Runs `f` on writable views of `outputs` (distinct buffers).
    fn write_views<R>(
        &mut self,
        outputs: &[&TensorView<CpuBuffer>],
        f: impl FnOnce(&mut [ViewMut<'_>]) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        let mut storages = self.take_storages(outputs)?;
        let r = (|| {
            let mut muts = Vec::with_capacity(outputs.len());
            for (s, v) in storages.iter_mut().zip(outputs) {
                muts.push(
                    ViewMut::new(
                        s,
                        v.offset,
                        Cow::Borrowed(&v.shape),
                        Cow::Borrowed(&v.strides),
                    )
                    .map_err(|e| BackendError::Invalid(e.to_string()))?,
                );
            }
            f(&mut muts)
        })();
        self.put_storages(outputs, storages);
        r
    }

    /// Checks and records accesses (reads then writes) under `clock` on `timeline`/`epoch`.
    #[allow(clippy::too_many_arguments)]
    fn check_accesses(
        &mut self,
        reads: &[&TensorView<CpuBuffer>],
        writes: &[&TensorView<CpuBuffer>],
        timeline: usize,
        epoch: u32,
        clock: &[u32],
        site: AccessSite,
    ) -> Result<(), BackendError> {
        let all = reads
            .iter()
            .map(|v| (*v, false))
            .chain(writes.iter().map(|v| (*v, true)));
        let scope = Scope::default();
        let mut regions = Vec::new();
        for (v, write) in all {
            let b = self.buf_mut(v.buffer)?;
            let region = Arc::new(race::region_of(&b.shape, v));
            let mut s = site.clone();
            s.write = write;
            let access = Access {
                region: &region,
                write,
                timeline,
                epoch,
                clock,
                site: s,
            };
            let before = b.accesses.work();
            let conflict = b.accesses.conflict(&b.shape, &access, &scope);
            self.race_cost.work += b.accesses.work() - before;
            self.race_cost.accesses += 1;
            if let Some(r) = conflict {
                return Err(BackendError::Race(Box::new(RaceReport {
                    tensor: v.tensor,
                    earlier: r.site,
                    later: access.site,
                })));
            }
            regions.push((v.buffer, region, write));
        }
        for (buffer, region, write) in regions {
            let mut s = site.clone();
            s.write = write;
            let access = Access {
                region: &region,
                write,
                timeline,
                epoch,
                clock,
                site: s,
            };
            let b = self.buf_mut(buffer)?;
            let before = b.accesses.work();
            b.accesses.record(&b.shape, &access, &scope);
            self.race_cost.work += b.accesses.work() - before;
        }
        Ok(())
    }

    /// What race checking has cost this rank so far, over every run and buffer: accesses
    /// checked and the work done for them (for tests that bound the checker's cost without
    /// timing it).
    pub fn race_check_cost(&self) -> RaceCheckCost {
        self.race_cost
    }

    /// Race-checks a compute op on the current stream.
    fn check_compute(
        &mut self,
        reads: &[&TensorView<CpuBuffer>],
        writes: &[&TensorView<CpuBuffer>],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        let current = self.current;
        let Some(clocks) = self.clocks.as_mut() else {
            return Ok(());
        };
        let (timeline, epoch) = clocks.tick(current.0);
        let clock = clocks.clock(current.0).to_vec();
        let site = AccessSite {
            preorder: ctx.preorder,
            iteration: ctx.iteration.into(),
            write: false,
            comm_label: None,
            stream: current,
        };
        self.check_accesses(reads, writes, timeline, epoch, &clock, site)
    }

    #[cfg(feature = "fault-injection")]
    fn inject_fault(&mut self) -> Result<(), BackendError> {
        let n = self.posted;
        self.posted += 1;
        let Some(fault) = self.faults.iter().find(|f| f.at_comm == n).copied() else {
            return Ok(());
        };
        match fault.kind {
            FaultKind::Error => Err(BackendError::InjectedFault { n, kind: "error" }),
            FaultKind::Panic => panic!(
                "injected panic on rank {} at communication #{n}",
                self.device
            ),
            FaultKind::Exit => {
                tracing::warn!(
                    rank = self.device,
                    "injected process exit at communication #{n}"
                );
                std::process::exit(FAULT_EXIT_STATUS)
            }
            FaultKind::Stall => {
                tracing::debug!(rank = self.device, "injected stall at communication #{n}");
                // Stop until the others give up (bounded so a lone rank cannot hang).
                self.fabric.stall(self.timeout.saturating_mul(20));
                Err(BackendError::InjectedFault { n, kind: "stall" })
            }
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Comm = CpuComm;

    fn device(&self) -> DeviceId {
        self.device
    }

    fn stream_pool_size(&self) -> usize {
        self.pool
    }

    fn prepare(&mut self, info: &PlanInfo<'_>) -> Result<(), BackendError> {
        self.teams = info
            .teams
            .values()
            .map(|t| CpuTeam {
                fingerprint: fabric::team_fingerprint(&t.members),
                seq: 0,
            })
            .collect();
        self.comm_labels = info.comm_labels();
        self.clocks = self.race_check.then(|| Clocks::new(info.comm_labels()));
        self.current = StreamIndex::MAIN;
        self.group = None;
        Ok(())
    }

    fn allocate(&mut self, dtype: DType, shape: &[u64]) -> Result<CpuBuffer, BackendError> {
        let invalid = |e: super::data::DataError| BackendError::Invalid(e.to_string());
        let n = super::data::numel_of(shape).map_err(invalid)?;
        let bytes = n.saturating_mul(dtype.size_bytes() as u64);
        if let Some(limit) = self.memory_limit {
            let total = self.live.bytes.saturating_add(bytes);
            if total > limit {
                return Err(BackendError::Invalid(format!(
                    "allocating {dtype}{shape:?} ({bytes} bytes) would hold {total} bytes on \
                     rank {}, over the memory limit of {limit} bytes",
                    self.device
                )));
            }
        }
        let storage = if self.poison {
            Storage::try_poison(dtype, n as usize)
        } else {
            Storage::try_zeros(dtype, n as usize)
        }
        .map_err(invalid)?;
        let written = match self.poison {
            true => Some(super::data::try_filled(false, n as usize).map_err(invalid)?),
            false => None,
        };
        let buf = HostBuf {
            storage,
            shape: shape.to_vec(),
            accesses: Shadow::new(),
            written,
            bytes,
        };
        self.insert(buf)
    }

    fn deallocate(&mut self, buffer: CpuBuffer) -> Result<(), BackendError> {
        // Execution is eager, so the work enqueued on the buffer is already done.
        let bytes = self.buf(buffer)?.bytes;
        let s = &mut self.slots[buffer.slot as usize];
        s.buf = None;
        self.live.buffers = self.live.buffers.saturating_sub(1);
        self.live.bytes = self.live.bytes.saturating_sub(bytes);
        s.generation = s.generation.wrapping_add(1);
        self.free.push(buffer.slot);
        Ok(())
    }

    fn upload(&mut self, buffer: CpuBuffer, data: &TensorData) -> Result<(), BackendError> {
        let b = self.buf_mut(buffer)?;
        if b.storage.len() != data.storage().len() || b.storage.dtype() != data.dtype() {
            return Err(BackendError::Invalid(format!(
                "uploading {} into a buffer of {} {}",
                data.type_string(),
                b.storage.len(),
                b.storage.dtype()
            )));
        }
        b.storage = data.storage().clone();
        b.accesses.clear();
        if let Some(written) = b.written.as_mut() {
            written.iter_mut().for_each(|w| *w = true);
        }
        Ok(())
    }

    fn download_padded(
        &mut self,
        view: &TensorView<CpuBuffer>,
    ) -> Result<TensorData, BackendError> {
        Ok(self.view(view)?.to_tensor())
    }

    fn download(&mut self, view: &TensorView<CpuBuffer>) -> Result<TensorData, BackendError> {
        if let Some(written) = self.buf_mut(view.buffer)?.written.as_ref() {
            let (mut total, mut unwritten) = (0u64, 0u64);
            for_each_offset(view.offset, &view.shape, &view.strides, &mut |o| {
                total += 1;
                if !written.get(o as usize).copied().unwrap_or(false) {
                    unwritten += 1;
                }
            });
            if unwritten > 0 {
                return Err(BackendError::Invalid(format!(
                    "{unwritten} of the {total} elements of this output were never written by \
                     the program on this rank"
                )));
            }
        }
        Ok(self.view(view)?.to_tensor())
    }

    fn set_current_stream(&mut self, stream: StreamIndex) -> Result<(), BackendError> {
        if stream.0 > self.pool {
            return Err(BackendError::Invalid(format!("no stream {}", stream.0)));
        }
        self.current = stream;
        Ok(())
    }

    fn synchronize(&mut self, stream: StreamIndex, _ctx: InstCtx<'_>) -> Result<(), BackendError> {
        if stream.0 > self.pool {
            return Err(BackendError::Invalid(format!("no stream {}", stream.0)));
        }
        let current = self.current;
        if let Some(c) = self.clocks.as_mut() {
            c.sync(current.0, stream.0);
        }
        Ok(())
    }

    fn compute(
        &mut self,
        op: &ComputeOp,
        inputs: &[&TensorView<CpuBuffer>],
        outputs: &[&TensorView<CpuBuffer>],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        if op.reads_output() {
            let reads: Vec<&TensorView<CpuBuffer>> =
                inputs.iter().chain(outputs).copied().collect();
            self.check_compute(&reads, outputs, ctx)?;
        } else {
            self.check_compute(inputs, outputs, ctx)?;
        }
        let [out] = outputs else {
            return Err(BackendError::Invalid(format!(
                "{} has one output",
                op.name()
            )));
        };
        // Inputs in the output's buffer are copied first (in-place ops).
        let copies = inputs
            .iter()
            .map(|v| {
                (v.buffer == out.buffer)
                    .then(|| self.view(v).map(|x| x.to_tensor()))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut storages = self.take_storages(&[out])?;
        let r = (|| {
            let mut ins = Vec::with_capacity(inputs.len());
            for (v, copy) in inputs.iter().zip(&copies) {
                ins.push(match copy {
                    Some(t) => View::of(t),
                    None => self.view(v)?,
                });
            }
            let mut o = ViewMut::new(
                &mut storages[0],
                out.offset,
                Cow::Borrowed(&out.shape),
                Cow::Borrowed(&out.strides),
            )
            .map_err(|e| BackendError::Invalid(e.to_string()))?;
            match self.kernels.replacement(op.name()) {
                Some(k) => k(&ins, std::slice::from_mut(&mut o), &[]).map_err(|message| {
                    BackendError::Kernel {
                        name: op.name().to_string(),
                        message,
                    }
                }),
                None => cpu_ops::run_compute(op, &ins, &mut o).map_err(BackendError::from),
            }
        })();
        self.put_storages(&[out], storages);
        r
    }

    fn kernel(&self, name: &str) -> Option<KernelId> {
        self.kernels
            .names
            .iter()
            .position(|n| n == name)
            .map(KernelId::new)
    }

    fn call_kernel(
        &mut self,
        kernel: KernelId,
        inputs: &[&TensorView<CpuBuffer>],
        outputs: &[&TensorView<CpuBuffer>],
        args: &[i64],
        ctx: InstCtx<'_>,
    ) -> Result<(), BackendError> {
        let (Some(name), Some(f)) = (
            self.kernels.names.get(kernel.index()).cloned(),
            self.kernels.kernels.get(kernel.index()).cloned(),
        ) else {
            return Err(BackendError::Invalid(format!("unknown kernel {kernel:?}")));
        };
        self.check_compute(inputs, outputs, ctx)?;
        let copies: Vec<TensorData> = inputs
            .iter()
            .map(|v| self.view(v).map(|x| x.to_tensor()))
            .collect::<Result<_, _>>()?;
        self.write_views(outputs, |outs| {
            let ins: Vec<View<'_>> = copies.iter().map(View::of).collect();
            f(&ins, outs, args).map_err(|message| BackendError::Kernel { name, message })
        })
    }

    fn post(
        &mut self,
        request: &CommRequest<'_, CpuBuffer>,
        ctx: InstCtx<'_>,
    ) -> Result<CpuComm, BackendError> {
        if self.fabric.aborted() {
            return Err(self.fabric.abort_error());
        }
        #[cfg(feature = "fault-injection")]
        self.inject_fault()?;
        let id = request.team().id;
        let team = self
            .teams
            .get_mut(id)
            .ok_or_else(|| BackendError::Invalid(format!("unknown team {id:?}")))?;
        team.seq += 1;
        let tag = (team.fingerprint, team.seq);
        let current = self.current;
        let label = request.label();
        let clock = match self.clocks.as_mut() {
            Some(c) => {
                let clock = c.post(current.0, label.index());
                let timeline = label.index();
                let epoch = clock[timeline];
                let (reads, writes) = comm::accesses(request);
                let site = AccessSite {
                    preorder: ctx.preorder,
                    iteration: ctx.iteration.into(),
                    write: false,
                    comm_label: Some(label),
                    stream: current,
                };
                self.check_accesses(&reads, &writes, timeline, epoch, &clock, site)?;
                Some(clock)
            }
            None => None,
        };
        let exchange = comm::start(self, request, tag)?;
        match self.group.as_mut() {
            Some(g) => g.push((exchange, clock.clone())),
            None => comm::finish(self, exchange)?,
        }
        Ok(CpuComm { clock })
    }

    fn begin_group(&mut self) -> Result<(), BackendError> {
        if self.group.is_some() {
            return Err(BackendError::Invalid("nested coalescing group".into()));
        }
        self.group = Some(Vec::new());
        Ok(())
    }

    fn end_group(&mut self, label: CommLabel, _ctx: InstCtx<'_>) -> Result<CpuComm, BackendError> {
        let members = self
            .group
            .take()
            .ok_or_else(|| BackendError::Invalid("end_coalescing without a group".into()))?;
        let current = self.current;
        let mut clock: Option<Vec<u32>> = self
            .clocks
            .as_mut()
            .map(|c| c.post(current.0, label.index()).to_vec());
        for (exchange, member_clock) in members {
            comm::finish(self, exchange)?;
            if let (Some(c), Some(m)) = (clock.as_mut(), member_clock) {
                crate::ordering::join_into(c, &m);
            }
        }
        Ok(CpuComm {
            clock: clock.map(Into::into),
        })
    }

    fn wait(&mut self, comm: &CpuComm, _ctx: InstCtx<'_>) -> Result<(), BackendError> {
        if self.fabric.aborted() {
            return Err(self.fabric.abort_error());
        }
        let current = self.current;
        if let (Some(c), Some(clock)) = (self.clocks.as_mut(), comm.clock.as_ref()) {
            c.join(current.0, clock);
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        if self.group.is_some() {
            return Err(BackendError::Invalid(
                "a coalescing group was never ended".into(),
            ));
        }
        // Every communication is complete and every buffer is released after the run, so the
        // next run starts from fresh vector clocks (they would otherwise grow without bound,
        // and a `u32` clock overflows after ~4e9 operations of an embedder's long run).
        // Buffers that outlive the run (caller-owned ones) forget their accesses: everything
        // is complete, so nothing recorded so far can race with what comes later.
        if let Some(c) = self.clocks.as_mut() {
            *c = Clocks::new(self.comm_labels);
            for b in self.slots.iter_mut().filter_map(|s| s.buf.as_mut()) {
                b.accesses.clear();
            }
        }
        Ok(())
    }

    fn supports_moe_wire(&self, _wire: meshflow_ir::MoeWire) -> bool {
        true
    }
}
