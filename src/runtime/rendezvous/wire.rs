//! A compact binary form of named tensors, to send outputs through a rendezvous store.
//!
//! Layout (little endian): `count: u32`, then per tensor `name_len: u32, name, dtype: u8,
//! rank: u32, shape: u64 * rank, payload_len: u64, payload` (elements in row-major order).

use std::collections::BTreeMap;

use half::{bf16, f16};
use meshflow_ir::DType;

use crate::runtime::data::{Storage, TensorData};

/// Why bytes could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed tensor message: {0}")]
pub struct WireError(String);

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::I32 => 3,
        DType::I64 => 4,
    }
}

/// Encodes named tensors.
pub fn encode_tensors(tensors: &BTreeMap<String, TensorData>) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(tensors.len() as u32).to_le_bytes());
    for (name, t) in tensors {
        out.extend_from_slice(&(name.len() as u32).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(dtype_code(t.dtype()));
        out.extend_from_slice(&(t.shape().len() as u32).to_le_bytes());
        for &d in t.shape() {
            out.extend_from_slice(&d.to_le_bytes());
        }
        let mut payload = Vec::new();
        match t.storage() {
            Storage::F32(v) => v
                .iter()
                .for_each(|x| payload.extend_from_slice(&x.to_le_bytes())),
            Storage::BF16(v) => v
                .iter()
                .for_each(|x| payload.extend_from_slice(&x.to_le_bytes())),
            Storage::F16(v) => v
                .iter()
                .for_each(|x| payload.extend_from_slice(&x.to_le_bytes())),
            Storage::I32(v) => v
                .iter()
                .for_each(|x| payload.extend_from_slice(&x.to_le_bytes())),
            Storage::I64(v) => v
                .iter()
                .for_each(|x| payload.extend_from_slice(&x.to_le_bytes())),
        }
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&payload);
    }
    out
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| WireError(format!("truncated at byte {}", self.at)))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        self.array().map(u64::from_le_bytes)
    }
}

fn chunks<const N: usize, T>(p: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    p.chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        })
        .collect()
}

/// Decodes what [`encode_tensors`] produced.
pub fn decode_tensors(bytes: &[u8]) -> Result<BTreeMap<String, TensorData>, WireError> {
    let mut r = Reader { bytes, at: 0 };
    let n = r.u32()?;
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let len = r.u32()? as usize;
        let name = String::from_utf8(r.take(len)?.to_vec())
            .map_err(|_| WireError("a tensor name is not UTF-8".into()))?;
        let code = r.take(1)?[0];
        let rank = r.u32()? as usize;
        if rank > 64 {
            return Err(WireError(format!("`{name}` has {rank} dimensions")));
        }
        let shape = (0..rank).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        let plen = usize::try_from(r.u64()?).map_err(|_| WireError("payload too large".into()))?;
        let p = r.take(plen)?;
        let storage = match code {
            0 => Storage::F32(chunks(p, f32::from_le_bytes)),
            1 => Storage::BF16(chunks(p, bf16::from_le_bytes)),
            2 => Storage::F16(chunks(p, f16::from_le_bytes)),
            3 => Storage::I32(chunks(p, i32::from_le_bytes)),
            4 => Storage::I64(chunks(p, i64::from_le_bytes)),
            c => return Err(WireError(format!("`{name}` has unknown dtype code {c}"))),
        };
        let t = TensorData::new(shape, storage).map_err(|e| WireError(format!("`{name}`: {e}")))?;
        out.insert(name, t);
    }
    if r.at != bytes.len() {
        return Err(WireError(format!("{} trailing bytes", bytes.len() - r.at)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut m = BTreeMap::new();
        for (i, d) in DType::ALL.into_iter().enumerate() {
            m.insert(
                format!("t{i}"),
                TensorData::random(d, &[2, 3], i as u64).unwrap(),
            );
        }
        let bytes = encode_tensors(&m);
        let back = decode_tensors(&bytes).unwrap();
        assert_eq!(back.len(), m.len());
        for (k, v) in &m {
            assert!(v.bit_eq(&back[k]), "{k}");
        }
        assert!(decode_tensors(&bytes[..bytes.len() - 1]).is_err());
    }
}
