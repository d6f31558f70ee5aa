//! The byte layout the proxy protocol shares with its peers: registered regions, chunk headers
//! and immediates. Nothing here depends on the wire.
//!
//! **Regions.** Every rank registers a send region and a receive region of the same layout: one
//! ring of `ring` bytes per proxy peer (peers in ascending rank order), then one 8-byte credit
//! word per peer. Rank `a` stages a chunk for `b` in ring `slot(b)` of its send region and
//! writes it to the same ring offset of ring `slot_of(a in b's peers)` of `b`'s receive region.
//!
//! **Chunks.** A message is cut into chunks; each takes `HEADER + data` bytes rounded up to
//! [`ALIGN`], contiguous in the ring (a chunk that would wrap is preceded by a pad header and
//! starts at the ring's beginning). Positions are absolute byte counts since the start; the
//! ring offset is `position % ring`.
//!
//! **Immediates** (32 bits). Bit 31 clear: a chunk starts at ring offset `(imm & 0x7fff_ffff) *
//! ALIGN`. Bit 31 set: a control write; [`IMM_CREDIT`] means the sender's credit word for us was
//! updated (it holds the absolute position up to which the receiver has released its ring).

use super::{ProxyError, Topology};

/// Alignment of chunks in a ring, and the unit of ring offsets in immediates.
pub const ALIGN: usize = 64;
/// Size of a chunk header.
pub const HEADER: usize = 64;
/// The immediate of a credit update.
pub const IMM_CREDIT: u32 = 0x8000_0001;
/// Bit 31 of an immediate: a control write.
pub const IMM_CONTROL: u32 = 0x8000_0000;

const MAGIC: u32 = 0x4D46_5058; // "MFPX"
const KIND_CHUNK: u32 = 1;
const KIND_PAD: u32 = 2;

/// A message tag: the key both sides agree on (for the CPU backend: team fingerprint and sequence).
pub type Tag = (u64, u64);

/// The tag of a failure notice (payload: failed rank as u64 LE, then the reason in UTF-8).
pub const ABORT_TAG: Tag = (u64::MAX, u64::MAX);

/// Rounds `n` up to [`ALIGN`].
pub fn align_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// The region layout of one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// This rank.
    pub me: usize,
    /// Its proxy peers, ascending.
    pub peers: Vec<usize>,
    /// Bytes per ring.
    pub ring: usize,
    /// For each peer (same order): this rank's slot in that peer's layout.
    pub slot_at_peer: Vec<usize>,
    /// For each peer (same order): the number of that peer's peers (its regions hold that many
    /// rings before the credit words).
    pub peers_of_peer: Vec<usize>,
}

impl Layout {
    /// The layout of `me` in `topology` with rings of `ring` bytes (a multiple of [`ALIGN`],
    /// at least `4 * ALIGN`, below `2^31 * ALIGN`).
    pub fn new(topology: &Topology, me: usize, ring: usize) -> Result<Layout, ProxyError> {
        if !ring.is_multiple_of(ALIGN)
            || ring < 4 * ALIGN
            || (ring / ALIGN) as u64 > u64::from(!IMM_CONTROL)
        {
            return Err(ProxyError::InvalidArgument(format!(
                "ring size {ring}: must be a multiple of {ALIGN}, at least {} and below 2^31 * {ALIGN}",
                4 * ALIGN
            )));
        }
        if topology.node_of(me).is_none() {
            return Err(ProxyError::InvalidArgument(format!(
                "rank {me} is not in a topology of {} ranks",
                topology.world()
            )));
        }
        let peers = topology.remote_peers(me);
        let slot_at_peer = peers
            .iter()
            .map(|&p| {
                topology
                    .remote_peers(p)
                    .iter()
                    .position(|&q| q == me)
                    .ok_or_else(|| {
                        ProxyError::InvalidArgument(format!("rank {me} is not a peer of rank {p}"))
                    })
            })
            .collect::<Result<_, _>>()?;
        let peers_of_peer = peers
            .iter()
            .map(|&p| topology.remote_peers(p).len())
            .collect();
        Ok(Layout {
            me,
            peers,
            ring,
            slot_at_peer,
            peers_of_peer,
        })
    }

    /// The size of the send and of the receive region.
    pub fn region_len(&self) -> usize {
        self.peers.len() * self.ring + align_up(self.peers.len() * 8)
    }

    /// The dense index of `peer` (`None` for a rank that is not a proxy peer).
    pub fn index_of(&self, peer: usize) -> Option<usize> {
        self.peers.binary_search(&peer).ok()
    }

    /// Start of ring `slot`.
    pub fn ring_base(&self, slot: usize) -> usize {
        slot * self.ring
    }

    /// Offset of credit word `slot` in this rank's regions.
    pub fn credit_offset(&self, slot: usize) -> usize {
        self.peers.len() * self.ring + slot * 8
    }

    /// Offset of this rank's credit word in the regions of peer index `i`.
    pub fn remote_credit_offset(&self, i: usize) -> usize {
        self.peers_of_peer[i] * self.ring + self.slot_at_peer[i] * 8
    }

    /// The largest data payload of one chunk (a quarter of the ring, so several chunks are in
    /// flight at once).
    pub fn max_chunk_data(&self) -> usize {
        self.ring / 4 - HEADER
    }
}

/// A chunk header (or a pad marker), [`HEADER`] bytes on the wire.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// True for a pad marker: the rest of the ring is unused, the next chunk starts at offset 0.
    pub pad: bool,
    /// The message tag.
    pub tag: Tag,
    /// Total length of the message.
    pub msg_len: u64,
    /// Index of this chunk.
    pub chunk_index: u32,
    /// Number of chunks of the message.
    pub chunk_count: u32,
    /// Offset of this chunk's data in the message.
    pub data_offset: u64,
    /// Bytes of data after the header.
    pub data_len: u64,
    /// The absolute ring position where this chunk's reservation starts (before any padding),
    /// so the receiver can release the padding with it.
    pub reserved_from: u64,
}

impl Header {
    /// A pad marker.
    pub fn pad() -> Header {
        Header {
            pad: true,
            tag: (0, 0),
            msg_len: 0,
            chunk_index: 0,
            chunk_count: 0,
            data_offset: 0,
            data_len: 0,
            reserved_from: 0,
        }
    }

    /// Bytes the chunk takes in the ring (header + data, aligned).
    pub fn footprint(&self) -> usize {
        align_up(HEADER + self.data_len as usize)
    }

    /// The wire form.
    pub fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        let kind = if self.pad { KIND_PAD } else { KIND_CHUNK };
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&kind.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.tag.1.to_le_bytes());
        b[24..32].copy_from_slice(&self.msg_len.to_le_bytes());
        b[32..36].copy_from_slice(&self.chunk_index.to_le_bytes());
        b[36..40].copy_from_slice(&self.chunk_count.to_le_bytes());
        b[40..48].copy_from_slice(&self.data_offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.data_len.to_le_bytes());
        b[56..64].copy_from_slice(&self.reserved_from.to_le_bytes());
        b
    }

    /// Parses and checks a header (magic, kind, chunk bounds); the message says what is wrong.
    pub fn decode(b: &[u8; HEADER]) -> Result<Header, String> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        if u32_at(0) != MAGIC {
            return Err(format!("bad chunk magic {:#010x}", u32_at(0)));
        }
        let pad = match u32_at(4) {
            KIND_CHUNK => false,
            KIND_PAD => true,
            k => return Err(format!("unknown chunk kind {k}")),
        };
        let h = Header {
            pad,
            tag: (u64_at(8), u64_at(16)),
            msg_len: u64_at(24),
            chunk_index: u32_at(32),
            chunk_count: u32_at(36),
            data_offset: u64_at(40),
            data_len: u64_at(48),
            reserved_from: u64_at(56),
        };
        if !pad {
            let end = h.data_offset.checked_add(h.data_len);
            if h.chunk_index >= h.chunk_count || end.is_none_or(|e| e > h.msg_len) {
                return Err(format!(
                    "chunk {} of {} with bytes {}+{} of a {}-byte message",
                    h.chunk_index, h.chunk_count, h.data_offset, h.data_len, h.msg_len
                ));
            }
        }
        Ok(h)
    }
}

/// The immediate of a chunk at ring offset `offset` (a multiple of [`ALIGN`]).
pub fn chunk_imm(offset: usize) -> u32 {
    ((offset / ALIGN) as u32) & !IMM_CONTROL
}

/// The ring offset of a chunk immediate (`None` for a control immediate).
pub fn chunk_offset(imm: u32) -> Option<usize> {
    (imm & IMM_CONTROL == 0).then_some(imm as usize * ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_rejected() {
        let h = Header {
            pad: false,
            tag: (7, u64::MAX - 1),
            msg_len: 1000,
            chunk_index: 2,
            chunk_count: 3,
            data_offset: 900,
            data_len: 100,
            reserved_from: 12345,
        };
        assert_eq!(Header::decode(&h.encode()), Ok(h));
        assert_eq!(h.footprint(), 192);
        assert!(Header::decode(&Header::pad().encode()).unwrap().pad);
        let mut bad = h.encode();
        bad[0] = 0;
        assert!(Header::decode(&bad).unwrap_err().contains("magic"));
        let over = Header { data_len: 101, ..h };
        assert!(Header::decode(&over.encode()).is_err());
        let index = Header {
            chunk_index: 3,
            ..h
        };
        assert!(Header::decode(&index.encode()).is_err());
    }

    #[test]
    fn immediates_carry_ring_offsets_and_control_bits() {
        assert_eq!(chunk_offset(chunk_imm(64 * 1000)), Some(64 * 1000));
        assert_eq!(chunk_offset(IMM_CREDIT), None);
    }

    #[test]
    fn layouts_agree_on_slots_between_peers() {
        let t = Topology::contiguous(4, 2).unwrap();
        let l1 = Layout::new(&t, 1, 4096).unwrap();
        assert_eq!(l1.peers, vec![2, 3]);
        assert_eq!(l1.slot_at_peer, vec![1, 1]);
        let l2 = Layout::new(&t, 2, 4096).unwrap();
        assert_eq!(l2.slot_at_peer, vec![0, 0]);
        assert_eq!(l2.region_len(), 2 * 4096 + 64);
        assert_eq!(l2.credit_offset(1), 2 * 4096 + 8);
        // Uneven nodes: rank 2 alone on node 1 has two peers, ranks 0 and 1 one each.
        let t = Topology::contiguous(3, 2).unwrap();
        let l2 = Layout::new(&t, 2, 4096).unwrap();
        assert_eq!(l2.peers_of_peer, vec![1, 1]);
        assert_eq!(l2.remote_credit_offset(1), 4096);
        assert_eq!(
            Layout::new(&t, 1, 4096).unwrap().remote_credit_offset(0),
            2 * 4096 + 8
        );
        assert!(Layout::new(&t, 1, 100).is_err());
        assert!(Layout::new(&t, 9, 4096).is_err());
    }
}
