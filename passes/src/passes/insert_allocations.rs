//! `insert_allocations`: allocates every buffer right before its first use and frees it right
//! after its last, at the shallowest block that holds all its uses.
//!
//! Uses of a tensor are the instructions naming it or a view of it, and the `wait`s of
//! communications that read or write it (a buffer is freed only after its communication
//! completed). On the structured tree ([`ScopeTree`]: the longest common prefix of the uses'
//! paths) the block that dominates (and post-dominates) all uses is the innermost block
//! containing them; if the tensor is cut into chunks by a
//! `shard_by_stream` directly in that block, the buffer outlives the iterations and moves out
//! of the loop. Allocations go before a stream loop's `get_current_stream`, deallocations after
//! its join. Inputs and views are never allocated; outputs are allocated at the top level and
//! never freed; every other allocation is freed. Existing allocations (the lowering's
//! whole-program ones) are removed first.

use std::collections::BTreeMap;

use meshflow_ir::host::{HostTensorId, Inst, InstKind, Role};
use meshflow_ir::HostProgram;

use crate::error::PassError;
use crate::host_util::{
    after_epilogue, base_of, before_prologue, block_at, block_at_mut, comm_io, view_inputs,
    walk_paths,
};
use crate::manager::HostPass;
use crate::options::PassContext;
use crate::scope_tree::ScopeTree;

/// The pass.
pub struct InsertAllocations;

/// Removes every `allocate` and `deallocate` (they are recomputed).
fn strip_allocations(block: &mut Vec<Inst>) {
    block.retain(|i| {
        !matches!(
            i.kind,
            InstKind::Allocate { .. } | InstKind::Deallocate { .. }
        )
    });
    for i in block.iter_mut() {
        if let InstKind::ForLoop { body, .. } = &mut i.kind {
            strip_allocations(body);
        }
    }
}

impl HostPass for InsertAllocations {
    fn name(&self) -> &'static str {
        "insert_allocations"
    }

    fn run(&self, host: &mut HostProgram, _cx: &mut PassContext) -> Result<(), PassError> {
        strip_allocations(&mut host.body);
        let views = view_inputs(host);
        let io = comm_io(host);
        let tree = ScopeTree::build(&host.body);
        let mut uses: BTreeMap<HostTensorId, Vec<Vec<usize>>> = BTreeMap::new();
        // Tensors chunked by a shard_by_stream, with the path of that instruction.
        let mut chunked: BTreeMap<HostTensorId, Vec<Vec<usize>>> = BTreeMap::new();
        walk_paths(&host.body, &mut |inst, path| {
            let mut named = inst.kind.tensors();
            if let InstKind::Wait { comm } = inst.kind {
                if let Some((r, w)) = io.get(&comm) {
                    named.extend(r.iter().chain(w));
                }
            }
            if let InstKind::ShardByStream { input, .. } = inst.kind {
                chunked.entry(input).or_default().push(path.to_vec());
            }
            if let InstKind::ForLoop { .. } = inst.kind {
                return;
            }
            for t in named {
                uses.entry(base_of(&views, t))
                    .or_default()
                    .push(path.to_vec());
            }
        });
        // (block path, insert position, order, tensor, instruction)
        let mut plan: Vec<(Vec<usize>, usize, u8, HostTensorId, InstKind)> = Vec::new();
        for (&t, paths) in &uses {
            let role = host.tensors[t].role;
            if role == Role::Input || views.contains_key(&t) {
                continue;
            }
            let (mut lca, mut first, mut last) = tree.enclosing(paths).ok_or_else(|| {
                PassError::internal("insert_allocations", "uses without a common block")
            })?;
            if role == Role::Output {
                // Outputs live until the end: allocate at the top level.
                let top: Vec<usize> = paths.iter().filter_map(|p| p.first().copied()).collect();
                lca = Vec::new();
                first = top.iter().copied().min().unwrap_or(0);
                last = top.iter().copied().max().unwrap_or(0);
            }
            // A buffer cut into chunks in a loop body lives across the iterations.
            while !lca.is_empty()
                && chunked.get(&t).is_some_and(|ps| {
                    ps.iter()
                        .any(|p| p.len() == lca.len() + 1 && p.starts_with(&lca))
                })
            {
                let k = lca.pop().unwrap_or(0);
                first = k;
                last = k;
            }
            let block = block_at(&host.body, &lca).ok_or_else(|| {
                PassError::internal("insert_allocations", "a use path does not name a block")
            })?;
            plan.push((
                lca.clone(),
                before_prologue(block, first),
                1,
                t,
                InstKind::Allocate { tensor: t },
            ));
            if role != Role::Output {
                plan.push((
                    lca,
                    after_epilogue(block, last),
                    0,
                    t,
                    InstKind::Deallocate { tensor: t },
                ));
            }
        }
        // Deepest blocks first, so parent indices stay valid.
        plan.sort_by(|a, b| {
            b.0.len()
                .cmp(&a.0.len())
                .then_with(|| a.0.cmp(&b.0))
                .then_with(|| b.1.cmp(&a.1))
                .then_with(|| b.2.cmp(&a.2))
                .then_with(|| b.3.cmp(&a.3))
        });
        for (path, pos, _, _, kind) in plan {
            let block = block_at_mut(&mut host.body, &path).ok_or_else(|| {
                PassError::internal("insert_allocations", "a planned block vanished")
            })?;
            block.insert(pos.min(block.len()), Inst::new(kind));
        }
        Ok(())
    }
}
