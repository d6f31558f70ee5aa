//! Helpers over host programs: tensor references, views, communications, compaction.

use std::collections::{BTreeSet, HashMap};

use meshflow_ir::host::{Block, CommId, HostTensorId, Inst, InstKind};
use meshflow_ir::{Arena, EntityRef, HostProgram};

/// Calls `f` on every instruction of `block` (pre-order), with its path of indices.
pub fn walk_paths(block: &Block, f: &mut impl FnMut(&Inst, &[usize])) {
    fn rec(block: &Block, prefix: &mut Vec<usize>, f: &mut impl FnMut(&Inst, &[usize])) {
        for (k, inst) in block.iter().enumerate() {
            prefix.push(k);
            f(inst, prefix);
            if let InstKind::ForLoop { body, .. } = &inst.kind {
                rec(body, prefix, f);
            }
            prefix.pop();
        }
    }
    rec(block, &mut Vec::new(), f);
}

/// View -> the tensor it views (from every `shard_by_stream`).
pub fn view_inputs(host: &HostProgram) -> HashMap<HostTensorId, HostTensorId> {
    let mut out = HashMap::new();
    host.walk(&mut |inst, _| {
        if let Some((v, input)) = inst.kind.view() {
            out.insert(v, input);
        }
    });
    out
}

/// The buffer a tensor (or view of a view ...) lives in.
pub fn base_of(views: &HashMap<HostTensorId, HostTensorId>, mut t: HostTensorId) -> HostTensorId {
    let mut guard = 0;
    while let Some(&b) = views.get(&t) {
        t = b;
        guard += 1;
        if guard > views.len() {
            break;
        }
    }
    t
}

/// Per communication label: the tensors it reads and the tensors it writes.
pub fn comm_io(host: &HostProgram) -> HashMap<CommId, (Vec<HostTensorId>, Vec<HostTensorId>)> {
    let mut out: HashMap<CommId, (Vec<HostTensorId>, Vec<HostTensorId>)> = HashMap::new();
    // The tensors of the coalescing group being walked: its `end_coalescing` label covers them.
    let mut group: Option<(Vec<HostTensorId>, Vec<HostTensorId>)> = None;
    host.walk(&mut |inst, _| {
        match &inst.kind {
            InstKind::StartCoalescing => group = Some(Default::default()),
            InstKind::EndCoalescing { id } => {
                if let Some((r, w)) = group.take() {
                    let e = out.entry(*id).or_default();
                    e.0.extend(r);
                    e.1.extend(w);
                }
            }
            _ => {}
        }
        if inst.kind.is_communication() {
            if let Some(g) = &mut group {
                g.0.extend(inst.kind.reads());
                g.1.extend(inst.kind.writes());
            }
            if let Some(id) = inst.kind.comm_id() {
                let e = out.entry(id).or_default();
                e.0.extend(inst.kind.reads());
                e.1.extend(inst.kind.writes());
            }
        }
    });
    out
}

/// Rewrites every tensor handle of `kind` (and of a loop body) with `f`.
pub fn map_tensors(kind: &mut InstKind, f: &mut impl FnMut(HostTensorId) -> HostTensorId) {
    kind.for_each_operand_mut(|_, t| *t = f(*t));
    if let InstKind::ForLoop { body, .. } = kind {
        for inst in body {
            map_tensors(&mut inst.kind, f);
        }
    }
}

/// Drops internal tensors no instruction names (renumbering the rest).
pub fn compact_tensors(host: &mut HostProgram) {
    let mut used = BTreeSet::new();
    host.walk(&mut |inst, _| used.extend(inst.kind.tensors()));
    let keep = |id: HostTensorId, role: meshflow_ir::Role| {
        role != meshflow_ir::Role::Internal || used.contains(&id)
    };
    if host.tensors.iter().all(|(id, t)| keep(id, t.role)) {
        return;
    }
    let mut remap = vec![None; host.tensors.len()];
    let mut tensors = Arena::new();
    for (id, t) in host.tensors.iter() {
        if keep(id, t.role) {
            remap[id.index()] = Some(tensors.push(t.clone()));
        }
    }
    host.tensors = tensors;
    let mut f = |t: HostTensorId| remap.get(t.index()).copied().flatten().unwrap_or(t);
    for inst in &mut host.body {
        map_tensors(&mut inst.kind, &mut f);
    }
}

/// True when the block (recursively) holds an instruction satisfying `pred`.
pub fn any_deep(block: &Block, pred: &impl Fn(&InstKind) -> bool) -> bool {
    block.iter().any(|inst| {
        pred(&inst.kind)
            || matches!(&inst.kind, InstKind::ForLoop { body, .. } if any_deep(body, pred))
    })
}

/// The block at `path` (a list of loop indices from the top), mutably.
pub fn block_at_mut<'a>(body: &'a mut Block, path: &[usize]) -> Option<&'a mut Block> {
    let mut block = body;
    for &k in path {
        match &mut block.get_mut(k)?.kind {
            InstKind::ForLoop { body, .. } => block = body,
            _ => return None,
        }
    }
    Some(block)
}

/// The block at `path`.
pub fn block_at<'a>(body: &'a Block, path: &[usize]) -> Option<&'a Block> {
    let mut block = body;
    for &k in path {
        match &block.get(k)?.kind {
            InstKind::ForLoop { body, .. } => block = body,
            _ => return None,
        }
    }
    Some(block)
}

/// True for the join loop `assign_streams` emits after a stream loop.
pub fn is_join_loop(inst: &Inst) -> bool {
    matches!(&inst.kind, InstKind::ForLoop { body, .. }
        if !body.is_empty() && body.iter().all(|i| matches!(i.kind, InstKind::Synchronize { .. })))
}

/// Index to insert before so as to come before the loop at `k` and its stream prologue.
pub fn before_prologue(block: &Block, k: usize) -> usize {
    // Inside a coalescing group only communications may stand: go before its start.
    if let Some(start) = group_start(block, k) {
        return start;
    }
    let is_loop = matches!(
        block.get(k).map(|i| &i.kind),
        Some(InstKind::ForLoop { .. })
    );
    let prologue = k > 0
        && matches!(
            block.get(k - 1).map(|i| &i.kind),
            Some(InstKind::GetCurrentStream { .. })
        );
    if is_loop && prologue {
        k - 1
    } else {
        k
    }
}

/// The index of the `start_coalescing` of the group that instruction `k` of `block` is in
/// (`k` itself when it is a `start_coalescing`), if any.
fn group_start(block: &Block, k: usize) -> Option<usize> {
    for j in (0..=k.min(block.len().saturating_sub(1))).rev() {
        match block.get(j).map(|i| &i.kind) {
            Some(InstKind::StartCoalescing) => return Some(j),
            Some(InstKind::EndCoalescing { .. }) if j < k => return None,
            _ => {}
        }
    }
    None
}

/// Index to insert at so as to come after the instruction at `k` and, for a stream loop, its
/// epilogue (`set_current_stream s; for .. { synchronize worker(..) }`).
pub fn after_epilogue(block: &Block, k: usize) -> usize {
    if group_start(block, k).is_some() {
        if let Some(end) = block[k..]
            .iter()
            .position(|i| matches!(i.kind, InstKind::EndCoalescing { .. }))
        {
            return k + end + 1;
        }
    }
    let is_loop = matches!(
        block.get(k).map(|i| &i.kind),
        Some(InstKind::ForLoop { .. })
    );
    let restore = matches!(
        block.get(k + 1).map(|i| &i.kind),
        Some(InstKind::SetCurrentStream {
            stream: meshflow_ir::StreamRef::Var(_)
        })
    );
    let join = block.get(k + 2).is_some_and(is_join_loop);
    let mut end = if is_loop && restore && join {
        k + 3
    } else {
        k + 1
    };
    // Joins of worker streams right after it (a loop that placed its own streams): a worker
    // may still be reading what the instruction named.
    while matches!(
        block.get(end).map(|i| &i.kind),
        Some(InstKind::Synchronize {
            stream: meshflow_ir::StreamRef::Worker(_)
        })
    ) {
        end += 1;
    }
    end
}
