//! The DLPack ABI (legacy, unversioned: `DLManagedTensor`), as the exchange of device tensors
//! with Python producers and consumers reads and writes it (the `python` module, feature
//! `python`), and the element types and layouts it describes. No Python and no CUDA here.

#![cfg_attr(not(feature = "python"), allow(dead_code))]

use std::ffi::c_void;

use crate::dtype::DType;

/// `kDLCUDA`: memory of a CUDA device.
pub(crate) const KDL_CUDA: i32 = 2;

/// `DLDevice`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct DlDevice {
    pub device_type: i32,
    pub device_id: i32,
}

/// A DLPack element type (`DLDataType`): type code, bits per lane and lanes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DlDtype {
    /// `kDLInt` 0, `kDLUInt` 1, `kDLFloat` 2, `kDLBfloat` 4, `kDLBool` 6, the float8 codes
    /// 7..=14 of DLPack 1.1 (`kDLFloat8_e4m3fn` is 10, `kDLFloat8_e5m2` 12).
    pub code: u8,
    /// Bits of one lane.
    pub bits: u8,
    /// Lanes (1 for every scalar type).
    pub lanes: u16,
}

impl DlDtype {
    /// 32-bit float.
    pub const F32: DlDtype = DlDtype::scalar(2, 32);
    /// bfloat16.
    pub const BF16: DlDtype = DlDtype::scalar(4, 16);
    /// IEEE half.
    pub const F16: DlDtype = DlDtype::scalar(2, 16);
    /// 32-bit signed integer.
    pub const I32: DlDtype = DlDtype::scalar(0, 32);
    /// 64-bit signed integer.
    pub const I64: DlDtype = DlDtype::scalar(0, 64);
    /// Unsigned byte.
    pub const U8: DlDtype = DlDtype::scalar(1, 8);

    /// A one-lane type.
    pub const fn scalar(code: u8, bits: u8) -> DlDtype {
        DlDtype {
            code,
            bits,
            lanes: 1,
        }
    }

    /// The DLPack type of a kernels-crate element type.
    pub fn of(dtype: DType) -> DlDtype {
        match dtype {
            DType::F32 => DlDtype::F32,
            DType::BF16 => DlDtype::BF16,
            DType::F16 => DlDtype::F16,
            DType::I32 => DlDtype::I32,
            DType::I64 => DlDtype::I64,
            DType::U8 => DlDtype::U8,
        }
    }

    /// The kernels-crate element type, when there is one.
    pub fn dtype(self) -> Option<DType> {
        DType::ALL.into_iter().find(|&d| DlDtype::of(d) == self)
    }

    /// Bytes of one element (`bits * lanes / 8`), `None` for sub-byte types.
    pub fn size_bytes(self) -> Option<usize> {
        let bits = usize::from(self.bits) * usize::from(self.lanes);
        bits.is_multiple_of(8).then_some(bits / 8)
    }
}

/// `DLTensor`.
#[repr(C)]
pub(crate) struct DlTensor {
    pub data: *mut c_void,
    pub device: DlDevice,
    pub ndim: i32,
    pub dtype: DlDtype,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

/// `DLManagedTensor`.
#[repr(C)]
pub(crate) struct DlManagedTensor {
    pub dl_tensor: DlTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// Whether `strides` (in elements) describe the row-major layout of `shape` (extents of 1 may
/// have any stride).
pub(crate) fn is_row_major(shape: &[u64], strides: &[i64]) -> bool {
    let mut expected: i64 = 1;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != expected {
            return shape.contains(&0);
        }
        expected = expected.saturating_mul(i64::try_from(d).unwrap_or(i64::MAX));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_round_trip() {
        for d in DType::ALL {
            assert_eq!(DlDtype::of(d).dtype(), Some(d));
            assert_eq!(DlDtype::of(d).size_bytes(), Some(d.size_bytes()));
        }
        assert_eq!(DlDtype::scalar(10, 8).dtype(), None);
        assert_eq!(DlDtype::scalar(6, 1).size_bytes(), None);
    }

    #[test]
    fn row_major_strides() {
        assert!(is_row_major(&[2, 3], &[3, 1]));
        assert!(is_row_major(&[1, 3], &[7, 1]));
        assert!(is_row_major(&[0, 3], &[1, 1]));
        assert!(!is_row_major(&[2, 3], &[1, 2]));
        assert!(!is_row_major(&[2, 3], &[6, 2]));
    }
}
