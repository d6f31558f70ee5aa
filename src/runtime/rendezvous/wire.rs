//! A compact binary form of named tensors, to send outputs through a rendezvous store.
//!
//! Layout (little endian): `count: u32`, then per tensor `name_len: u32, name, dtype: u8,
//! rank: u32, shape: u64 * rank, payload_len: u64, payload` (elements in row-major order).

use std::collections::BTreeMap;

use crate::runtime::bytes::{dtype_code, elements, put_elements, ByteReader};
use crate::runtime::data::TensorData;

/// Why bytes could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed tensor message: {0}")]
pub struct WireError(String);

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
        put_elements(&mut payload, t.storage());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&payload);
    }
    out
}

/// Decodes what [`encode_tensors`] produced.
pub fn decode_tensors(bytes: &[u8]) -> Result<BTreeMap<String, TensorData>, WireError> {
    let mut r = ByteReader::new(bytes);
    let n = r.u32().map_err(WireError)?;
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let len = r.u32().map_err(WireError)? as usize;
        let name = String::from_utf8(r.take(len).map_err(WireError)?.to_vec())
            .map_err(|_| WireError("a tensor name is not UTF-8".into()))?;
        let named = |e: String| WireError(format!("`{name}`: {e}"));
        let code = r.u8().map_err(named)?;
        let rank = r.u32().map_err(named)? as usize;
        if rank > 64 {
            return Err(WireError(format!("`{name}` has {rank} dimensions")));
        }
        let shape = (0..rank)
            .map(|_| r.u64())
            .collect::<Result<Vec<_>, _>>()
            .map_err(named)?;
        let plen = usize::try_from(r.u64().map_err(named)?)
            .map_err(|_| WireError("payload too large".into()))?;
        let storage = elements(code, r.take(plen).map_err(named)?).map_err(named)?;
        let t = TensorData::new(shape, storage).map_err(|e| named(e.to_string()))?;
        out.insert(name, t);
    }
    r.done().map_err(WireError)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow_ir::DType;

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
