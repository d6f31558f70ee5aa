//! `prefetch_transfers`: with [`StreamSchedule::Prefetch`], a stream loop that moves one chunk
//! and then computes on it runs its transfers one iteration ahead on a worker stream while the
//! compute stays on the main stream (software pipelining with the chunks as double buffers).
//!
//! A top-level loop qualifies when its body is: chunk views, one collective permute (a ring)
//! into a chunk view of a buffer cut into one chunk per iteration, the wait for it, then views
//! and compute that read but do not write the transfer's buffers:
//!
//! ```text
//! for i in a..b { pre(i); c = comm(i); wait c; post(i) }
//! ```
//!
//! becomes
//!
//! ```text
//! s = get_current_stream
//! set_current_stream worker(0); synchronize s; pre(a); c' = comm(a); set_current_stream s; wait c'
//! for i in a..b-1 {
//!   set_current_stream worker(0); synchronize s      // after the compute of chunk i-1
//!   pre(i+1); c = comm(i+1)                           // chunk i+1 moves ...
//!   set_current_stream s; pre(i); post(i)             // ... while chunk i is computed
//!   wait c
//! }
//! pre(b-1); post(b-1)
//! synchronize worker(0)                               // the worker's last send is done
//! ```
//!
//! When the first transfer is a permute to the rank itself (a ring's step 0: the own chunk
//! copied into the gathered buffer) and the compute reads the transferred chunk only through
//! the transfer's output view, the first chunk is computed straight from the transfer's input,
//! so that neither the copy nor the first real transfer waits in front of it:
//!
//! ```text
//! s = get_current_stream
//! set_current_stream worker(0); synchronize s
//! pre(a+1); c2 = comm(a+1)                   // the first real transfer, at once
//! pre(a); c1 = comm(a)                       // the copy to itself, off the critical path
//! set_current_stream s; pre(a); post(a)[comm(a)'s output read as its input]
//! wait c2; wait c1
//! for i in a+1..b-1 { ... as above ... }
//! pre(b-1); post(b-1)
//! synchronize worker(0)
//! ```
//!
//! The copy to itself is left out when the gathered buffer is a temporary that no instruction
//! outside the loop names but its allocation (its own chunk is then read by nobody).
//!
//! Other loops are left to `assign_streams` (which skips loops that already place their work on
//! streams). With [`StreamSchedule::Prefetch`] the pass takes every loop that qualifies; with
//! [`StreamSchedule::Auto`] (the default) only the loops `lower_to_host` lists in
//! [`PassContext::prefetch_loops`] (distance rings the search planned with this schedule); with
//! [`StreamSchedule::PerIteration`] none.

use std::collections::HashMap;

use meshflow_ir::host::{
    CommId, Expr, HostTensorId, Inst, InstKind, LoopVar, Role, StreamRef, StreamVar, Team,
};
use meshflow_ir::HostProgram;

use crate::error::PassError;
use crate::index::{host_facts, substitute, Simplifier};
use crate::manager::{HostPass, PassContext, StreamSchedule};

/// The pass.
pub struct PrefetchTransfers;

impl HostPass for PrefetchTransfers {
    fn name(&self) -> &'static str {
        "prefetch_transfers"
    }

    fn run(&self, host: &mut HostProgram, cx: &mut PassContext) -> Result<(), PassError> {
        let all = match cx.options.stream_schedule {
            StreamSchedule::Prefetch => true,
            StreamSchedule::Auto if !cx.prefetch_loops.is_empty() => false,
            StreamSchedule::Auto | StreamSchedule::PerIteration => return Ok(()),
        };
        let mut next_stream = host.fresh_stream_var().0;
        let mut next_comm = host.fresh_comm_id().0;
        let mut simp = Simplifier::new(host_facts(host));
        let body = std::mem::take(&mut host.body);
        let mut refs = HashMap::new();
        count_refs(&body, &mut refs);
        let mut out = Vec::with_capacity(body.len());
        for inst in body {
            let chosen = all
                || matches!(&inst.kind, InstKind::ForLoop { index, .. }
                    if cx.prefetch_loops.contains(index));
            let Some(shape) = Candidate::of(&inst).filter(|_| chosen) else {
                out.push(inst);
                continue;
            };
            let saved = StreamVar(next_stream);
            next_stream += 1;
            let mut fresh = || {
                next_comm += 1;
                CommId(next_comm - 1)
            };
            match shape.forwardable_first(host, &inst, &refs, &mut simp) {
                Some(forward) => shape.emit_forwarded(saved, [fresh(), fresh()], forward, &mut out),
                None => shape.emit(saved, fresh(), &mut out),
            }
        }
        host.body = out;
        Ok(())
    }
}

/// A loop that qualifies, cut into its parts.
struct Candidate<'a> {
    var: LoopVar,
    start: i64,
    stop: i64,
    pre: &'a [Inst],
    comm: &'a Inst,
    post: &'a [Inst],
    /// The buffer the transfer's output view cuts.
    out_base: HostTensorId,
}

/// The first transfer's input and output views, when the first chunk can be computed from the
/// input (see the module docs).
#[derive(Copy, Clone)]
struct Forward {
    input: HostTensorId,
    output: HostTensorId,
    /// Nothing else reads the chunk the copy to itself writes (the gathered buffer is a
    /// temporary named nowhere outside the loop): the copy is left out.
    copy_is_dead: bool,
}

/// How many instructions (at any depth) other than allocations name each tensor.
fn count_refs(block: &[Inst], out: &mut HashMap<HostTensorId, usize>) {
    for inst in block {
        match &inst.kind {
            InstKind::ForLoop { body, .. } => count_refs(body, out),
            InstKind::Allocate { .. } | InstKind::Deallocate { .. } => {}
            k => {
                for t in k.tensors() {
                    *out.entry(t).or_default() += 1;
                }
            }
        }
    }
}

/// The chunk views a block binds: view -> (viewed tensor, chunks, index).
fn views(block: &[Inst]) -> Vec<(HostTensorId, HostTensorId, u64, &Expr)> {
    block
        .iter()
        .filter_map(|i| match &i.kind {
            InstKind::ShardByStream {
                out,
                input,
                chunks,
                index,
                ..
            } => Some((*out, *input, *chunks, index)),
            _ => None,
        })
        .collect()
}

fn uses_var(e: &Expr, var: LoopVar) -> bool {
    match e {
        Expr::Loop(v) => *v == var,
        Expr::Bin(_, a, b) => uses_var(a, var) || uses_var(b, var),
        _ => false,
    }
}

impl<'a> Candidate<'a> {
    fn of(inst: &'a Inst) -> Option<Candidate<'a>> {
        let InstKind::ForLoop {
            index,
            start,
            stop,
            body,
        } = &inst.kind
        else {
            return None;
        };
        let (start, stop) = (start.as_const()?, stop.as_const()?);
        if stop - start < 2 {
            return None;
        }
        let k = body.iter().position(|i| i.kind.is_communication())?;
        let comm = &body[k];
        // Rings only: a stream loop of broadcasts measured slower this way (every broadcast is
        // a collective of all ranks, so waiting for each rank's previous compute puts the ranks
        // in lockstep).
        let (id, input, output) = match &comm.kind {
            InstKind::CollectivePermute {
                id, input, output, ..
            } => (*id, *input, *output),
            _ => return None,
        };
        let (pre, rest) = body.split_at(k);
        if !pre
            .iter()
            .all(|i| matches!(i.kind, InstKind::ShardByStream { .. }))
        {
            return None;
        }
        match rest.get(1).map(|i| &i.kind) {
            Some(InstKind::Wait { comm }) if *comm == id => {}
            _ => return None,
        }
        let post = &rest[2..];
        let post_ok = post.iter().all(|i| {
            matches!(
                i.kind,
                InstKind::ShardByStream { .. }
                    | InstKind::Compute { .. }
                    | InstKind::CallKernel { .. }
            )
        });
        if !post_ok {
            return None;
        }
        // The transfer writes a chunk of a buffer cut into one chunk per iteration, a different
        // chunk every iteration (so the transfer ahead never overwrites the chunk computed on).
        let pre_views = views(pre);
        let (_, out_base, chunks, out_index) =
            pre_views.iter().find(|(v, ..)| *v == output).copied()?;
        if chunks != (stop - start) as u64 || !uses_var(out_index, *index) {
            return None;
        }
        // The compute reads the transferred buffers but never writes them.
        let all_views: Vec<_> = views(pre).into_iter().chain(views(post)).collect();
        let base = |t: HostTensorId| {
            all_views
                .iter()
                .find(|(v, ..)| *v == t)
                .map_or(t, |(_, b, ..)| *b)
        };
        let in_base = base(input);
        let post_writes_transfer = post.iter().any(|i| {
            i.kind
                .writes()
                .into_iter()
                .any(|w| base(w) == in_base || base(w) == out_base)
        });
        if post_writes_transfer {
            return None;
        }
        Some(Candidate {
            var: *index,
            start,
            stop,
            pre,
            comm,
            post,
            out_base,
        })
    }

    /// Whether the first transfer is a permute to this rank itself whose output the compute
    /// reads only through the transfer's output view (then that read can take the input).
    fn forwardable_first(
        &self,
        host: &HostProgram,
        the_loop: &Inst,
        refs: &HashMap<HostTensorId, usize>,
        simp: &mut Simplifier,
    ) -> Option<Forward> {
        let InstKind::CollectivePermute {
            team: Team::Slice { mesh, pt },
            send_peer,
            recv_peer,
            input,
            output,
            ..
        } = &self.comm.kind
        else {
            return None;
        };
        let me = Expr::MyIndex {
            mesh: *mesh,
            pt: *pt,
        };
        let first = Expr::c(self.start);
        let at_first = |e: &Expr| substitute(e, &Expr::var(self.var), &first);
        if !simp.prove_equal(&at_first(send_peer), &me)
            || !simp.prove_equal(&at_first(recv_peer), &me)
        {
            return None;
        }
        let (i, o) = (host.tensors.get(*input)?, host.tensors.get(*output)?);
        if i.shape != o.shape || i.dtype != o.dtype {
            return None;
        }
        // The only view of the gathered buffer is the transfer's output view, which the compute
        // only reads, and the compute names the buffer only through it.
        let cuts: Vec<_> = views(self.pre)
            .into_iter()
            .chain(views(self.post))
            .filter(|(_, base, ..)| *base == self.out_base)
            .map(|(v, ..)| v)
            .collect();
        let clean = cuts.iter().all(|v| v == output)
            && self.post.iter().all(|inst| match &inst.kind {
                InstKind::ShardByStream { out, .. } => *out != *output && *out != self.out_base,
                k => !k.writes().contains(output) && !k.tensors().contains(&self.out_base),
            });
        if !clean {
            return None;
        }
        let mut inside = HashMap::new();
        count_refs(std::slice::from_ref(the_loop), &mut inside);
        let named_outside = refs.get(&self.out_base).copied().unwrap_or(0)
            != inside.get(&self.out_base).copied().unwrap_or(0);
        let temporary = host
            .tensors
            .get(self.out_base)
            .is_some_and(|t| t.role == Role::Internal);
        Some(Forward {
            input: *input,
            output: *output,
            copy_is_dead: temporary && !named_outside,
        })
    }

    /// [`Self::emit`] with the first chunk computed from the first transfer's input (see the
    /// module docs); `ids` label the copy to itself and the first real transfer.
    fn emit_forwarded(
        &self,
        saved: StreamVar,
        ids: [CommId; 2],
        forward: Forward,
        out: &mut Vec<Inst>,
    ) {
        let at = |block: &[Inst], value: Expr| -> Vec<Inst> {
            block
                .iter()
                .map(|i| with_var(i, self.var, &value))
                .collect()
        };
        let (a, b) = (self.start, self.stop);
        out.push(Inst::new(InstKind::GetCurrentStream { dst: saved }));
        out.extend(on_worker(saved));
        // The first real transfer first: a copy to itself may be a kernel, which the GEMM
        // below would starve, and the transfer must not queue behind it.
        let [copy, transfer] = ids;
        let mut firsts = vec![(transfer, a + 1)];
        if !forward.copy_is_dead {
            firsts.push((copy, a));
        }
        for &(id, i) in &firsts {
            out.extend(at(self.pre, Expr::c(i)));
            let mut c = with_var(self.comm, self.var, &Expr::c(i));
            set_id(&mut c, id);
            out.push(c);
        }
        out.push(back_to(saved));
        out.extend(at(self.pre, Expr::c(a)));
        out.extend(at(self.post, Expr::c(a)).into_iter().map(|mut inst| {
            if let InstKind::Compute { inputs, .. } | InstKind::CallKernel { inputs, .. } =
                &mut inst.kind
            {
                for t in inputs.iter_mut().filter(|t| **t == forward.output) {
                    *t = forward.input;
                }
            }
            inst
        }));
        for &(id, _) in &firsts {
            out.push(Inst::new(InstKind::Wait { comm: id }));
        }
        if b - 1 > a + 1 {
            out.push(self.steady_loop(saved, a + 1));
        }
        out.extend(at(self.pre, Expr::c(b - 1)));
        out.extend(at(self.post, Expr::c(b - 1)));
        out.push(join_worker());
    }

    /// `for i in from..stop-1`: the transfer of chunk i + 1 on the worker under the compute of
    /// chunk i on the main stream (the worker first waits for the main stream up to the compute
    /// of chunk i - 1, as measured; without that wait the transfers could run further ahead,
    /// not measured yet).
    fn steady_loop(&self, saved: StreamVar, from: i64) -> Inst {
        let id = match &self.comm.kind {
            InstKind::CollectivePermute { id, .. } => *id,
            _ => CommId(0),
        };
        let next = Expr::var(self.var).add(Expr::c(1));
        let mut body = Vec::with_capacity(self.pre.len() * 2 + self.post.len() + 6);
        body.extend(on_worker(saved));
        body.extend(self.pre.iter().map(|i| with_var(i, self.var, &next)));
        body.push(with_var(self.comm, self.var, &next));
        body.push(back_to(saved));
        body.extend(self.pre.iter().cloned());
        body.extend(self.post.iter().cloned());
        body.push(Inst::new(InstKind::Wait { comm: id }));
        Inst::new(InstKind::ForLoop {
            index: self.var,
            start: Expr::c(from),
            stop: Expr::c(self.stop - 1),
            body,
        })
    }

    fn emit(&self, saved: StreamVar, first: CommId, out: &mut Vec<Inst>) {
        let at = |block: &[Inst], value: Expr| -> Vec<Inst> {
            block
                .iter()
                .map(|i| with_var(i, self.var, &value))
                .collect()
        };
        out.push(Inst::new(InstKind::GetCurrentStream { dst: saved }));
        // Prologue: the first chunk, after everything the main stream did before the loop
        // (which produced the transfer's input).
        out.extend(on_worker(saved));
        out.extend(at(self.pre, Expr::c(self.start)));
        let mut c0 = with_var(self.comm, self.var, &Expr::c(self.start));
        set_id(&mut c0, first);
        out.push(c0);
        out.push(back_to(saved));
        out.push(Inst::new(InstKind::Wait { comm: first }));
        out.push(self.steady_loop(saved, self.start));
        // Every transfer was waited for: the last chunk's compute, then the join with the
        // worker (see `join_worker`).
        out.extend(at(self.pre, Expr::c(self.stop - 1)));
        out.extend(at(self.post, Expr::c(self.stop - 1)));
        out.push(join_worker());
    }
}

/// The main stream joins worker 0 after the last chunk's compute, not before it: the waits
/// already order that compute after the transfer it reads, and a join in front of it would
/// also hold it behind this rank's own last send (on 2x H200, 12-20 µs per AG+GEMM at
/// 8192^3: `bench/results/2026-11-26-h200x2-schedule.json`, the forwarding ring, which joins
/// last, against the prefetched ring, which joined first).
fn join_worker() -> Inst {
    Inst::new(InstKind::Synchronize {
        stream: StreamRef::Worker(Expr::c(0)),
    })
}

/// Switches to worker 0 and orders it after the main stream (`saved`) so far.
fn on_worker(saved: StreamVar) -> [Inst; 2] {
    [
        Inst::new(InstKind::SetCurrentStream {
            stream: StreamRef::Worker(Expr::c(0)),
        }),
        Inst::new(InstKind::Synchronize {
            stream: StreamRef::Var(saved),
        }),
    ]
}

fn back_to(saved: StreamVar) -> Inst {
    Inst::new(InstKind::SetCurrentStream {
        stream: StreamRef::Var(saved),
    })
}

fn set_id(inst: &mut Inst, new: CommId) {
    if let InstKind::CollectivePermute { id, .. } = &mut inst.kind {
        *id = new;
    }
}

/// `inst` with the loop variable `var` replaced by `value` in its expressions.
fn with_var(inst: &Inst, var: LoopVar, value: &Expr) -> Inst {
    let atom = Expr::var(var);
    let sub = |e: &Expr| substitute(e, &atom, value);
    let mut out = inst.clone();
    for e in out.kind.exprs_mut() {
        *e = sub(e);
    }
    out
}
