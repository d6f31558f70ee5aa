//! The structured tree of a host program, and the innermost block holding a set of
//! instructions.
//!
//! An instruction is named by its path: its index in the top block, then, inside each `for`
//! loop on the way down, its index in the loop's body. Blocks nest, so the innermost block
//! holding a set of instructions is read off the longest common prefix of their paths: the
//! body named by that prefix when every path goes below it, else (one of the instructions is
//! the loop the prefix names) the block holding that loop. A structured block is entered at
//! its start and left at its end, so that block is where a buffer used by all of the
//! instructions is allocated (before the first) and freed (after the last).

use std::collections::HashSet;

use meshflow_ir::host::{Block, InstKind};

/// The paths of every instruction of a host program's body.
pub struct ScopeTree {
    insts: HashSet<Vec<usize>>,
}

impl ScopeTree {
    /// Builds the tree of `body`.
    pub fn build(body: &Block) -> ScopeTree {
        fn rec(insts: &mut HashSet<Vec<usize>>, block: &Block, prefix: &mut Vec<usize>) {
            for (k, inst) in block.iter().enumerate() {
                prefix.push(k);
                insts.insert(prefix.clone());
                if let InstKind::ForLoop { body, .. } = &inst.kind {
                    rec(insts, body, prefix);
                }
                prefix.pop();
            }
        }
        let mut insts = HashSet::new();
        rec(&mut insts, body, &mut Vec::new());
        ScopeTree { insts }
    }

    /// The innermost block holding every instruction at `paths`: its path (that of the loop
    /// whose body it is; empty for the top block), and the indices (in that block) of the
    /// first and last of its instructions containing one of them. `None` when `paths` is
    /// empty or names an instruction that does not exist.
    pub fn enclosing(&self, paths: &[Vec<usize>]) -> Option<(Vec<usize>, usize, usize)> {
        let first = paths.first()?;
        if !paths.iter().all(|p| self.insts.contains(p)) {
            return None;
        }
        let common = (0..first.len())
            .take_while(|&k| paths.iter().all(|p| p.get(k) == first.get(k)))
            .count();
        // The prefix names a loop that is itself one of the instructions: its block holds all.
        let depth = if paths.iter().any(|p| p.len() == common) {
            common.checked_sub(1)?
        } else {
            common
        };
        let indices = paths.iter().map(|p| p.get(depth).copied());
        let (mut lo, mut hi) = (usize::MAX, 0);
        for i in indices {
            let i = i?;
            lo = lo.min(i);
            hi = hi.max(i);
        }
        Some((first[..depth].to_vec(), lo, hi))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow_ir::parse_host;

    /// `a; for { b; for { c; d } }; e` as a tree.
    fn tree() -> ScopeTree {
        let host = parse_host(
            "host t {\n  mesh m = [0]\n  in x: f32[4] on m\n  out y: f32[4] on m\n  \
             copy(x -> y)\n  for i0 in 0..2 {\n    copy(x -> y)\n    for i1 in 0..2 {\n      \
             copy(x -> y)\n      copy(x -> y)\n    }\n  }\n  copy(x -> y)\n}\n",
        )
        .expect("parses");
        ScopeTree::build(&host.body)
    }

    #[test]
    fn siblings_share_their_block() {
        let t = tree();
        assert_eq!(
            t.enclosing(&[vec![1, 1, 0], vec![1, 1, 1]]),
            Some((vec![1, 1], 0, 1))
        );
        assert_eq!(t.enclosing(&[vec![0], vec![2]]), Some((vec![], 0, 2)));
    }

    #[test]
    fn instructions_at_different_depths_meet_in_the_outer_block() {
        let t = tree();
        assert_eq!(t.enclosing(&[vec![0], vec![1, 1, 1]]), Some((vec![], 0, 1)));
        assert_eq!(
            t.enclosing(&[vec![1, 0], vec![1, 1, 0]]),
            Some((vec![1], 0, 1))
        );
    }

    #[test]
    fn a_loop_and_an_instruction_in_its_body_meet_around_the_loop() {
        let t = tree();
        assert_eq!(t.enclosing(&[vec![1], vec![1, 1, 0]]), Some((vec![], 1, 1)));
        assert_eq!(
            t.enclosing(&[vec![1, 1, 1], vec![1, 1]]),
            Some((vec![1], 1, 1))
        );
        assert_eq!(t.enclosing(&[vec![2]]), Some((vec![], 2, 2)));
    }

    #[test]
    fn unknown_or_no_instructions_have_no_block() {
        let t = tree();
        assert_eq!(t.enclosing(&[]), None);
        assert_eq!(t.enclosing(&[vec![0], vec![7]]), None);
        assert_eq!(t.enclosing(&[vec![0, 0]]), None);
    }
}
