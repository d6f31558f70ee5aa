//! Host tensor data: typed storage, conversions, seeded random generation and comparison.
//!
//! [`Storage`] is a typed, flat element vector (bf16/f16 through the `half` crate);
//! [`TensorData`] adds a row-major shape. Floating-point arithmetic in the CPU kernels reads
//! elements as `f32` and rounds once when writing; integer arithmetic uses `i64`.

use half::{bf16, f16};
use meshflow_ir::DType;

/// Why tensor data could not be built or compared.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    /// The number of elements does not match the shape.
    #[error("shape {shape:?} needs {expected} elements, got {actual}")]
    LengthMismatch {
        /// The shape.
        shape: Vec<u64>,
        /// Elements the shape needs.
        expected: u64,
        /// Elements supplied.
        actual: u64,
    },
    /// Two tensors that must agree do not.
    #[error("cannot compare {a} with {b}")]
    Incomparable {
        /// The first tensor's type, printed.
        a: String,
        /// The second tensor's type, printed.
        b: String,
    },
    /// The shape's element count overflows.
    #[error("shape {0:?} has too many elements")]
    TooLarge(Vec<u64>),
    /// The host could not allocate the elements.
    #[error("cannot allocate {bytes} bytes of host memory")]
    OutOfMemory {
        /// Bytes requested.
        bytes: u64,
    },
}

/// `n` copies of `value`, or [`DataError::OutOfMemory`] when the allocation fails (an absurd
/// extent must be an error, not an abort).
pub fn try_filled<T: Clone>(value: T, n: usize) -> Result<Vec<T>, DataError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| DataError::OutOfMemory {
        bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
    })?;
    v.resize(n, value);
    Ok(v)
}

/// Collects `n` values of `f` into a vector allocated fallibly (see [`try_filled`]).
pub fn try_collect<T>(n: usize, f: impl FnMut(usize) -> T) -> Result<Vec<T>, DataError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| DataError::OutOfMemory {
        bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
    })?;
    v.extend((0..n).map(f));
    Ok(v)
}

/// A flat, typed element vector.
#[derive(Clone, Debug, PartialEq)]
pub enum Storage {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// bfloat16.
    BF16(Vec<bf16>),
    /// IEEE half.
    F16(Vec<f16>),
    /// 32-bit integers.
    I32(Vec<i32>),
    /// 64-bit integers.
    I64(Vec<i64>),
}

/// Applies `$body` to the inner vector of a [`Storage`] whatever its element type.
#[macro_export]
#[doc(hidden)]
macro_rules! with_storage {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            $crate::runtime::data::Storage::F32($v) => $body,
            $crate::runtime::data::Storage::BF16($v) => $body,
            $crate::runtime::data::Storage::F16($v) => $body,
            $crate::runtime::data::Storage::I32($v) => $body,
            $crate::runtime::data::Storage::I64($v) => $body,
        }
    };
}

/// Applies `$body` to the inner vector of a [`Storage`] and wraps its result (a vector of the
/// same element type) in the same variant.
macro_rules! map_storage {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            Storage::F32($v) => Storage::F32($body),
            Storage::BF16($v) => Storage::BF16($body),
            Storage::F16($v) => Storage::F16($body),
            Storage::I32($v) => Storage::I32($body),
            Storage::I64($v) => Storage::I64($body),
        }
    };
}

/// Applies `$body` to the inner vectors of two [`Storage`]s of the same element type; `false`
/// when their element types differ.
macro_rules! with_storage_pair {
    (($a:expr, $b:expr), ($x:ident, $y:ident) => $body:expr) => {
        match ($a, $b) {
            (Storage::F32($x), Storage::F32($y)) => $body,
            (Storage::BF16($x), Storage::BF16($y)) => $body,
            (Storage::F16($x), Storage::F16($y)) => $body,
            (Storage::I32($x), Storage::I32($y)) => $body,
            (Storage::I64($x), Storage::I64($y)) => $body,
            _ => false,
        }
    };
}

/// The value written into fresh buffers by the CPU backend so that reading uninitialized
/// memory shows up: NaN for floats, this value for integers.
pub const INT_POISON: i64 = -0x5A5A_5A5A;

impl Storage {
    /// `n` zeros of `dtype`.
    pub fn zeros(dtype: DType, n: usize) -> Storage {
        match dtype {
            DType::F32 => Storage::F32(vec![0.0; n]),
            DType::BF16 => Storage::BF16(vec![bf16::ZERO; n]),
            DType::F16 => Storage::F16(vec![f16::ZERO; n]),
            DType::I32 => Storage::I32(vec![0; n]),
            DType::I64 => Storage::I64(vec![0; n]),
        }
    }

    /// `n` poison values of `dtype` (NaN for floats, [`INT_POISON`] for integers).
    pub fn poison(dtype: DType, n: usize) -> Storage {
        match dtype {
            DType::F32 => Storage::F32(vec![f32::NAN; n]),
            DType::BF16 => Storage::BF16(vec![bf16::NAN; n]),
            DType::F16 => Storage::F16(vec![f16::NAN; n]),
            DType::I32 => Storage::I32(vec![INT_POISON as i32; n]),
            DType::I64 => Storage::I64(vec![INT_POISON; n]),
        }
    }

    /// [`Storage::zeros`], or [`DataError::OutOfMemory`] when the host cannot allocate it.
    pub fn try_zeros(dtype: DType, n: usize) -> Result<Storage, DataError> {
        Ok(match dtype {
            DType::F32 => Storage::F32(try_filled(0.0, n)?),
            DType::BF16 => Storage::BF16(try_filled(bf16::ZERO, n)?),
            DType::F16 => Storage::F16(try_filled(f16::ZERO, n)?),
            DType::I32 => Storage::I32(try_filled(0, n)?),
            DType::I64 => Storage::I64(try_filled(0, n)?),
        })
    }

    /// [`Storage::poison`], or [`DataError::OutOfMemory`] when the host cannot allocate it.
    pub fn try_poison(dtype: DType, n: usize) -> Result<Storage, DataError> {
        Ok(match dtype {
            DType::F32 => Storage::F32(try_filled(f32::NAN, n)?),
            DType::BF16 => Storage::BF16(try_filled(bf16::NAN, n)?),
            DType::F16 => Storage::F16(try_filled(f16::NAN, n)?),
            DType::I32 => Storage::I32(try_filled(INT_POISON as i32, n)?),
            DType::I64 => Storage::I64(try_filled(INT_POISON, n)?),
        })
    }

    /// Elements of `dtype` converted from `f32` (rounded to nearest; integers truncated).
    pub fn from_f32(dtype: DType, values: &[f32]) -> Storage {
        match dtype {
            DType::F32 => Storage::F32(values.to_vec()),
            DType::BF16 => Storage::BF16(values.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => Storage::F16(values.iter().map(|&v| f16::from_f32(v)).collect()),
            DType::I32 => Storage::I32(values.iter().map(|&v| v as i32).collect()),
            DType::I64 => Storage::I64(values.iter().map(|&v| v as i64).collect()),
        }
    }

    /// Elements of `dtype` converted from `i64` (floats rounded to nearest; i32 wraps).
    pub fn from_i64(dtype: DType, values: &[i64]) -> Storage {
        match dtype {
            DType::F32 => Storage::F32(values.iter().map(|&v| v as f32).collect()),
            DType::BF16 => {
                Storage::BF16(values.iter().map(|&v| bf16::from_f32(v as f32)).collect())
            }
            DType::F16 => Storage::F16(values.iter().map(|&v| f16::from_f32(v as f32)).collect()),
            DType::I32 => Storage::I32(values.iter().map(|&v| v as i32).collect()),
            DType::I64 => Storage::I64(values.to_vec()),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::BF16(_) => DType::BF16,
            Storage::F16(_) => DType::F16,
            Storage::I32(_) => DType::I32,
            Storage::I64(_) => DType::I64,
        }
    }

    /// Bytes the elements occupy.
    pub fn size_bytes(&self) -> u64 {
        (self.len() as u64).saturating_mul(self.dtype().size_bytes() as u64)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        with_storage!(self, v => v.len())
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as `f32` (integers converted), or `None` past the end.
    pub fn get_f32(&self, i: usize) -> Option<f32> {
        Some(match self {
            Storage::F32(v) => *v.get(i)?,
            Storage::BF16(v) => v.get(i)?.to_f32(),
            Storage::F16(v) => v.get(i)?.to_f32(),
            Storage::I32(v) => *v.get(i)? as f32,
            Storage::I64(v) => *v.get(i)? as f32,
        })
    }

    /// Element `i` as `i64` (floats truncated), or `None` past the end.
    pub fn get_i64(&self, i: usize) -> Option<i64> {
        Some(match self {
            Storage::F32(v) => *v.get(i)? as i64,
            Storage::BF16(v) => v.get(i)?.to_f32() as i64,
            Storage::F16(v) => v.get(i)?.to_f32() as i64,
            Storage::I32(v) => i64::from(*v.get(i)?),
            Storage::I64(v) => *v.get(i)?,
        })
    }

    /// The bit pattern of element `i` (for bit-exact comparison), or `None` past the end.
    pub fn bits(&self, i: usize) -> Option<u64> {
        Some(match self {
            Storage::F32(v) => u64::from(v.get(i)?.to_bits()),
            Storage::BF16(v) => u64::from(v.get(i)?.to_bits()),
            Storage::F16(v) => u64::from(v.get(i)?.to_bits()),
            Storage::I32(v) => u64::from(*v.get(i)? as u32),
            Storage::I64(v) => *v.get(i)? as u64,
        })
    }

    /// All elements as `f32`.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            Storage::F32(v) => v.clone(),
            Storage::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Storage::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Storage::I32(v) => v.iter().map(|&x| x as f32).collect(),
            Storage::I64(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }

    /// A copy of elements `range` (empty when out of range).
    pub fn slice(&self, range: std::ops::Range<usize>) -> Storage {
        map_storage!(self, v => v.get(range).unwrap_or(&[]).to_vec())
    }

    /// Appends elements `range` of `src`; false (nothing appended) when the element types
    /// differ or the range is out of bounds.
    pub fn extend_from(&mut self, src: &Storage, range: std::ops::Range<usize>) -> bool {
        with_storage_pair!((self, src), (d, s) => match s.get(range) {
            Some(part) => {
                d.extend_from_slice(part);
                true
            }
            None => false,
        })
    }

    /// Overwrites elements from `at` with elements `range` of `src`; false (nothing written)
    /// when the element types differ or a range is out of bounds.
    pub fn write_at(&mut self, at: usize, src: &Storage, range: std::ops::Range<usize>) -> bool {
        let n = range.len();
        with_storage_pair!((self, src), (d, s) => match (d.get_mut(at..at + n), s.get(range)) {
            (Some(d), Some(s)) => {
                d.copy_from_slice(s);
                true
            }
            _ => false,
        })
    }

    /// The elements at `indices`, in that order (`None` when an index is out of range).
    pub fn pick(&self, indices: &[usize]) -> Option<Storage> {
        Some(map_storage!(self, v => {
            indices.iter().map(|&i| v.get(i).copied()).collect::<Option<_>>()?
        }))
    }

    /// Writes element `j` of `src` to index `indices[j]`; false (possibly partly written) when
    /// the types differ or an index is out of range.
    pub fn put(&mut self, indices: &[usize], src: &Storage) -> bool {
        indices.len() == src.len()
            && with_storage_pair!((self, src), (d, s) => {
                indices.iter().zip(s.iter()).all(|(&i, &x)| match d.get_mut(i) {
                    Some(slot) => {
                        *slot = x;
                        true
                    }
                    None => false,
                })
            })
    }

    /// All elements as `i64`.
    pub fn to_i64_vec(&self) -> Vec<i64> {
        (0..self.len()).filter_map(|i| self.get_i64(i)).collect()
    }
}

/// A host tensor: a row-major shape and typed elements.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    shape: Vec<u64>,
    storage: Storage,
}

/// The number of elements of `shape`, or an error on overflow.
pub fn numel_of(shape: &[u64]) -> Result<u64, DataError> {
    shape
        .iter()
        .try_fold(1u64, |acc, &e| acc.checked_mul(e))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| DataError::TooLarge(shape.to_vec()))
}

impl TensorData {
    /// A tensor of `shape` holding `storage` (row-major).
    pub fn new(shape: Vec<u64>, storage: Storage) -> Result<TensorData, DataError> {
        let expected = numel_of(&shape)?;
        let actual = storage.len() as u64;
        if expected != actual {
            return Err(DataError::LengthMismatch {
                shape,
                expected,
                actual,
            });
        }
        Ok(TensorData { shape, storage })
    }

    /// Zeros.
    pub fn zeros(dtype: DType, shape: &[u64]) -> Result<TensorData, DataError> {
        let n = numel_of(shape)? as usize;
        TensorData::new(shape.to_vec(), Storage::try_zeros(dtype, n)?)
    }

    /// Poison values (see [`Storage::poison`]).
    pub fn poison(dtype: DType, shape: &[u64]) -> Result<TensorData, DataError> {
        let n = numel_of(shape)? as usize;
        TensorData::new(shape.to_vec(), Storage::try_poison(dtype, n)?)
    }

    /// A tensor of `dtype` from `f32` values.
    pub fn from_f32(dtype: DType, shape: &[u64], values: &[f32]) -> Result<TensorData, DataError> {
        TensorData::new(shape.to_vec(), Storage::from_f32(dtype, values))
    }

    /// A tensor of `dtype` from `i64` values.
    pub fn from_i64(dtype: DType, shape: &[u64], values: &[i64]) -> Result<TensorData, DataError> {
        TensorData::new(shape.to_vec(), Storage::from_i64(dtype, values))
    }

    /// Uniform random values from a seeded generator: floats in `[-1, 1)`, integers in
    /// `[0, 16)`.
    pub fn random(dtype: DType, shape: &[u64], seed: u64) -> Result<TensorData, DataError> {
        let n = numel_of(shape)? as usize;
        let mut rng = SplitMix64::new(seed);
        if dtype.is_float() {
            let v = try_collect(n, |_| rng.next_f32() * 2.0 - 1.0)?;
            TensorData::from_f32(dtype, shape, &v)
        } else {
            let v = try_collect(n, |_| rng.below(16) as i64)?;
            TensorData::from_i64(dtype, shape, &v)
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.storage.len() as u64
    }

    /// The elements.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The elements, mutably.
    pub fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }

    /// Splits into shape and elements.
    pub fn into_parts(self) -> (Vec<u64>, Storage) {
        (self.shape, self.storage)
    }

    /// The type as text, e.g. `bf16[4, 8]`.
    pub fn type_string(&self) -> String {
        let dims: Vec<String> = self.shape.iter().map(u64::to_string).collect();
        format!("{}[{}]", self.dtype(), dims.join(", "))
    }

    /// True when both tensors have the same type and the same bits.
    pub fn bit_eq(&self, other: &TensorData) -> bool {
        self.shape == other.shape
            && self.dtype() == other.dtype()
            && (0..self.storage.len()).all(|i| self.storage.bits(i) == other.storage.bits(i))
    }

    /// Relative error `||self - reference|| / ||reference||` (2-norm, in f64). NaN or
    /// infinity anywhere gives NaN (which never passes a tolerance check); a zero reference
    /// gives the absolute error.
    pub fn rel_error(&self, reference: &TensorData) -> Result<f64, DataError> {
        if self.shape != reference.shape || self.dtype() != reference.dtype() {
            return Err(DataError::Incomparable {
                a: self.type_string(),
                b: reference.type_string(),
            });
        }
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for i in 0..self.storage.len() {
            let (a, b) = match (&self.storage, &reference.storage) {
                (Storage::I32(_) | Storage::I64(_), _) => (
                    self.storage.get_i64(i).unwrap_or(0) as f64,
                    reference.storage.get_i64(i).unwrap_or(0) as f64,
                ),
                _ => (
                    f64::from(self.storage.get_f32(i).unwrap_or(f32::NAN)),
                    f64::from(reference.storage.get_f32(i).unwrap_or(f32::NAN)),
                ),
            };
            if !a.is_finite() || !b.is_finite() {
                return Ok(f64::NAN);
            }
            diff += (a - b) * (a - b);
            norm += b * b;
        }
        Ok(if norm == 0.0 {
            diff.sqrt()
        } else {
            (diff / norm).sqrt()
        })
    }
}

/// A small, fast, seeded generator (SplitMix64); deterministic across platforms.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `0..n` (`0` when `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (fuzzing): absurd shapes aborted the process; they are errors now.
    #[test]
    fn absurd_shapes_are_errors_not_aborts() {
        let shape = [999_999_999_999, 9];
        let oom = |r: Result<TensorData, DataError>| {
            assert!(
                matches!(r, Err(DataError::OutOfMemory { bytes }) if bytes >= 9 * 999_999_999_999),
                "{r:?}"
            );
        };
        oom(TensorData::zeros(DType::F32, &shape));
        oom(TensorData::poison(DType::BF16, &shape));
        oom(TensorData::random(DType::F32, &shape, 1));
        oom(TensorData::random(DType::I32, &shape, 1));
        assert!(matches!(
            TensorData::zeros(DType::F32, &[u64::MAX, 2]),
            Err(DataError::TooLarge(_))
        ));
    }

    #[test]
    fn rel_error_basics() {
        let a = TensorData::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap();
        let b = TensorData::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap();
        assert_eq!(a.rel_error(&b).unwrap(), 0.0);
        let c = TensorData::from_f32(DType::F32, &[2], &[1.0, f32::NAN]).unwrap();
        assert!(c.rel_error(&b).unwrap().is_nan());
        assert!(b.rel_error(&c).unwrap().is_nan());
        let d = TensorData::from_f32(DType::F32, &[2], &[0.0, 0.0]).unwrap();
        assert_eq!(d.rel_error(&d).unwrap(), 0.0);
        let bf = TensorData::from_f32(DType::BF16, &[2], &[1.0, 2.0]).unwrap();
        assert!(bf.rel_error(&b).is_err());
    }

    #[test]
    fn random_is_seeded() {
        let a = TensorData::random(DType::BF16, &[3, 5], 7).unwrap();
        let b = TensorData::random(DType::BF16, &[3, 5], 7).unwrap();
        let c = TensorData::random(DType::BF16, &[3, 5], 8).unwrap();
        assert!(a.bit_eq(&b));
        assert!(!a.bit_eq(&c));
        assert!(a
            .storage()
            .to_f32_vec()
            .iter()
            .all(|v| (-1.0..1.0).contains(v)));
    }

    #[test]
    fn conversions_round_trip() {
        let v = [1.5f32, -2.25, 3.0];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let t = TensorData::from_f32(dtype, &[3], &v).unwrap();
            assert_eq!(t.storage().to_f32_vec(), v);
        }
        let t = TensorData::from_i64(DType::I32, &[2], &[5, -7]).unwrap();
        assert_eq!(t.storage().to_i64_vec(), vec![5, -7]);
        assert!(TensorData::new(vec![2, 2], Storage::zeros(DType::F32, 3)).is_err());
    }
}
