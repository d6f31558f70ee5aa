//! [`QpInfo`]: what two ranks exchange through the rendezvous to connect an RC queue pair and
//! write into each other's receive region. Plain data, so it is built and tested without the
//! `rdma` feature.

use super::ProxyError;

const MAGIC: u32 = 0x4D46_4942; // "MFIB"

/// One side of an RC queue-pair connection plus the receive region the other side writes to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID (used for global routing when the LID is 0).
    pub gid: [u8; 16],
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number of this side's send queue.
    pub psn: u32,
    /// Remote key of this side's receive region.
    pub rkey: u32,
    /// Address of this side's receive region.
    pub addr: u64,
    /// Length of this side's receive region.
    pub len: u64,
}

impl QpInfo {
    /// Encoded size.
    pub const LEN: usize = 4 + 2 + 16 + 4 + 4 + 4 + 8 + 8;

    /// The wire form (little endian, after a magic number).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::LEN);
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&self.lid.to_le_bytes());
        b.extend_from_slice(&self.gid);
        b.extend_from_slice(&self.qpn.to_le_bytes());
        b.extend_from_slice(&self.psn.to_le_bytes());
        b.extend_from_slice(&self.rkey.to_le_bytes());
        b.extend_from_slice(&self.addr.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses what [`encode`](Self::encode) wrote; `from` names the sender in errors.
    pub fn decode(b: &[u8], from: usize) -> Result<QpInfo, ProxyError> {
        let bad = |what: &str| {
            ProxyError::Setup(format!(
                "malformed queue-pair info from rank {from} ({} bytes): {what}",
                b.len()
            ))
        };
        if b.len() != Self::LEN {
            return Err(bad(&format!("expected {} bytes", Self::LEN)));
        }
        let mut at = 0;
        let mut take = |n: usize| {
            let s = &b[at..at + n];
            at += n;
            s
        };
        let u32_of = |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let u64_of = |s: &[u8]| {
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            u64::from_le_bytes(a)
        };
        if u32_of(take(4)) != MAGIC {
            return Err(bad("bad magic"));
        }
        let l = take(2);
        let lid = u16::from_le_bytes([l[0], l[1]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(take(16));
        Ok(QpInfo {
            lid,
            gid,
            qpn: u32_of(take(4)),
            psn: u32_of(take(4)),
            rkey: u32_of(take(4)),
            addr: u64_of(take(8)),
            len: u64_of(take(8)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_pair_info_round_trips_and_rejects_garbage() {
        let q = QpInfo {
            lid: 7,
            gid: [3; 16],
            qpn: 0x00ab_cdef,
            psn: 0x123456,
            rkey: 0xdead_beef,
            addr: 0x7f00_0000_1000,
            len: 1 << 20,
        };
        let b = q.encode();
        assert_eq!(b.len(), QpInfo::LEN);
        assert_eq!(QpInfo::decode(&b, 1), Ok(q));
        let e = QpInfo::decode(&b[1..], 3).unwrap_err();
        assert!(e.to_string().contains("from rank 3"), "{e}");
        let mut bad = b.clone();
        bad[0] ^= 1;
        assert!(QpInfo::decode(&bad, 1).is_err());
    }
}
