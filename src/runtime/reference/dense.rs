//! The reference's own tensors: dense, row-major, floats held as `f64` (rounded to their
//! element type after every op, so a `bf16` tensor holds `bf16` values) and integers as `i64`.

use meshflow_ir::DType;

use crate::runtime::data::TensorData;

/// The elements of a [`Dense`] tensor.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Values {
    /// Floating-point elements (any float dtype).
    Float(Vec<f64>),
    /// Integer elements (any integer dtype).
    Int(Vec<i64>),
}

/// A dense tensor of the reference.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Dense {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub values: Values,
}

/// `v` rounded to the nearest value of `dtype` (integers: truncated toward zero, saturated
/// for `i32`, as a cast does).
pub(crate) fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::I32 => v as i32 as f64,
        DType::I64 => v as i64 as f64,
    }
}

/// `v` wrapped to the range of `dtype` (an `i32` keeps its low 32 bits).
pub(crate) fn wrap_to(dtype: DType, v: i64) -> i64 {
    match dtype {
        DType::I32 => v as i32 as i64,
        _ => v,
    }
}

/// The number of elements of `shape`, when it fits in memory's index range.
pub(crate) fn numel(shape: &[u64]) -> Result<usize, String> {
    shape
        .iter()
        .try_fold(1u64, |n, &e| n.checked_mul(e))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| format!("shape {shape:?} has too many elements"))
}

impl Dense {
    /// The reference's copy of `data`.
    pub fn from_data(data: &TensorData) -> Dense {
        let dtype = data.dtype();
        let values = if dtype.is_float() {
            Values::Float(
                data.storage()
                    .to_f32_vec()
                    .into_iter()
                    .map(f64::from)
                    .collect(),
            )
        } else {
            Values::Int(data.storage().to_i64_vec())
        };
        Dense {
            dtype,
            shape: data.shape().to_vec(),
            values,
        }
    }

    /// Back to a [`TensorData`] of the tensor's dtype.
    pub fn to_data(&self) -> Result<TensorData, String> {
        let r = match &self.values {
            Values::Float(v) => {
                let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
                TensorData::from_f32(self.dtype, &self.shape, &v)
            }
            Values::Int(v) => TensorData::from_i64(self.dtype, &self.shape, v),
        };
        r.map_err(|e| e.to_string())
    }

    /// The elements as floats (integers converted).
    pub fn floats(&self) -> Vec<f64> {
        match &self.values {
            Values::Float(v) => v.clone(),
            Values::Int(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// The elements as integers (floats truncated toward zero).
    pub fn ints(&self) -> Vec<i64> {
        match &self.values {
            Values::Int(v) => v.clone(),
            Values::Float(v) => v.iter().map(|&x| x as i64).collect(),
        }
    }

    /// A tensor of `dtype` and `shape` holding `values` computed in `f64`, each rounded to
    /// `dtype`.
    pub fn from_f64(dtype: DType, shape: &[u64], values: Vec<f64>) -> Dense {
        let values = if dtype.is_float() {
            Values::Float(values.into_iter().map(|v| round_to(dtype, v)).collect())
        } else {
            Values::Int(
                values
                    .into_iter()
                    .map(|v| round_to(dtype, v) as i64)
                    .collect(),
            )
        };
        Dense {
            dtype,
            shape: shape.to_vec(),
            values,
        }
    }

    /// A tensor of integer `dtype` holding `values` (wrapped to `dtype`).
    pub fn from_i64(dtype: DType, shape: &[u64], values: Vec<i64>) -> Dense {
        if dtype.is_float() {
            return Dense::from_f64(dtype, shape, values.into_iter().map(|v| v as f64).collect());
        }
        Dense {
            dtype,
            shape: shape.to_vec(),
            values: Values::Int(values.into_iter().map(|v| wrap_to(dtype, v)).collect()),
        }
    }
}
