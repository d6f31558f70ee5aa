//! Point-to-point matching of `send_recv`: per ordered pair `(src, dst)`, the k-th send from
//! `src` to `dst` matches the k-th receive at `dst` from `src`, with equal byte counts.

use std::collections::BTreeMap;

use meshflow_ir::{CommKind, DeviceId};

use super::error::{CheckError, Site};
use super::events::{EventKind, Instances};

/// Per rank and event, the `(rank, event)` its `send_recv` half is matched with.
pub(crate) type Matches = Vec<Vec<Option<(DeviceId, usize)>>>;

/// Matches sends with receives; returns the matches and the problems.
pub(crate) fn match_send_recv(inst: &Instances) -> (Matches, Vec<CheckError>) {
    // (src, dst) -> (sends at src, receives at dst), as event indices in issue order.
    let mut pairs: BTreeMap<(DeviceId, DeviceId), (Vec<usize>, Vec<usize>)> = BTreeMap::new();
    for (rank, events) in inst.events.iter().enumerate() {
        for (i, e) in events.iter().enumerate() {
            if e.kind != EventKind::Collective(CommKind::SendRecv) {
                continue;
            }
            if let Some(dst) = e.send_peer {
                pairs.entry((rank, dst)).or_default().0.push(i);
            }
            if let Some(src) = e.recv_peer {
                pairs.entry((src, rank)).or_default().1.push(i);
            }
        }
    }
    let mut matches: Matches = inst.events.iter().map(|e| vec![None; e.len()]).collect();
    let mut errors = Vec::new();
    let site = |rank: DeviceId, i: usize| {
        let e = &inst.events[rank][i];
        Site {
            inst: inst.inst(e).clone(),
            at: e.iteration.clone(),
        }
    };
    for (&(src, dst), (sends, recvs)) in &pairs {
        for (&s, &r) in sends.iter().zip(recvs) {
            matches[src][s] = Some((dst, r));
            matches[dst][r] = Some((src, s));
            let sent = inst.events[src][s].send.map(|b| b.bytes());
            let expected = inst.events[dst][r].recv.map(|b| b.bytes());
            if let (Some(send_bytes), Some(recv_bytes)) = (sent, expected) {
                if send_bytes != recv_bytes {
                    errors.push(CheckError::SizeMismatch {
                        src,
                        dst,
                        send_site: site(src, s),
                        send_bytes,
                        recv_site: site(dst, r),
                        recv_bytes,
                    });
                }
            }
        }
        for (index, &s) in sends.iter().enumerate().skip(recvs.len()) {
            errors.push(CheckError::UnmatchedSend {
                src,
                dst,
                site: site(src, s),
                index,
                received: recvs.len(),
            });
        }
        for (index, &r) in recvs.iter().enumerate().skip(sends.len()) {
            errors.push(CheckError::UnmatchedRecv {
                src,
                dst,
                site: site(dst, r),
                index,
                sent: sends.len(),
            });
        }
    }
    (matches, errors)
}
