//! Operands of device ops: byte ranges of views, packed copies of strided views, and outputs
//! written through a packed temporary.

use meshflow_kernels::DeviceBuffer;

use super::backend::{CudaBackend, Unstage};
use super::layout::{elem_bytes, fold, kdtype, packed, view_is_contiguous};
use super::memory::CudaBuffer;
use crate::runtime::backend::{BackendError, TensorView};

/// Where an op writes an output: the view's own bytes, or a temporary copied into the view
/// afterwards ([`CudaBackend::finish_output`]).
#[derive(Debug)]
pub(super) struct OutSlot {
    pub buf: DeviceBuffer,
    unstage: Option<(DeviceBuffer, TensorView<CudaBuffer>)>,
}

impl CudaBackend {
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
