//! [`StagedRoute`]: device memory to and from ranks of other nodes through a [`Proxy`], staged
//! in host memory (feature `cuda`).
//!
//! The sender's thread copies the bytes off the device once the stream's earlier work is done
//! and hands them to its proxy, which writes them one-sidedly into the receiver's ring with
//! immediates; the receiver's proxy counts the chunks and raises the message's flag; the
//! receiver's thread then copies the message onto the device in stream order. Staging is done by
//! the rank's thread (not by kernels writing mapped host memory), so a transfer through the
//! route blocks that thread until its own data is ready and, on the receiving side, until the
//! peer's message is in. Every member of a team calls the route's operations in the same order,
//! which numbers the messages ([`StagedRoute::next_tag`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Proxy, ProxyError, Tag, Topology};
use crate::buffer::DeviceBuffer;
use crate::error::{KernelError, Result};
use crate::stream::Stream;

/// Says whether a wait should stop early: the rank of the run that failed and why, or `None`.
pub type CancelCheck = Arc<dyn Fn() -> Option<(usize, String)> + Send + Sync>;

/// How long one receive waits before checking [`CancelCheck`] again.
const RECV_SLICE: Duration = Duration::from_millis(50);

/// One rank's route to the members of a team that are on other nodes.
pub struct StagedRoute {
    proxy: Arc<Proxy>,
    /// The rank of every team member (index in the team -> global rank).
    members: Vec<usize>,
    /// Per team member: on another node than this rank.
    remote: Vec<bool>,
    domain: u64,
    seq: u64,
    timeout: Duration,
    cancel: Option<CancelCheck>,
}

impl std::fmt::Debug for StagedRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedRoute")
            .field("rank", &self.proxy.rank())
            .field("members", &self.members)
            .field("remote", &self.remote)
            .field("seq", &self.seq)
            .finish()
    }
}

/// A message domain for a team: the same on every member, different for other teams and for
/// `purpose` (e.g. permutes and MoE rows of one team).
fn domain_of(members: &[usize], purpose: u64) -> u64 {
    // FNV-1a over the purpose and the member ranks.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in std::iter::once(purpose).chain(members.iter().map(|&m| m as u64)) {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    // Never the reserved abort tag's domain.
    h & (u64::MAX >> 1)
}

fn proxy_error(e: ProxyError) -> KernelError {
    KernelError::Proxy(e)
}

impl StagedRoute {
    /// The route of `proxy`'s rank within the team `members` (global ranks, in team order),
    /// with the nodes of `topology`. `purpose` separates the messages of several routes of
    /// the same team. Each receive waits at most `timeout`; `cancel` ends it early.
    pub fn new(
        proxy: Arc<Proxy>,
        topology: &Topology,
        members: Vec<usize>,
        purpose: u64,
        timeout: Duration,
        cancel: Option<CancelCheck>,
    ) -> Result<StagedRoute> {
        let me = proxy.rank();
        if !members.contains(&me) {
            return Err(KernelError::InvalidArgument(format!(
                "rank {me} builds a proxy route for team {members:?}, which it is not in"
            )));
        }
        let remote = members
            .iter()
            .map(|&m| !topology.same_node(me, m))
            .collect();
        Ok(StagedRoute {
            domain: domain_of(&members, purpose),
            proxy,
            members,
            remote,
            seq: 0,
            timeout,
            cancel,
        })
    }

    /// Whether team member `index` is on another node.
    pub fn is_remote(&self, index: usize) -> bool {
        self.remote.get(index).copied().unwrap_or(false)
    }

    /// Whether any team member is on another node.
    pub fn has_remote(&self) -> bool {
        self.remote.iter().any(|&r| r)
    }

    /// The tag of the team's next exchange (every member calls this once per exchange, in the
    /// same order).
    pub fn next_tag(&mut self) -> Tag {
        self.seq += 1;
        (self.domain, self.seq)
    }

    fn global(&self, index: usize) -> Result<usize> {
        self.members.get(index).copied().ok_or_else(|| {
            KernelError::InvalidArgument(format!(
                "team member {index} of a team of {}",
                self.members.len()
            ))
        })
    }

    /// Sends `parts` (concatenated, in order) to team member `to` under `tag`: waits for the
    /// earlier work of `stream`, copies the bytes to the host and stages them in the proxy.
    pub fn send(
        &self,
        stream: &Stream,
        to: usize,
        tag: Tag,
        parts: &[&DeviceBuffer],
    ) -> Result<()> {
        let peer = self.global(to)?;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut bytes = vec![0u8; total];
        let mut at = 0;
        for p in parts {
            p.download(stream, &mut bytes[at..at + p.len()])?;
            at += p.len();
        }
        self.proxy
            .send(peer, tag, &bytes, self.timeout)
            .map_err(proxy_error)
    }

    /// Receives the message of team member `from` under `tag` and copies it into `parts` (in
    /// order; their lengths must add up to the message's) on `stream`.
    pub fn recv(
        &self,
        stream: &Stream,
        from: usize,
        tag: Tag,
        parts: &[&DeviceBuffer],
    ) -> Result<()> {
        let peer = self.global(from)?;
        let bytes = self.wait_message(peer, tag)?;
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if bytes.len() != total {
            return Err(KernelError::InvalidArgument(format!(
                "rank {peer} sent {} bytes through the proxy, rank {} expects {total}",
                bytes.len(),
                self.proxy.rank()
            )));
        }
        let mut at = 0;
        for p in parts {
            p.upload(stream, &bytes[at..at + p.len()])?;
            at += p.len();
        }
        Ok(())
    }

    fn wait_message(&self, peer: usize, tag: Tag) -> Result<Vec<u8>> {
        let start = Instant::now();
        loop {
            let left = self.timeout.saturating_sub(start.elapsed());
            match self.proxy.recv(peer, tag, RECV_SLICE.min(left)) {
                Ok(v) => return Ok(v),
                Err(ProxyError::Timeout { .. }) if start.elapsed() < self.timeout => {}
                Err(ProxyError::Timeout { .. }) => {
                    return Err(proxy_error(ProxyError::Timeout {
                        peer,
                        waited: start.elapsed(),
                        what: format!("message {tag:?} through the proxy"),
                    }))
                }
                Err(e) => return Err(proxy_error(e)),
            }
            if let Some((rank, reason)) = self.cancel.as_ref().and_then(|c| c()) {
                return Err(proxy_error(ProxyError::Aborted { rank, reason }));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_differ_by_team_and_purpose_and_never_take_the_abort_tag() {
        let a = domain_of(&[0, 1], 1);
        assert_eq!(a, domain_of(&[0, 1], 1));
        assert_ne!(a, domain_of(&[1, 0], 1));
        assert_ne!(a, domain_of(&[0, 1], 2));
        assert_ne!(a, domain_of(&[0, 1, 2], 1));
        assert_ne!(a, u64::MAX);
    }
}
