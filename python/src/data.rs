//! numpy arrays to and from host tensors ([`TensorData`]), through bytes (no numpy C API, so the
//! module stays on the stable ABI). bf16 has no numpy type: bf16 tensors come out as float32
//! arrays (exact) and float arrays going in are rounded to bf16 (to nearest even).

use half::{bf16, f16};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use meshflow::ir::DType;
use meshflow::runtime::data::Storage;
use meshflow::TensorData;

use crate::errors::BindingError;

/// The numpy dtype that holds `dtype` (bf16 in float32).
pub fn numpy_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 | DType::BF16 => "float32",
        DType::F16 => "float16",
        DType::I32 => "int32",
        DType::I64 => "int64",
    }
}

/// A numpy array (writable, C-contiguous) holding a copy of `t`.
pub fn to_numpy<'py>(py: Python<'py>, t: &TensorData) -> PyResult<Bound<'py, PyAny>> {
    let bytes: Vec<u8> = match t.storage() {
        Storage::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Storage::BF16(v) => v.iter().flat_map(|x| x.to_f32().to_le_bytes()).collect(),
        Storage::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Storage::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Storage::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    };
    let np = py.import("numpy")?;
    let dtype = np
        .getattr("dtype")?
        .call1((numpy_dtype(t.dtype()),))?
        .call_method1("newbyteorder", ("<",))?;
    np.call_method1("frombuffer", (PyBytes::new(py, &bytes), dtype))?
        .call_method1("reshape", (t.shape().to_vec(),))?
        .call_method0("copy")
}

/// A host tensor of `dtype` from an array-like (a numpy array, a CPU torch tensor, nested
/// lists): converted with numpy's `same_kind` casting (so floats never become integers
/// silently). `name` is the binding's, for the error.
pub fn from_numpy(value: &Bound<'_, PyAny>, dtype: DType, name: &str) -> PyResult<TensorData> {
    let py = value.py();
    let np = py.import("numpy")?;
    let target = np
        .getattr("dtype")?
        .call1((numpy_dtype(dtype),))?
        .call_method1("newbyteorder", ("<",))?;
    let arr = np
        .call_method1("asarray", (value,))
        .and_then(|a| {
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("casting", "same_kind")?;
            a.call_method("astype", (target,), Some(&kwargs))
        })
        .and_then(|a| np.call_method1("ascontiguousarray", (a,)))
        .map_err(|e| BindingError::new_err(format!("`{name}` as {dtype}: {e}")))?;
    let shape: Vec<u64> = arr.getattr("shape")?.extract()?;
    let raw = arr.call_method0("tobytes")?;
    let bytes = raw.cast::<PyBytes>()?.as_bytes();
    let storage = match dtype {
        DType::F32 => Storage::F32(words(bytes, f32::from_le_bytes)),
        DType::BF16 => Storage::BF16(
            words(bytes, f32::from_le_bytes)
                .into_iter()
                .map(bf16::from_f32)
                .collect(),
        ),
        DType::F16 => Storage::F16(
            words(bytes, u16::from_le_bytes)
                .into_iter()
                .map(f16::from_bits)
                .collect(),
        ),
        DType::I32 => Storage::I32(words(bytes, i32::from_le_bytes)),
        DType::I64 => Storage::I64(words(bytes, i64::from_le_bytes)),
    };
    TensorData::new(shape, storage).map_err(|e| BindingError::new_err(format!("`{name}`: {e}")))
}

/// Little-endian words of `N` bytes.
fn words<const N: usize, T>(bytes: &[u8], from: fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| {
            let mut b = [0u8; N];
            b.copy_from_slice(c);
            from(b)
        })
        .collect()
}

/// Parses a dtype name (`f32`, `bf16`, `f16`, `i32`, `i64`, or numpy's `float32`, ...).
pub fn parse_dtype(name: &str) -> PyResult<DType> {
    let canonical = match name {
        "float32" => "f32",
        "bfloat16" => "bf16",
        "float16" => "f16",
        "int32" => "i32",
        "int64" => "i64",
        other => other,
    };
    canonical
        .parse()
        .map_err(|e: meshflow::ir::dtype::UnknownDType| {
            pyo3::exceptions::PyValueError::new_err(e.to_string())
        })
}
