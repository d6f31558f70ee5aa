//! The structured tree of a host program as a petgraph graph, and its dominator tree.
//!
//! Nodes are blocks and instructions; a block has an edge to each of its instructions, and a
//! `for` instruction an edge to its body block. `petgraph::algo::dominators::simple_fast` from
//! the top block gives each node's dominators. For a set of instructions, the innermost block
//! among their common dominators holds them all; since a structured block is entered at its
//! start and left at its end, that block also post-dominates them, so it is where a buffer
//! used by all of them is allocated (before the first) and freed (after the last).

use std::collections::HashMap;

use meshflow_ir::host::{Block, InstKind};
use petgraph::algo::dominators::{simple_fast, Dominators};
use petgraph::graph::{DiGraph, NodeIndex};

/// A node of the tree: a block or an instruction, with its path (loop indices from the top;
/// for a block, the path of the loop whose body it is).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Scope {
    Block(Vec<usize>),
    Inst(Vec<usize>),
}

/// The tree and its dominators.
pub struct ScopeTree {
    graph: DiGraph<Scope, ()>,
    doms: Dominators<NodeIndex>,
    insts: HashMap<Vec<usize>, NodeIndex>,
}

impl ScopeTree {
    /// Builds the tree of `body`.
    pub fn build(body: &Block) -> ScopeTree {
        let mut graph = DiGraph::new();
        let mut insts = HashMap::new();
        let root = graph.add_node(Scope::Block(Vec::new()));
        fn rec(
            graph: &mut DiGraph<Scope, ()>,
            insts: &mut HashMap<Vec<usize>, NodeIndex>,
            block: &Block,
            node: NodeIndex,
            prefix: &mut Vec<usize>,
        ) {
            for (k, inst) in block.iter().enumerate() {
                prefix.push(k);
                let n = graph.add_node(Scope::Inst(prefix.clone()));
                graph.add_edge(node, n, ());
                insts.insert(prefix.clone(), n);
                if let InstKind::ForLoop { body, .. } = &inst.kind {
                    let b = graph.add_node(Scope::Block(prefix.clone()));
                    graph.add_edge(n, b, ());
                    rec(graph, insts, body, b, prefix);
                }
                prefix.pop();
            }
        }
        rec(&mut graph, &mut insts, body, root, &mut Vec::new());
        let doms = simple_fast(&graph, root);
        ScopeTree { graph, doms, insts }
    }

    /// Dominators of `n`, from the top block down to `n`.
    fn chain(&self, n: NodeIndex) -> Vec<NodeIndex> {
        let mut c: Vec<NodeIndex> = self
            .doms
            .dominators(n)
            .map(|it| it.collect())
            .unwrap_or_default();
        c.reverse();
        c
    }

    /// The innermost block holding every instruction at `paths`: its path, and the indices
    /// (in that block) of the first and last of its instructions containing one of them.
    pub fn enclosing(&self, paths: &[Vec<usize>]) -> Option<(Vec<usize>, usize, usize)> {
        let chains: Vec<Vec<NodeIndex>> = paths
            .iter()
            .map(|p| self.insts.get(p).map(|&n| self.chain(n)))
            .collect::<Option<_>>()?;
        let first = chains.first()?;
        let common = (0..first.len())
            .take_while(|&k| chains.iter().all(|c| c.get(k) == first.get(k)))
            .count();
        // The innermost common block (the common chain may end on a shared instruction).
        let at = (0..common)
            .rev()
            .find(|&k| matches!(self.graph[first[k]], Scope::Block(_)))?;
        let Scope::Block(path) = &self.graph[first[at]] else {
            return None;
        };
        let index = |c: &Vec<NodeIndex>| match &self.graph[*c.get(at + 1)?] {
            Scope::Inst(p) => p.last().copied(),
            Scope::Block(_) => None,
        };
        let indices: Vec<usize> = chains.iter().map(index).collect::<Option<_>>()?;
        Some((path.clone(), *indices.iter().min()?, *indices.iter().max()?))
    }
}
