//! Calls of the kernels for elementwise math, casts and fills (`elementwise.cu`, `cast.cu`, `fill.cu`).

use super::sources::{binary_name, cast_name, unary_name, Source, FLOATS};
use super::{Arg, Kernels, BLOCK};
use crate::buffer::DeviceBuffer;
use crate::dtype::{BinaryOp, DType, UnaryOp};
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// The bit pattern [`Kernels::poison`] writes: a quiet NaN with a recognizable payload for floats,
/// `0xDEAD...` for integers.
pub fn poison_bits(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 0x7FC0_DEAD,
        DType::BF16 => 0x7FDE,
        DType::F16 => 0x7EDE,
        DType::I32 => 0xDEAD_BEEF,
        DType::I64 => 0xDEAD_BEEF_DEAD_BEEF,
        DType::U8 => 0xDE,
    }
}

/// The raw bits of `value` as one `dtype` element (floats rounded to nearest even; integers must
/// be integral and in range).
pub fn fill_pattern(dtype: DType, value: f64) -> Result<u64> {
    // Integral and in [lo, hi_exclusive): exact bounds for every integer type (powers of two).
    let int = |lo: f64, hi_exclusive: f64| -> Result<i64> {
        if value.fract() == 0.0 && value >= lo && value < hi_exclusive {
            Ok(value as i64)
        } else {
            Err(KernelError::InvalidArgument(format!(
                "{value} is not a {dtype} value"
            )))
        }
    };
    let two_pow = |e: i32| 2f64.powi(e);
    Ok(match dtype {
        DType::F32 => u64::from((value as f32).to_bits()),
        DType::BF16 => u64::from(half::bf16::from_f64(value).to_bits()),
        DType::F16 => u64::from(half::f16::from_f64(value).to_bits()),
        DType::I32 => u64::from(int(-two_pow(31), two_pow(31))? as i32 as u32),
        DType::I64 => int(-two_pow(63), two_pow(63))? as u64,
        DType::U8 => int(0.0, 256.0)? as u64,
    })
}

fn require_float(dtype: DType, what: &str) -> Result<()> {
    if FLOATS.contains(&dtype) {
        Ok(())
    } else {
        Err(KernelError::Unsupported(format!(
            "{what} on {dtype} (f32, bf16 and f16 only)"
        )))
    }
}

/// Number of `dtype` elements shared by all `bufs` (which must have equal lengths).
fn same_elems(dtype: DType, what: &str, bufs: &[&DeviceBuffer]) -> Result<usize> {
    let n = bufs
        .first()
        .map(|b| b.elems(dtype))
        .transpose()?
        .unwrap_or(0);
    for b in bufs {
        if b.elems(dtype)? != n {
            return Err(KernelError::InvalidArgument(format!(
                "{what}: operands have different lengths ({} vs {} bytes)",
                bufs.first().map_or(0, |f| f.len()),
                b.len()
            )));
        }
    }
    Ok(n)
}

fn elems_i64(n: usize) -> Result<i64> {
    i64::try_from(n).map_err(|_| KernelError::InvalidArgument(format!("{n} elements")))
}

impl Kernels {
    /// `out = a op b` elementwise (all three the same length; `out` may alias `a` or `b`).
    pub fn binary(
        &self,
        stream: &Stream,
        op: BinaryOp,
        dtype: DType,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        out: &DeviceBuffer,
    ) -> Result<()> {
        require_float(dtype, op.name())?;
        let n = same_elems(dtype, op.name(), &[a, b, out])?;
        if n == 0 {
            return Ok(());
        }
        let grid = self.grid(n, 16 / dtype.size_bytes());
        let mut args = [
            Arg::Ptr(a.addr()),
            Arg::Ptr(b.addr()),
            Arg::Ptr(out.addr()),
            Arg::I64(elems_i64(n)?),
        ];
        self.check_devices(&[a, b, out])?;
        self.call(
            stream,
            Source::Elementwise,
            &binary_name(op, dtype),
            grid,
            BLOCK,
            &mut args,
        )
    }

    /// `out = f(x)` elementwise (same length; `out` may alias `x`).
    pub fn unary(
        &self,
        stream: &Stream,
        op: UnaryOp,
        dtype: DType,
        x: &DeviceBuffer,
        out: &DeviceBuffer,
    ) -> Result<()> {
        require_float(dtype, op.name())?;
        let n = same_elems(dtype, op.name(), &[x, out])?;
        if n == 0 {
            return Ok(());
        }
        let grid = self.grid(n, 16 / dtype.size_bytes());
        let mut args = [
            Arg::Ptr(x.addr()),
            Arg::Ptr(out.addr()),
            Arg::I64(elems_i64(n)?),
        ];
        self.check_devices(&[x, out])?;
        self.call(
            stream,
            Source::Elementwise,
            &unary_name(op, dtype),
            grid,
            BLOCK,
            &mut args,
        )
    }

    /// Converts `src` (`src_dtype`) into `dst` (`dst_dtype`), same element count. Float types
    /// convert through f32 with round-to-nearest-even; i32 <-> i64; equal dtypes copy.
    pub fn cast(
        &self,
        stream: &Stream,
        src: &DeviceBuffer,
        src_dtype: DType,
        dst: &DeviceBuffer,
        dst_dtype: DType,
    ) -> Result<()> {
        let n = src.elems(src_dtype)?;
        if dst.elems(dst_dtype)? != n {
            return Err(KernelError::InvalidArgument(format!(
                "cast {src_dtype} -> {dst_dtype}: {n} source elements, {} target elements",
                dst.elems(dst_dtype)?
            )));
        }
        self.check_devices(&[src, dst])?;
        if src_dtype == dst_dtype {
            return dst.copy_from(stream, src);
        }
        let supported = (FLOATS.contains(&src_dtype) && FLOATS.contains(&dst_dtype))
            || matches!(
                (src_dtype, dst_dtype),
                (DType::I32, DType::I64) | (DType::I64, DType::I32)
            );
        if !supported {
            return Err(KernelError::Unsupported(format!(
                "cast {src_dtype} -> {dst_dtype}"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let mut args = [
            Arg::Ptr(src.addr()),
            Arg::Ptr(dst.addr()),
            Arg::I64(elems_i64(n)?),
        ];
        let name = cast_name(src_dtype, dst_dtype);
        self.call(
            stream,
            Source::Cast,
            &name,
            self.grid(n, 1),
            BLOCK,
            &mut args,
        )
    }

    /// Sets every `elem_bytes`-sized word of `dst` to the low bytes of `bits`.
    pub fn fill_bits(
        &self,
        stream: &Stream,
        elem_bytes: usize,
        dst: &DeviceBuffer,
        bits: u64,
    ) -> Result<()> {
        let arg = match elem_bytes {
            1 => Arg::U8(bits as u8),
            2 => Arg::U16(bits as u16),
            4 => Arg::U32(bits as u32),
            8 => Arg::U64(bits),
            other => {
                return Err(KernelError::Unsupported(format!(
                    "fill of {other}-byte elements"
                )))
            }
        };
        if !dst.len().is_multiple_of(elem_bytes) {
            return Err(KernelError::InvalidArgument(format!(
                "fill: {} bytes is not a whole number of {elem_bytes}-byte elements",
                dst.len()
            )));
        }
        let n = dst.len() / elem_bytes;
        if n == 0 {
            return Ok(());
        }
        self.check_devices(&[dst])?;
        let mut args = [Arg::Ptr(dst.addr()), arg, Arg::I64(elems_i64(n)?)];
        let name = format!("fill_b{elem_bytes}");
        self.call(
            stream,
            Source::Fill,
            &name,
            self.grid(n, 1),
            BLOCK,
            &mut args,
        )
    }

    /// Sets every element of `dst` to `value` (see [`fill_pattern`]).
    pub fn fill(
        &self,
        stream: &Stream,
        dtype: DType,
        dst: &DeviceBuffer,
        value: f64,
    ) -> Result<()> {
        let bits = fill_pattern(dtype, value)?;
        self.fill_bits(stream, dtype.size_bytes(), dst, bits)
    }

    /// Overwrites `dst` with [`poison_bits`] (tests use it to catch unwritten outputs).
    pub fn poison(&self, stream: &Stream, dtype: DType, dst: &DeviceBuffer) -> Result<()> {
        self.fill_bits(stream, dtype.size_bytes(), dst, poison_bits(dtype))
    }

    /// Errors unless every buffer lives on this device.
    pub(crate) fn check_devices(&self, bufs: &[&DeviceBuffer]) -> Result<()> {
        bufs.iter()
            .try_for_each(|b| self.device.expect_same(b.device(), "a kernel operand"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_patterns() {
        assert_eq!(fill_pattern(DType::F32, 1.0).ok(), Some(0x3F80_0000));
        assert_eq!(fill_pattern(DType::BF16, 1.0).ok(), Some(0x3F80));
        assert_eq!(fill_pattern(DType::F16, 1.0).ok(), Some(0x3C00));
        assert_eq!(fill_pattern(DType::I32, -1.0).ok(), Some(0xFFFF_FFFF));
        assert_eq!(fill_pattern(DType::I64, -2.0).ok(), Some(u64::MAX - 1));
        assert_eq!(fill_pattern(DType::U8, 255.0).ok(), Some(255));
        assert!(fill_pattern(DType::I32, 0.5).is_err());
        assert!(fill_pattern(DType::U8, 256.0).is_err());
        assert!(fill_pattern(DType::I32, f64::NAN).is_err());
        assert!(fill_pattern(DType::I64, 2f64.powi(63)).is_err());
        assert_eq!(
            fill_pattern(DType::I64, -(2f64.powi(63))).ok(),
            Some(1u64 << 63)
        );
    }

    #[test]
    fn poison_is_nan_for_floats() {
        assert!(f32::from_bits(poison_bits(DType::F32) as u32).is_nan());
        assert!(half::bf16::from_bits(poison_bits(DType::BF16) as u16).is_nan());
        assert!(half::f16::from_bits(poison_bits(DType::F16) as u16).is_nan());
    }
}
