//! Operands of device ops: byte ranges of views, packed copies of strided views, outputs
//! written through a packed temporary, and copies between host data and buffers.

use meshflow_ir::DType;
use meshflow_kernels::DeviceBuffer;

use super::core::{DeviceCore, Unstage};
use super::layout::{elem_bytes, fold, kdtype, packed, view_is_contiguous};
use super::memory::CudaBuffer;
use crate::runtime::backend::{BackendError, TensorView};
use crate::runtime::data::{Storage, TensorData};

/// Where an op writes an output: the view's own bytes, or a temporary copied into the view
/// afterwards ([`DeviceCore::finish_output`]).
#[derive(Debug)]
pub(super) struct OutSlot {
    pub buf: DeviceBuffer,
    unstage: Option<(DeviceBuffer, TensorView<CudaBuffer>)>,
}

impl OutSlot {
    /// Whether the op writes the view's own bytes (no temporary to copy back).
    pub(super) fn is_direct(&self) -> bool {
        self.unstage.is_none()
    }
}

impl DeviceCore {
    /// The whole buffer behind a view, checked against the view's element type.
    pub(super) fn backing(&self, v: &TensorView<CudaBuffer>) -> Result<DeviceBuffer, BackendError> {
        let entry = self.memory.get(v.buffer).ok_or_else(|| {
            BackendError::Invalid(format!("use of a released buffer {:?}", v.buffer))
        })?;
        if entry.dtype != v.dtype {
            return Err(BackendError::Invalid(format!(
                "a {} view of a {} buffer",
                v.dtype, entry.dtype
            )));
        }
        Ok(entry.data.clone())
    }

    /// The bytes of a packed view.
    fn packed_region(&self, v: &TensorView<CudaBuffer>) -> Result<DeviceBuffer, BackendError> {
        let base = self.backing(v)?;
        let es = elem_bytes(v.dtype) as u64;
        let (off, len) = (v.offset * es, v.numel() * es);
        base.view(off as usize, len as usize)
            .map_err(self.err("view of a buffer"))
    }

    /// A fresh temporary of `bytes` bytes, retired after the current op.
    pub(super) fn temp(&mut self, bytes: usize) -> Result<DeviceBuffer, BackendError> {
        self.fence_released()?;
        let (whole, data) = self
            .memory
            .raw(bytes)
            .map_err(self.err("temporary (cuMemAlloc)"))?;
        self.scratch.push(whole);
        Ok(data)
    }

    /// The view as packed bytes: its own range when packed, else a packed copy made on the
    /// current stream.
    pub(super) fn input_region(
        &mut self,
        v: &TensorView<CudaBuffer>,
    ) -> Result<DeviceBuffer, BackendError> {
        if view_is_contiguous(v) {
            return self.packed_region(v);
        }
        self.packed_copy(v)
    }

    /// A packed copy of the view (always a copy, also for packed views).
    pub(super) fn packed_copy(
        &mut self,
        v: &TensorView<CudaBuffer>,
    ) -> Result<DeviceBuffer, BackendError> {
        let src = self.backing(v)?;
        let bytes = v.numel() as usize * elem_bytes(v.dtype);
        let dst = self.temp(bytes)?;
        let p = packed(&v.shape);
        let l = fold(&v.shape, &[&v.strides, &p], &[v.offset, 0]).map_err(BackendError::Invalid)?;
        self.kernels
            .strided_copy(self.stream(), kdtype(v.dtype), &src, &l[0], &dst, &l[1])
            .map_err(self.err("strided copy"))?;
        Ok(dst)
    }

    /// Where to write output `v`; `avoid` are inputs it must not share memory with (written
    /// through a temporary when it does, or when the view is strided).
    pub(super) fn output_slot(
        &mut self,
        v: &TensorView<CudaBuffer>,
        avoid: &[&TensorView<CudaBuffer>],
    ) -> Result<OutSlot, BackendError> {
        let aliased = avoid.iter().any(|a| a.buffer == v.buffer);
        if view_is_contiguous(v) && !aliased {
            return Ok(OutSlot {
                buf: self.packed_region(v)?,
                unstage: None,
            });
        }
        let bytes = v.numel() as usize * elem_bytes(v.dtype);
        let temp = self.temp(bytes)?;
        Ok(OutSlot {
            buf: temp.clone(),
            unstage: Some((temp, v.clone())),
        })
    }

    /// Where an op that reads and writes output `v` accumulates: the view's own bytes when
    /// packed and apart from `avoid`, else a packed copy of its current contents (copied back
    /// after the op).
    pub(super) fn accumulator_slot(
        &mut self,
        v: &TensorView<CudaBuffer>,
        avoid: &[&TensorView<CudaBuffer>],
    ) -> Result<OutSlot, BackendError> {
        let aliased = avoid.iter().any(|a| a.buffer == v.buffer);
        if view_is_contiguous(v) && !aliased {
            return Ok(OutSlot {
                buf: self.packed_region(v)?,
                unstage: None,
            });
        }
        let temp = self.packed_copy(v)?;
        Ok(OutSlot {
            buf: temp.clone(),
            unstage: Some((temp, v.clone())),
        })
    }

    /// Copies the view `input` into the view `output` on the current stream (a communication
    /// whose only peer is this rank).
    pub fn local_copy(
        &mut self,
        what: &str,
        input: &TensorView<CudaBuffer>,
        output: &TensorView<CudaBuffer>,
    ) -> Result<(), BackendError> {
        let send = self.input_region(input)?;
        let slot = self.output_slot(output, &[input])?;
        slot.buf
            .copy_from(self.stream(), &send)
            .map_err(self.err(&format!("{what} (local copy)")))?;
        self.finish_output(slot)
    }

    /// Copies a temporary into its view after the op (deferred to the group's end inside a
    /// coalescing group, where communications only start at the end).
    pub(super) fn finish_output(&mut self, slot: OutSlot) -> Result<(), BackendError> {
        let Some((temp, dst)) = slot.unstage else {
            return Ok(());
        };
        let stream = self.current;
        if let Some(g) = self.group.as_mut() {
            g.unstage.push(Unstage { stream, temp, dst });
            return Ok(());
        }
        self.unstage(&temp, &dst)
    }

    /// Copies the packed `temp` into the view `dst` on the current stream.
    pub(super) fn unstage(
        &mut self,
        temp: &DeviceBuffer,
        dst: &TensorView<CudaBuffer>,
    ) -> Result<(), BackendError> {
        let base = self.backing(dst)?;
        let p = packed(&dst.shape);
        let l = fold(&dst.shape, &[&p, &dst.strides], &[0, dst.offset])
            .map_err(BackendError::Invalid)?;
        self.kernels
            .strided_copy(self.stream(), kdtype(dst.dtype), temp, &l[0], &base, &l[1])
            .map_err(self.err("strided copy"))
    }
}

impl DeviceCore {
    /// Copies host data into a whole buffer, on the main stream.
    pub(super) fn upload(
        &mut self,
        buffer: CudaBuffer,
        data: &TensorData,
    ) -> Result<(), BackendError> {
        let entry = self
            .memory
            .get(buffer)
            .ok_or_else(|| BackendError::Invalid(format!("upload into unknown {buffer:?}")))?;
        if entry.dtype != data.dtype() {
            return Err(BackendError::Invalid(format!(
                "uploading {} into a {} buffer",
                data.type_string(),
                entry.dtype
            )));
        }
        let dst = entry.data.clone();
        let s = &self.streams[0];
        let r = match data.storage() {
            Storage::F32(v) => dst.upload(s, v),
            Storage::BF16(v) => dst.upload(s, v),
            Storage::F16(v) => dst.upload(s, v),
            Storage::I32(v) => dst.upload(s, v),
            Storage::I64(v) => dst.upload(s, v),
        };
        r.map_err(self.err("upload (cuMemcpyHtoD)"))
    }

    /// Copies a view to the host after all work on the main stream (host-blocking).
    pub(super) fn download(
        &mut self,
        view: &TensorView<CudaBuffer>,
    ) -> Result<TensorData, BackendError> {
        self.current = 0;
        let buf = self.input_region(view)?;
        self.retire_scratch()?;
        let n = view.numel() as usize;
        let s = self.streams[0].clone();
        let e = self.err("download (cuMemcpyDtoH)");
        let shape = view.shape.clone();
        let bad = |x: crate::runtime::data::DataError| BackendError::Invalid(x.to_string());
        let storage = match view.dtype {
            DType::F32 => {
                let mut v = vec![0f32; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::F32(v)
            }
            DType::BF16 => {
                let mut v = vec![half::bf16::ZERO; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::BF16(v)
            }
            DType::F16 => {
                let mut v = vec![half::f16::ZERO; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::F16(v)
            }
            DType::I32 => {
                let mut v = vec![0i32; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::I32(v)
            }
            DType::I64 => {
                let mut v = vec![0i64; n];
                buf.download(&s, &mut v).map_err(e)?;
                Storage::I64(v)
            }
        };
        TensorData::new(shape, storage).map_err(bad)
    }
}
