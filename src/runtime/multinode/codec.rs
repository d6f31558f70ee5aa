//! Bytes of fabric messages ([`Payload`]) for the proxy, and of a node's results for the
//! rendezvous.
//!
//! Payload layout (little endian): `kind: u8` (0 data, 1 MoE rows), then for data a storage,
//! for MoE rows `rows: u64, meta: [i64; 4] * rows, targets: u64, [i64; 2] * targets, width:
//! u64, storage, fp8: u8` (0 none; 1 per-token or 2 block scales, then `codes: u64, bytes,
//! scales: u64, f32 * scales`). A storage is
//! `dtype: u8, len: u64, elements` (raw bits). Node results: `ok: u8`, then either the error
//! text or `ranks: u32` and per rank `rank: u64, len: u64, tensors` in the rendezvous wire form.

use std::collections::BTreeMap;

use meshflow_ir::{DeviceId, Fp8Scales};

use crate::runtime::bytes::{put_storage, ByteReader};
use crate::runtime::cpu::Payload;
use crate::runtime::cpu_ops::{Fp8Rows, MoeRows};
use crate::runtime::data::TensorData;
use crate::runtime::rendezvous::{decode_tensors, encode_tensors};

/// Encodes a fabric message.
pub fn encode_payload(p: &Payload) -> Vec<u8> {
    let mut out = Vec::new();
    match p {
        Payload::Data(s) => {
            out.push(0);
            put_storage(&mut out, s);
        }
        Payload::Moe(m) => {
            out.push(1);
            out.extend_from_slice(&(m.meta.len() as u64).to_le_bytes());
            for row in &m.meta {
                for v in row {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            out.extend_from_slice(&(m.targets.len() as u64).to_le_bytes());
            for t in &m.targets {
                for v in t {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            out.extend_from_slice(&m.width.to_le_bytes());
            put_storage(&mut out, &m.rows);
            match &m.fp8 {
                None => out.push(0),
                Some(f) => {
                    out.push(match f.granularity {
                        Fp8Scales::PerToken => 1,
                        Fp8Scales::Block128 => 2,
                    });
                    out.extend_from_slice(&(f.codes.len() as u64).to_le_bytes());
                    out.extend_from_slice(&f.codes);
                    out.extend_from_slice(&(f.scales.len() as u64).to_le_bytes());
                    for v in &f.scales {
                        out.extend_from_slice(&v.to_bits().to_le_bytes());
                    }
                }
            }
        }
    }
    out
}

/// Decodes what [`encode_payload`] wrote.
pub fn decode_payload(bytes: &[u8]) -> Result<Payload, String> {
    let mut r = ByteReader::new(bytes);
    let p = match r.u8()? {
        0 => Payload::Data(r.storage()?),
        1 => {
            let n = r.count(32)?;
            let mut meta = Vec::with_capacity(n);
            for _ in 0..n {
                let mut row = [0i64; 4];
                for v in &mut row {
                    *v = r.u64()? as i64;
                }
                meta.push(row);
            }
            let n = r.count(16)?;
            let mut targets = Vec::with_capacity(n);
            for _ in 0..n {
                targets.push([r.u64()? as i64, r.u64()? as i64]);
            }
            let width = r.u64()?;
            let rows = r.storage()?;
            let fp8 = match r.u8()? {
                0 => None,
                g @ (1 | 2) => {
                    let n = r.count(1)?;
                    let codes = r.take(n)?.to_vec();
                    let n = r.count(4)?;
                    let mut scales = Vec::with_capacity(n);
                    for _ in 0..n {
                        let b = r.take(4)?;
                        scales.push(f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]])));
                    }
                    let granularity = if g == 1 {
                        Fp8Scales::PerToken
                    } else {
                        Fp8Scales::Block128
                    };
                    Some(Fp8Rows {
                        codes,
                        scales,
                        granularity,
                    })
                }
                k => return Err(format!("unknown FP8 scale kind {k}")),
            };
            Payload::Moe(MoeRows {
                meta,
                targets,
                rows,
                fp8,
                width,
            })
        }
        k => return Err(format!("unknown message kind {k}")),
    };
    r.done()?;
    Ok(p)
}

/// Outputs of one node's ranks, or the node's error.
pub type NodeResult = Result<BTreeMap<DeviceId, BTreeMap<String, TensorData>>, String>;

/// Encodes a node's result for the rendezvous.
pub fn encode_result(result: &NodeResult) -> Vec<u8> {
    let mut out = Vec::new();
    match result {
        Err(e) => {
            out.push(0);
            out.extend_from_slice(e.as_bytes());
        }
        Ok(ranks) => {
            out.push(1);
            out.extend_from_slice(&(ranks.len() as u64).to_le_bytes());
            for (&rank, tensors) in ranks {
                let t = encode_tensors(tensors);
                out.extend_from_slice(&(rank as u64).to_le_bytes());
                out.extend_from_slice(&(t.len() as u64).to_le_bytes());
                out.extend_from_slice(&t);
            }
        }
    }
    out
}

/// Decodes what [`encode_result`] wrote (the outer error is a malformed message).
pub fn decode_result(bytes: &[u8]) -> Result<NodeResult, String> {
    let mut r = ByteReader::new(bytes);
    match r.u8()? {
        0 => Ok(Err(String::from_utf8_lossy(&bytes[1..]).into_owned())),
        1 => {
            let n = r.count(16)?;
            let mut ranks = BTreeMap::new();
            for _ in 0..n {
                let rank = r.u64()? as DeviceId;
                let len = r.count(1)?;
                let t = decode_tensors(r.take(len)?).map_err(|e| e.to_string())?;
                ranks.insert(rank, t);
            }
            r.done()?;
            Ok(Ok(ranks))
        }
        k => Err(format!("unknown result kind {k}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::data::Storage;
    use half::bf16;
    use meshflow_ir::DType;

    #[test]
    fn payloads_round_trip_bit_exactly_and_garbage_is_an_error() {
        let cases = [
            Payload::Data(Storage::F32(vec![1.5, -0.0, f32::NAN])),
            Payload::Data(Storage::BF16(vec![bf16::from_f32(3.0)])),
            Payload::Data(Storage::F16(vec![])),
            Payload::Data(Storage::I32(vec![i32::MIN, 7])),
            Payload::Moe(MoeRows {
                meta: vec![[1, 2, 3, -4], [5, 6, 7, 8]],
                targets: vec![[0, 1], [3, -2]],
                rows: Storage::I64(vec![i64::MAX, 1, 2, 3]),
                fp8: None,
                width: 2,
            }),
            Payload::Moe(MoeRows {
                meta: vec![[0, 9, 0, 1]],
                targets: vec![[1, 0]],
                rows: Storage::BF16(vec![]),
                fp8: Some(Fp8Rows {
                    codes: vec![0x7e, 0, 0xff, 1],
                    scales: vec![0.5, f32::NAN],
                    granularity: Fp8Scales::Block128,
                }),
                width: 4,
            }),
        ];
        for p in &cases {
            let b = encode_payload(p);
            let back = decode_payload(&b).unwrap();
            assert_eq!(encode_payload(&back), b);
            assert!(decode_payload(&b[..b.len() - 1]).is_err());
        }
        assert!(decode_payload(&[9]).is_err());
        assert!(decode_payload(&[0, 0, 255, 255, 255, 255, 255, 255, 255, 255]).is_err());
    }

    #[test]
    fn node_results_round_trip() {
        let t = TensorData::from_f32(DType::F32, &[2], &[1.0, 2.0]).unwrap();
        let ok: NodeResult = Ok(BTreeMap::from([(
            3,
            BTreeMap::from([("y".to_string(), t)]),
        )]));
        let back = decode_result(&encode_result(&ok)).unwrap().unwrap();
        assert!(back[&3]["y"].bit_eq(&ok.as_ref().unwrap()[&3]["y"]));
        let err: NodeResult = Err("rank 2 failed".into());
        assert_eq!(decode_result(&encode_result(&err)).unwrap(), err);
    }
}
