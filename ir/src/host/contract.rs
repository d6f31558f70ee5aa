//! The buffer contract of every collective kind: which of its two buffers (the send buffer,
//! `input`, and the receive buffer, `output`) each member takes and touches, how their sizes
//! relate through the team size, and which must split into equal chunks.
//!
//! It is written once, here, and read by everything that sizes or moves a collective's
//! buffers: the host verifier (declared shapes), the cross-rank check (each member's buffers
//! and the element count it contributes), the happens-before analyses (what a member reads and
//! writes) and both backends (what they validate before they move bytes).
//!
//! A *chunk* is one of `d` equal contiguous pieces of a buffer's row-major elements, `d` the
//! team size (NCCL's convention; see [`CommKind`]).

use super::CommKind;

/// How one member of a collective uses one of its buffers.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum BufferUse {
    /// The member must hold the buffer, and the collective touches it.
    Required,
    /// The member need not hold it; when it does, the collective touches it (a root's own
    /// copy or chunk).
    Optional,
    /// The collective does not touch it on this member (a member holding it leaves it as it
    /// is).
    Unused,
}

impl BufferUse {
    /// True when the collective reads or writes the buffer (if held).
    pub fn touched(self) -> bool {
        self != BufferUse::Unused
    }
}

/// Which of the two buffers of a collective.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The send buffer (`input`), read.
    Send,
    /// The receive buffer (`output`), written.
    Recv,
}

impl Side {
    /// `"send"` or `"receive"`, as messages name the buffer.
    pub fn name(self) -> &'static str {
        match self {
            Side::Send => "send",
            Side::Recv => "receive",
        }
    }
}

/// How the element counts of the two buffers relate, the team having `d` members.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Sizing {
    /// Both buffers hold the same number of elements.
    Equal,
    /// The receive buffer holds `d` chunks, each the size of the send buffer.
    RecvIsTeamTimesSend,
    /// The send buffer holds `d` chunks, each the size of the receive buffer.
    SendIsTeamTimesRecv,
}

impl Sizing {
    /// The side holding `d` chunks, for the sizings that scale by the team size.
    pub fn whole(self) -> Option<Side> {
        match self {
            Sizing::Equal => None,
            Sizing::RecvIsTeamTimesSend => Some(Side::Recv),
            Sizing::SendIsTeamTimesRecv => Some(Side::Send),
        }
    }
}

/// How one member uses the two buffers of a collective.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct MemberBuffers {
    /// The send buffer.
    pub send: BufferUse,
    /// The receive buffer.
    pub recv: BufferUse,
}

impl MemberBuffers {
    /// The use of `side`.
    pub fn of(self, side: Side) -> BufferUse {
        match side {
            Side::Send => self.send,
            Side::Recv => self.recv,
        }
    }
}

/// A broken size rule of a [`BufferContract`], with the counts involved.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum SizeViolation {
    /// `side` holds `numel` elements, which do not split into `d` equal chunks.
    NotChunked {
        /// The buffer.
        side: Side,
        /// Its element count.
        numel: u64,
        /// The team size.
        d: u64,
    },
    /// The counts do not relate as the kind's [`Sizing`] says.
    Mismatch {
        /// The relation broken.
        sizing: Sizing,
        /// The send buffer's element count.
        send: u64,
        /// The receive buffer's element count.
        recv: u64,
        /// The team size.
        d: u64,
    },
}

/// The buffer contract of one [`CommKind`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct BufferContract {
    /// The kind.
    pub kind: CommKind,
    /// How the two buffers' element counts relate.
    pub sizing: Sizing,
    /// The send buffer must split into `d` equal chunks.
    pub send_chunked: bool,
    /// The receive buffer must split into `d` equal chunks.
    pub recv_chunked: bool,
    /// The team size the kind needs, when it needs one (`send_recv`: 2).
    pub team_size: Option<usize>,
}

impl BufferContract {
    /// How a member uses the buffers: `is_root` tells whether it is the root (always false
    /// for the kinds without one).
    pub fn member(&self, is_root: bool) -> MemberBuffers {
        use BufferUse::{Optional, Required, Unused};
        let (send, recv) = match self.kind {
            CommKind::AllGather
            | CommKind::ReduceScatter
            | CommKind::AllReduce
            | CommKind::AllToAll => (Required, Required),
            CommKind::Broadcast | CommKind::Scatter if is_root => (Required, Optional),
            CommKind::Broadcast | CommKind::Scatter => (Unused, Required),
            CommKind::Gather | CommKind::Reduce if is_root => (Required, Required),
            CommKind::Gather | CommKind::Reduce => (Required, Unused),
            CommKind::SendRecv if is_root => (Required, Unused),
            CommKind::SendRecv => (Unused, Required),
        };
        MemberBuffers { send, recv }
    }

    /// True when `side` must split into `d` equal chunks.
    pub fn chunked(&self, side: Side) -> bool {
        match side {
            Side::Send => self.send_chunked,
            Side::Recv => self.recv_chunked,
        }
    }

    /// The element count one buffer must have for the other to hold `numel` (`numel` of
    /// `side`), `None` on overflow.
    pub fn counterpart(&self, side: Side, numel: u64, d: u64) -> Option<u64> {
        match (self.sizing.whole(), side) {
            (None, _) => Some(numel),
            (Some(whole), side) if whole == side => Some(numel / d.max(1)),
            (Some(_), _) => numel.checked_mul(d),
        }
    }

    /// Checks the element counts of the buffers a member holds and touches (`None` for a
    /// buffer it does not hold or does not touch) against the contract over a team of `d`:
    /// first the chunked sides (send, then receive), then the relation between the two.
    pub fn check_sizes(
        &self,
        send: Option<u64>,
        recv: Option<u64>,
        d: u64,
    ) -> Result<(), SizeViolation> {
        for (side, numel) in [(Side::Send, send), (Side::Recv, recv)] {
            if let Some(numel) = numel.filter(|_| self.chunked(side)) {
                if d == 0 || !numel.is_multiple_of(d) {
                    return Err(SizeViolation::NotChunked { side, numel, d });
                }
            }
        }
        if let (Some(s), Some(r)) = (send, recv) {
            if !self.sizes_match(s, r, d) {
                return Err(SizeViolation::Mismatch {
                    sizing: self.sizing,
                    send: s,
                    recv: r,
                    d,
                });
            }
        }
        Ok(())
    }

    /// True when `send` and `recv` elements relate as the sizing says over a team of `d`.
    pub fn sizes_match(&self, send: u64, recv: u64, d: u64) -> bool {
        match self.sizing {
            Sizing::Equal => send == recv,
            Sizing::RecvIsTeamTimesSend => send.checked_mul(d) == Some(recv),
            Sizing::SendIsTeamTimesRecv => recv.checked_mul(d) == Some(send),
        }
    }
}

impl CommKind {
    /// The kind's buffer contract.
    pub fn contract(self) -> BufferContract {
        let (sizing, send_chunked, recv_chunked) = match self {
            CommKind::AllGather | CommKind::Gather => (Sizing::RecvIsTeamTimesSend, false, true),
            CommKind::ReduceScatter | CommKind::Scatter => {
                (Sizing::SendIsTeamTimesRecv, true, false)
            }
            CommKind::AllToAll => (Sizing::Equal, true, true),
            CommKind::AllReduce | CommKind::Broadcast | CommKind::Reduce | CommKind::SendRecv => {
                (Sizing::Equal, false, false)
            }
        };
        BufferContract {
            kind: self,
            sizing,
            send_chunked,
            recv_chunked,
            team_size: (self == CommKind::SendRecv).then_some(2),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_member_of_every_kind_touches_a_buffer_it_sends_or_receives() {
        for kind in CommKind::ALL {
            let c = kind.contract();
            for is_root in [false, true] {
                let m = c.member(is_root);
                assert!(
                    m.send.touched() || m.recv.touched(),
                    "{kind:?} root={is_root}"
                );
            }
            // The side holding `d` chunks is chunked.
            if let Some(whole) = c.sizing.whole() {
                assert!(c.chunked(whole), "{kind:?}");
            }
        }
    }

    #[test]
    fn sizes_relate_through_the_team_size() {
        let ag = CommKind::AllGather.contract();
        assert_eq!(ag.check_sizes(Some(3), Some(12), 4), Ok(()));
        assert_eq!(
            ag.check_sizes(Some(3), Some(10), 4),
            Err(SizeViolation::NotChunked {
                side: Side::Recv,
                numel: 10,
                d: 4
            })
        );
        assert!(matches!(
            ag.check_sizes(Some(2), Some(12), 4),
            Err(SizeViolation::Mismatch { .. })
        ));
        let a2a = CommKind::AllToAll.contract();
        assert!(matches!(
            a2a.check_sizes(Some(6), Some(6), 4),
            Err(SizeViolation::NotChunked {
                side: Side::Send,
                ..
            })
        ));
        assert_eq!(
            CommKind::ReduceScatter
                .contract()
                .counterpart(Side::Send, 12, 4),
            Some(3)
        );
        assert_eq!(
            CommKind::Gather.contract().counterpart(Side::Send, 3, 4),
            Some(12)
        );
    }
}
