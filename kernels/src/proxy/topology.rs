//! [`Topology`]: which ranks share a node. In-node peers talk over the in-node path (the CPU backend's
//! in-process fabric on CPU, NVLink on GPUs); ranks of different nodes talk through the proxy.

use super::ProxyError;

/// The environment variable that forces nodes of this many consecutive ranks.
pub const NODE_SIZE_ENV: &str = "MESHFLOW_NODE_SIZE";

/// The node of every rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    node_of: Vec<usize>,
}

impl Topology {
    /// Every rank on one node.
    pub fn single_node(world: usize) -> Topology {
        Topology {
            node_of: vec![0; world],
        }
    }

    /// Nodes of `node_size` consecutive ranks (the last may be smaller).
    pub fn contiguous(world: usize, node_size: usize) -> Result<Topology, ProxyError> {
        if node_size == 0 {
            return Err(ProxyError::InvalidArgument(
                "a node must hold at least one rank".into(),
            ));
        }
        Ok(Topology {
            node_of: (0..world).map(|r| r / node_size).collect(),
        })
    }

    /// Ranks grouped by host name (`hosts[r]` is rank `r`'s host); nodes are numbered in order of
    /// first appearance.
    pub fn from_hosts<S: AsRef<str>>(hosts: &[S]) -> Topology {
        let mut names: Vec<&str> = Vec::new();
        let node_of = hosts
            .iter()
            .map(|h| {
                let h = h.as_ref();
                match names.iter().position(|n| *n == h) {
                    Some(i) => i,
                    None => {
                        names.push(h);
                        names.len() - 1
                    }
                }
            })
            .collect();
        Topology { node_of }
    }

    /// [`contiguous`](Self::contiguous) with the node size of [`NODE_SIZE_ENV`] when it is
    /// set, else [`from_hosts`](Self::from_hosts).
    pub fn from_env_or_hosts<S: AsRef<str>>(hosts: &[S]) -> Result<Topology, ProxyError> {
        match node_size_from_env()? {
            Some(n) => Topology::contiguous(hosts.len(), n),
            None => Ok(Topology::from_hosts(hosts)),
        }
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.node_of.len()
    }

    /// The number of nodes.
    pub fn nodes(&self) -> usize {
        self.node_of.iter().max().map_or(0, |m| m + 1)
    }

    /// The node of `rank` (`None` outside the world).
    pub fn node_of(&self, rank: usize) -> Option<usize> {
        self.node_of.get(rank).copied()
    }

    /// The ranks of `node`, ascending.
    pub fn ranks_of(&self, node: usize) -> Vec<usize> {
        (0..self.world())
            .filter(|&r| self.node_of[r] == node)
            .collect()
    }

    /// True when both ranks exist and share a node.
    pub fn same_node(&self, a: usize, b: usize) -> bool {
        matches!((self.node_of(a), self.node_of(b)), (Some(x), Some(y)) if x == y)
    }

    /// The ranks on other nodes than `rank`, ascending: the proxy peers of `rank`.
    pub fn remote_peers(&self, rank: usize) -> Vec<usize> {
        match self.node_of(rank) {
            Some(n) => (0..self.world())
                .filter(|&r| self.node_of[r] != n)
                .collect(),
            None => Vec::new(),
        }
    }
}

/// The node size forced by [`NODE_SIZE_ENV`] (`None` when unset).
pub fn node_size_from_env() -> Result<Option<usize>, ProxyError> {
    match std::env::var(NODE_SIZE_ENV) {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(ProxyError::InvalidArgument(format!(
                "{NODE_SIZE_ENV}=`{v}`: expected a positive integer"
            ))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_nodes_split_consecutive_ranks() {
        let t = Topology::contiguous(5, 2).unwrap();
        assert_eq!(t.nodes(), 3);
        assert_eq!(t.ranks_of(1), vec![2, 3]);
        assert_eq!(t.remote_peers(4), vec![0, 1, 2, 3]);
        assert_eq!(t.remote_peers(0), vec![2, 3, 4]);
        assert!(t.same_node(2, 3) && !t.same_node(1, 2) && !t.same_node(0, 9));
        assert!(Topology::contiguous(4, 0).is_err());
    }

    #[test]
    fn hosts_group_ranks_in_order_of_appearance() {
        let t = Topology::from_hosts(&["b", "a", "b", "a"]);
        assert_eq!(t.nodes(), 2);
        assert_eq!(t.ranks_of(0), vec![0, 2]);
        assert_eq!(t.remote_peers(1), vec![0, 2]);
        assert_eq!(
            Topology::single_node(3).remote_peers(1),
            Vec::<usize>::new()
        );
    }
}
