//! MoE dispatch/combine for torch tensors (`meshflow.torch.AllToAll`), over the MoE transports
//! of the kernels crate: NCCL (grouped send/recv of padded blocks) or NVLink (stores into
//! peer-mapped memory, CUDA IPC between processes). Every call only enqueues work on the
//! caller's current stream: no host synchronization.
//!
//! [`Engine`] is the one adapter between this module and `meshflow_kernels::moe`: set-up
//! (communicator or IPC handles through the job's rendezvous), the four phases, the outputs
//! the transport owns and its status word.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

use meshflow::kernels::moe::{MoeShape, MoeTransport, NcclMoe, NvlinkMoe};
use meshflow::kernels::nccl::{Comm, NcclLib, UniqueId};
use meshflow::kernels::python::{export, torch_stream, DlDtype, DlpackTensor};
use meshflow::kernels::{DType, Device, DeviceBuffer, KernelError, Stream};
use meshflow::runtime::rendezvous::Rendezvous;

use crate::cuda::stream_handle;
use crate::errors::MoeError;
use crate::store::rendezvous;

fn moe_error(e: impl std::fmt::Display) -> PyErr {
    MoeError::new_err(e.to_string())
}

/// The element types the MoE transports of this build move, by name.
fn moe_dtype(name: &str) -> PyResult<DType> {
    match name {
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        "f32" | "float32" => Ok(DType::F32),
        other => Err(MoeError::new_err(format!(
            "the MoE kernels of this build move f32, bf16 or f16 rows, not `{other}`"
        ))),
    }
}

/// One rank's transport, set up through the job's rendezvous.
struct Engine {
    transport: Box<dyn MoeTransport>,
}

impl Engine {
    /// Creates the transport `kind` (`"nccl"` or `"nvlink"`) of `rank` on `device`; every rank
    /// of the team calls this in the same order (`seq` numbers the calls in this process).
    fn new(
        kind: &str,
        device: &Device,
        shape: &MoeShape,
        rank: usize,
        rdv: &dyn Rendezvous,
        timeout: Duration,
        seq: u64,
    ) -> PyResult<Engine> {
        let base = format!("moe/{seq}/{}", shape.world);
        let rdv_err = |e: meshflow::runtime::rendezvous::RendezvousError| moe_error(e);
        let transport: Box<dyn MoeTransport> = match kind {
            "nccl" => {
                let lib = NcclLib::load().map_err(moe_error)?;
                let key = format!("{base}/nccl-id");
                let id = if rank == 0 {
                    let id = UniqueId::new(&lib).map_err(moe_error)?;
                    rdv.publish(&key, &id.to_bytes()).map_err(rdv_err)?;
                    id
                } else {
                    let bytes = rdv.fetch(&key, timeout).map_err(rdv_err)?;
                    UniqueId::from_slice(&bytes).map_err(moe_error)?
                };
                rdv.barrier(&format!("{key}/ready"), shape.world, timeout)
                    .map_err(rdv_err)?;
                let comm =
                    Comm::init_rank(&lib, device, shape.world, &id, rank).map_err(moe_error)?;
                Box::new(NcclMoe::new(comm, shape).map_err(moe_error)?)
            }
            "nvlink" => {
                let mut t = NvlinkMoe::new_ipc(device, shape, rank).map_err(moe_error)?;
                rdv.publish(
                    &format!("{base}/ipc/{rank}"),
                    &t.export_handles().map_err(moe_error)?,
                )
                .map_err(rdv_err)?;
                let handles = (0..shape.world)
                    .map(|r| rdv.fetch(&format!("{base}/ipc/{r}"), timeout))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(rdv_err)?;
                t.import_handles(&handles).map_err(moe_error)?;
                rdv.barrier(&format!("{base}/ipc/ready"), shape.world, timeout)
                    .map_err(rdv_err)?;
                Box::new(t)
            }
            other => {
                return Err(MoeError::new_err(format!(
                    "unknown MoE transport `{other}` (expected nccl or nvlink)"
                )))
            }
        };
        Ok(Engine { transport })
    }

    /// Whether a step can be captured in a CUDA graph and replayed: both transports of this
    /// build enqueue only device work (NCCL's grouped send/recv; the NVLink kernels keep their
    /// step number on the device, so every replay advances it). A transport of another name
    /// is not known to be.
    fn capturable(&self) -> bool {
        matches!(self.transport.name(), "nccl" | "nvlink")
    }

    fn shape(&self) -> &MoeShape {
        self.transport.shape()
    }

    fn dispatch(
        &mut self,
        s: &Stream,
        x: &DeviceBuffer,
        topk: &DeviceBuffer,
    ) -> Result<(), KernelError> {
        self.transport.dispatch(s, x, topk)
    }

    fn combine(
        &mut self,
        s: &Stream,
        expert_y: &DeviceBuffer,
        weights: &DeviceBuffer,
        out: &DeviceBuffer,
    ) -> Result<(), KernelError> {
        let counts = self.transport.expert_counts()?.clone();
        let routing = self.transport.routing()?.clone();
        self.transport
            .combine(s, expert_y, &counts, &routing, Some(weights), out)
    }

    /// `(expert_x, expert_counts, routing)`, owned by the transport and rewritten by every
    /// dispatch.
    fn outputs(&self) -> Result<[(DeviceBuffer, DType, Vec<u64>); 3], KernelError> {
        let s = self.shape();
        let (l, c) = (s.local_experts() as u64, s.capacity as u64);
        let t = &self.transport;
        Ok([
            (t.expert_x()?.clone(), s.dtype, vec![l, c, s.hidden as u64]),
            (t.expert_counts()?.clone(), DType::I32, vec![l]),
            (t.routing()?.clone(), DType::I32, vec![l, c, 2]),
        ])
    }

    fn status(&self, s: &Stream) -> Result<u32, KernelError> {
        self.transport.status(s).map(|st| st.0)
    }

    fn clear_status(&self, s: &Stream) -> Result<(), KernelError> {
        self.transport.clear_status(s)
    }
}

/// Numbers the MoE layers made in this process (the same order on every rank).
static NEXT_LAYER: AtomicU64 = AtomicU64::new(0);

/// One rank's MoE dispatch/combine for one layer shape (see `meshflow.torch.AllToAll`).
#[pyclass(module = "meshflow", name = "NativeAllToAll", unsendable)]
pub struct AllToAll {
    engine: Engine,
    device: Device,
    /// The last torch stream used, by handle (wrapping a stream is a driver query).
    stream: Option<(u64, Stream)>,
}

impl AllToAll {
    fn stream(&mut self, stream: &Bound<'_, PyAny>) -> PyResult<Stream> {
        let handle = stream_handle(stream)?;
        if let Some((h, s)) = &self.stream {
            if *h == handle {
                return Ok(s.clone());
            }
        }
        let s = torch_stream(stream, &self.device).map_err(moe_error)?;
        self.stream = Some((handle, s.clone()));
        Ok(s)
    }

    fn tensor(
        &self,
        what: &str,
        capsule: &Bound<'_, PyAny>,
        dtype: DType,
        shape: &[u64],
    ) -> PyResult<DeviceBuffer> {
        let t = DlpackTensor::from_capsule(capsule, &self.device)
            .map_err(|e| MoeError::new_err(format!("{what}: {e}")))?;
        if t.dtype != DlDtype::of(dtype) || t.shape != shape {
            return Err(MoeError::new_err(format!(
                "{what} must be {dtype}{shape:?}, is {:?}{:?}",
                t.dtype
                    .dtype()
                    .map_or_else(|| format!("{:?}", t.dtype), |d| d.to_string()),
                t.shape
            )));
        }
        Ok(t.buffer)
    }
}

#[pymethods]
impl AllToAll {
    /// Sets up `rank` of a team of `world` ranks on GPU `device`: `experts` experts (`experts /
    /// world` per rank), `top_k` per token, `tokens` tokens per rank of `hidden` elements,
    /// expert outputs of `out_hidden`, at most `capacity` rows per local expert, rows of
    /// `dtype`, moved by `transport` (`"nccl"` or `"nvlink"`); the ranks meet through `store`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (rank, world, experts, top_k, tokens, hidden, out_hidden, capacity, dtype, transport, device, store, namespace, timeout = 120.0))]
    fn new(
        rank: usize,
        world: usize,
        experts: usize,
        top_k: usize,
        tokens: usize,
        hidden: usize,
        out_hidden: usize,
        capacity: usize,
        dtype: &str,
        transport: &str,
        device: usize,
        store: &Bound<'_, PyAny>,
        namespace: &str,
        timeout: f64,
    ) -> PyResult<AllToAll> {
        let shape = MoeShape {
            world,
            experts,
            top_k,
            tokens,
            hidden,
            out_hidden,
            capacity,
            dtype: moe_dtype(dtype)?,
        };
        shape.validate().map_err(moe_error)?;
        let timeout = Duration::try_from_secs_f64(timeout).map_err(moe_error)?;
        let device = Device::new(device).map_err(moe_error)?;
        let rdv: Arc<dyn Rendezvous> = rendezvous(store, namespace, timeout)?;
        let seq = NEXT_LAYER.fetch_add(1, Ordering::Relaxed);
        let engine = Engine::new(transport, &device, &shape, rank, &*rdv, timeout, seq)?;
        Ok(AllToAll {
            engine,
            device,
            stream: None,
        })
    }

    /// Whether a step can be captured in a CUDA graph.
    #[getter]
    fn capturable(&self) -> bool {
        self.engine.capturable()
    }

    /// The transport's outputs as DLPack capsules, `(expert_x, expert_counts, routing)`: the
    /// memory every dispatch rewrites (no copy).
    fn outputs<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyCapsule>>> {
        self.engine
            .outputs()
            .map_err(moe_error)?
            .iter()
            .map(|(buf, dtype, shape)| {
                export(py, buf, DlDtype::of(*dtype), shape).map_err(moe_error)
            })
            .collect()
    }

    /// Enqueues a dispatch of `x[T, H]` with `topk_idx[T, K]` (int32) on `stream`.
    fn dispatch(
        &mut self,
        x: &Bound<'_, PyAny>,
        topk_idx: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let s = *self.engine.shape();
        let x = self.tensor("x", x, s.dtype, &[s.tokens as u64, s.hidden as u64])?;
        let k = self.tensor(
            "topk_idx",
            topk_idx,
            DType::I32,
            &[s.tokens as u64, s.top_k as u64],
        )?;
        let stream = self.stream(stream)?;
        self.engine.dispatch(&stream, &x, &k).map_err(moe_error)
    }

    /// Enqueues the combine of `expert_y[L, C, F]` with `weights[T, K]` (float32) into
    /// `out[T, F]` on `stream`.
    fn combine(
        &mut self,
        expert_y: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        stream: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let s = *self.engine.shape();
        let (l, c) = (s.local_experts() as u64, s.capacity as u64);
        let y = self.tensor("expert_y", expert_y, s.dtype, &[l, c, s.out_hidden as u64])?;
        let w = self.tensor(
            "topk_weights",
            weights,
            DType::F32,
            &[s.tokens as u64, s.top_k as u64],
        )?;
        let o = self.tensor("out", out, s.dtype, &[s.tokens as u64, s.out_hidden as u64])?;
        let stream = self.stream(stream)?;
        self.engine.combine(&stream, &y, &w, &o).map_err(moe_error)
    }

    /// Reads the device status word (waits for `stream`: keep it off the hot path):
    /// `{"ok", "overflow", "bad_expert", "bad_routing", "timeout"}`.
    fn status<'py>(
        &mut self,
        py: Python<'py>,
        stream: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        use meshflow::kernels::moe::MoeStatus as S;
        let stream = self.stream(stream)?;
        let bits = S(self.engine.status(&stream).map_err(moe_error)?);
        let d = PyDict::new(py);
        d.set_item("ok", bits.is_ok())?;
        d.set_item("overflow", bits.overflow())?;
        d.set_item("bad_expert", bits.bad_expert())?;
        d.set_item("bad_routing", bits.bad_routing())?;
        d.set_item("timeout", bits.timeout())?;
        Ok(d)
    }

    /// Clears the device status word (enqueued on `stream`).
    fn clear_status(&mut self, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let stream = self.stream(stream)?;
        self.engine.clear_status(&stream).map_err(moe_error)
    }
}
