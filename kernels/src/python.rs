//! Python objects that carry raw CUDA handles (feature `python`): DLPack capsules of device
//! tensors, in both directions, and torch streams. The repository's Python package (`python/`)
//! binds torch tensors through these constructors, so no raw pointer leaves this crate.
//!
//! - [`DlpackTensor::from_capsule`] borrows the memory of a `dltensor` capsule (what
//!   `tensor.__dlpack__()` returns) as a [`DeviceBuffer`], without a copy. The capsule is not
//!   consumed: the producer keeps owning the memory, and the buffer holds a reference to the
//!   capsule (and so to the producer's tensor) until its last view is dropped.
//! - [`export`] hands a [`DeviceBuffer`] to a consumer (`torch.from_dlpack`) as a `dltensor`
//!   capsule; the consumer's tensor keeps the buffer's allocation alive until it is freed.
//! - [`torch_stream`] wraps a `torch.cuda.Stream` as a borrowed [`Stream`].
//!
//! Only the legacy (unversioned) DLPack ABI ([`crate::dlpack`]) is read and written:
//! `DLManagedTensor` in a capsule named `dltensor`, renamed `used_dltensor` by the consumer that
//! takes it over.

use std::ffi::{c_void, CStr};
use std::ptr::NonNull;

use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::buffer::DeviceBuffer;
use crate::device::Device;
pub use crate::dlpack::DlDtype;
use crate::dlpack::{is_row_major, DlDevice, DlManagedTensor, DlTensor, KDL_CUDA};
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// The capsule name of an unconsumed legacy DLPack tensor.
const DLTENSOR: &CStr = c"dltensor";

/// A device tensor lent through DLPack: its memory (borrowed, used in place), element type and
/// shape (row-major, contiguous).
#[derive(Debug, Clone)]
pub struct DlpackTensor {
    /// The memory; it holds a reference to the capsule, which keeps the producer's tensor alive.
    pub buffer: DeviceBuffer,
    /// The element type.
    pub dtype: DlDtype,
    /// The shape.
    pub shape: Vec<u64>,
}

fn invalid(message: impl Into<String>) -> KernelError {
    KernelError::InvalidArgument(message.into())
}

impl DlpackTensor {
    /// Borrows the tensor of a `dltensor` capsule (from `tensor.__dlpack__()`), which must be a
    /// row-major contiguous tensor in the memory of `device`. The range is checked against the
    /// device allocation that holds it. The producer must not free or reuse the memory while it
    /// is in use here: the buffer keeps the capsule, and so the producer's tensor, alive, and
    /// the caller orders device work on it (the stream passed to `__dlpack__`).
    pub fn from_capsule(capsule: &Bound<'_, PyAny>, device: &Device) -> Result<DlpackTensor> {
        let capsule = capsule.cast::<PyCapsule>().map_err(|_| {
            invalid(format!(
                "expected a DLPack capsule (from `__dlpack__()`), got a {}",
                type_name(capsule)
            ))
        })?;
        let ptr: NonNull<c_void> = capsule.pointer_checked(Some(DLTENSOR)).map_err(|_| {
            invalid("the DLPack capsule is not an unconsumed `dltensor` (already used?)")
        })?;
        // SAFETY: by the DLPack protocol a live capsule named `dltensor` points to a valid
        // `DLManagedTensor` that its producer keeps valid until the capsule is consumed (renamed)
        // or freed; `capsule` is borrowed for this whole read, and nothing here consumes it.
        let managed = unsafe { ptr.cast::<DlManagedTensor>().as_ref() };
        let t = &managed.dl_tensor;
        let ndim = usize::try_from(t.ndim)
            .map_err(|_| invalid(format!("the DLPack tensor has {} dimensions", t.ndim)))?;
        let read = |p: *mut i64| -> Vec<i64> {
            if ndim == 0 || p.is_null() {
                return Vec::new();
            }
            // SAFETY: a non-null `shape` / `strides` of a valid DLTensor points to `ndim` values.
            unsafe { std::slice::from_raw_parts(p, ndim) }.to_vec()
        };
        let shape = read(t.shape);
        if shape.len() != ndim {
            return Err(invalid("the DLPack tensor has no shape"));
        }
        let strides = read(t.strides);
        let (device_type, device_id, dtype, data, byte_offset) = (
            t.device.device_type,
            t.device.device_id,
            t.dtype,
            t.data,
            t.byte_offset,
        );
        if device_type != KDL_CUDA || usize::try_from(device_id).ok() != Some(device.ordinal()) {
            return Err(invalid(format!(
                "the tensor is on DLPack device ({device_type}, {device_id}), not CUDA device {}",
                device.ordinal()
            )));
        }
        let shape: Vec<u64> = shape
            .iter()
            .map(|&d| u64::try_from(d))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| invalid(format!("the DLPack tensor has shape {shape:?}")))?;
        if !strides.is_empty() && !is_row_major(&shape, &strides) {
            return Err(invalid(format!(
                "the tensor of shape {shape:?} has strides {strides:?}: it must be contiguous \
                 (call `.contiguous()` first)"
            )));
        }
        let elem = dtype
            .size_bytes()
            .filter(|_| dtype.lanes == 1)
            .ok_or_else(|| invalid(format!("unsupported DLPack element type {dtype:?}")))?;
        let bytes = shape
            .iter()
            .try_fold(elem as u64, |n, &d| n.checked_mul(d))
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| invalid(format!("a tensor of shape {shape:?} is too large")))?;
        let addr = (data as u64)
            .checked_add(byte_offset)
            .ok_or_else(|| invalid("the DLPack tensor's address overflows"))?;
        let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(capsule.clone().unbind());
        // SAFETY: `addr .. addr + bytes` is the producer's tensor (checked to lie inside one
        // allocation of `device`), which stays allocated while the capsule lives; the buffer
        // holds the capsule until its last view is dropped.
        let buffer = unsafe { DeviceBuffer::from_raw_owned_by(device, addr, bytes, Some(owner)) }?;
        Ok(DlpackTensor {
            buffer,
            dtype,
            shape,
        })
    }
}

/// What an exported capsule owns: the managed tensor handed to the consumer, the shape it
/// points to, and a view of the memory that keeps the allocation alive.
#[repr(C)]
struct Exported {
    managed: DlManagedTensor,
    shape: Vec<i64>,
    _buffer: DeviceBuffer,
}

/// The `deleter` of an exported tensor: frees what [`export`] allocated.
unsafe extern "C" fn delete_exported(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the `DlManagedTensor` of an `Exported` created by `export`, whose
    // `manager_ctx` is that `Exported`'s box; the DLPack protocol calls the deleter once.
    unsafe {
        let ctx = (*managed).manager_ctx.cast::<Exported>();
        if !ctx.is_null() {
            drop(Box::from_raw(ctx));
        }
    }
}

/// The capsule destructor: deletes the tensor unless a consumer took it over (renamed the
/// capsule), in which case the consumer calls the deleter when it is done.
unsafe extern "C" fn drop_capsule(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule being freed, the GIL held.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let managed = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr())
                .cast::<DlManagedTensor>();
            if !managed.is_null() {
                delete_exported(managed);
            }
        }
    }
}

/// Exports `buffer` (elements of `dtype`, row-major `shape`, exactly its length) as a
/// `dltensor` capsule for `torch.from_dlpack`: the consumer's tensor aliases the memory, with
/// no copy, and keeps the allocation alive until it is freed.
pub fn export<'py>(
    py: Python<'py>,
    buffer: &DeviceBuffer,
    dtype: DlDtype,
    shape: &[u64],
) -> Result<Bound<'py, PyCapsule>> {
    let elem = dtype
        .size_bytes()
        .ok_or_else(|| invalid(format!("cannot export element type {dtype:?}")))?;
    let bytes = shape.iter().try_fold(elem as u64, |n, &d| n.checked_mul(d));
    if bytes != Some(buffer.len() as u64) {
        return Err(invalid(format!(
            "cannot export {} bytes as a tensor of shape {shape:?} and {elem}-byte elements",
            buffer.len()
        )));
    }
    let shape: Vec<i64> = shape
        .iter()
        .map(|&d| i64::try_from(d))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| invalid(format!("cannot export shape {shape:?}")))?;
    let ordinal = i32::try_from(buffer.device().ordinal())
        .map_err(|_| invalid("device ordinal out of range"))?;
    let ndim = i32::try_from(shape.len()).map_err(|_| invalid("too many dimensions"))?;
    let mut exported = Box::new(Exported {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data: buffer.addr() as *mut c_void,
                device: DlDevice {
                    device_type: KDL_CUDA,
                    device_id: ordinal,
                },
                ndim,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_exported),
        },
        shape,
        _buffer: buffer.clone(),
    });
    // The shape vector's heap storage does not move with the box.
    exported.managed.dl_tensor.shape = exported.shape.as_mut_ptr();
    let raw = Box::into_raw(exported);
    // SAFETY: `raw` is the box just leaked; `managed` is its first field (repr(C)).
    unsafe { (*raw).managed.manager_ctx = raw.cast::<c_void>() };
    let pointer = NonNull::new(raw.cast::<c_void>()).ok_or_else(|| invalid("null box"))?;
    // SAFETY: `pointer` is a valid `DlManagedTensor` (the first field of `Exported`) owned by the
    // capsule until a consumer takes it over; `drop_capsule` frees it otherwise, from any thread
    // that holds the GIL.
    let capsule = unsafe {
        PyCapsule::new_with_pointer_and_destructor(py, pointer, DLTENSOR, Some(drop_capsule))
    };
    capsule.map_err(|e| {
        // SAFETY: the capsule was not created, so nothing else owns the box.
        unsafe { delete_exported(raw.cast::<DlManagedTensor>()) };
        invalid(format!("creating the DLPack capsule: {e}"))
    })
}

/// Wraps a `torch.cuda.Stream` of `device` (e.g. `torch.cuda.current_stream()`) as a borrowed
/// [`Stream`]: work enqueued on it runs in order with torch's. Checks that the stream belongs to
/// the device's primary context.
pub fn torch_stream(stream: &Bound<'_, PyAny>, device: &Device) -> Result<Stream> {
    let py = stream.py();
    let py_err = |e: PyErr| invalid(format!("reading the torch stream: {e}"));
    let class = py
        .import("torch.cuda")
        .and_then(|m| m.getattr("Stream"))
        .map_err(py_err)?;
    if !stream.is_instance(&class).map_err(py_err)? {
        return Err(invalid(format!(
            "expected a torch.cuda.Stream, got a {}",
            type_name(stream)
        )));
    }
    let handle: u64 = stream
        .getattr("cuda_stream")
        .and_then(|h| h.extract())
        .map_err(py_err)?;
    // SAFETY: the handle of a torch.cuda.Stream is the default stream or a stream of torch's
    // per-device pools, which torch never destroys; an `ExternalStream` carries a handle its
    // creator vouched for to torch. `from_raw_borrowed` checks it belongs to `device`.
    unsafe { Stream::from_raw_borrowed(device, handle as *mut c_void) }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}
