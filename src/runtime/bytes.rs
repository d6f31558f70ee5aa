//! Little-endian bytes shared by the messages between processes: the rendezvous's named tensors
//! ([`rendezvous`](super::rendezvous)) and the host proxy's fabric messages and node results
//! ([`multinode`](super::multinode)). [`ByteReader`] fails with a message instead of panicking
//! on truncated or malformed input.

use half::{bf16, f16};
use meshflow_ir::DType;

use super::data::Storage;

/// The one-byte code of an element type.
pub(crate) fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::I32 => 3,
        DType::I64 => 4,
    }
}

/// Bytes per element of the type of `code`.
fn element_size(code: u8) -> Result<usize, String> {
    match code {
        0 | 3 => Ok(4),
        1 | 2 => Ok(2),
        4 => Ok(8),
        c => Err(format!("unknown dtype code {c}")),
    }
}

/// Appends the elements of `s` (raw bits, row-major).
pub(crate) fn put_elements(out: &mut Vec<u8>, s: &Storage) {
    match s {
        Storage::F32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Storage::BF16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
        Storage::F16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
        Storage::I32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        Storage::I64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
    }
}

/// Appends a storage: `dtype: u8, len: u64` (elements), then the elements.
pub(crate) fn put_storage(out: &mut Vec<u8>, s: &Storage) {
    out.push(dtype_code(s.dtype()));
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    put_elements(out, s);
}

fn array<const N: usize>(c: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(c);
    a
}

/// The elements of type `code` in `raw` (a whole number of them).
pub(crate) fn elements(code: u8, raw: &[u8]) -> Result<Storage, String> {
    let size = element_size(code)?;
    if !raw.len().is_multiple_of(size) {
        return Err(format!(
            "{} bytes are not a whole number of {size}-byte elements",
            raw.len()
        ));
    }
    let chunks = raw.chunks_exact(size);
    Ok(match code {
        0 => Storage::F32(chunks.map(|c| f32::from_le_bytes(array(c))).collect()),
        1 => Storage::BF16(chunks.map(|c| bf16::from_le_bytes(array(c))).collect()),
        2 => Storage::F16(chunks.map(|c| f16::from_le_bytes(array(c))).collect()),
        3 => Storage::I32(chunks.map(|c| i32::from_le_bytes(array(c))).collect()),
        _ => Storage::I64(chunks.map(|c| i64::from_le_bytes(array(c))).collect()),
    })
}

/// A cursor over bytes that fails with a message instead of panicking.
pub(crate) struct ByteReader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> ByteReader<'a> {
    /// A reader at the start of `bytes`.
    pub(crate) fn new(bytes: &'a [u8]) -> ByteReader<'a> {
        ByteReader { bytes, at: 0 }
    }

    /// The next `n` bytes.
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "truncated: {n} bytes wanted at offset {} of {}",
                    self.at,
                    self.bytes.len()
                )
            })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        self.take(N).map(array)
    }

    /// The next byte.
    pub(crate) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }

    /// The next `u32`.
    pub(crate) fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    /// The next `u64`.
    pub(crate) fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    /// A `u64` count of items of `size` bytes each that must fit in what is left.
    pub(crate) fn count(&mut self, size: usize) -> Result<usize, String> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.at) as u64;
        if n.saturating_mul(size.max(1) as u64) > left {
            return Err(format!(
                "{n} items of {size} bytes do not fit in {left} bytes"
            ));
        }
        Ok(n as usize)
    }

    /// A storage written by [`put_storage`].
    pub(crate) fn storage(&mut self) -> Result<Storage, String> {
        let code = self.u8()?;
        let size = element_size(code)?;
        let n = self.count(size)?;
        elements(code, self.take(n * size)?)
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    /// `Ok` when every byte was read.
    pub(crate) fn done(&self) -> Result<(), String> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(format!("{n} trailing bytes")),
        }
    }
}
