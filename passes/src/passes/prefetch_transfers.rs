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
//! synchronize worker(0)
//! pre(b-1); post(b-1)
//! ```
//!
//! Other loops are left to `assign_streams` (which skips loops that already place their work on
//! streams). With the default [`StreamSchedule::PerIteration`] the pass does nothing.

use meshflow_ir::host::{CommId, Expr, HostTensorId, Inst, InstKind, LoopVar, StreamRef};
use meshflow_ir::HostProgram;

use crate::error::PassError;
use crate::index::substitute;
use crate::manager::{HostPass, PassContext, StreamSchedule};

/// The pass.
pub struct PrefetchTransfers;

impl HostPass for PrefetchTransfers {
    fn name(&self) -> &'static str {
        "prefetch_transfers"
    }

    fn run(&self, host: &mut HostProgram, cx: &mut PassContext) -> Result<(), PassError> {
        if cx.stream_schedule != StreamSchedule::Prefetch {
            return Ok(());
        }
        let mut next_stream = host.fresh_stream_var().0;
        let mut next_comm = host.fresh_comm_id().0;
        let body = std::mem::take(&mut host.body);
        let mut out = Vec::with_capacity(body.len());
        for inst in body {
            let Some(shape) = Candidate::of(&inst) else {
                out.push(inst);
                continue;
            };
            let saved = meshflow_ir::host::StreamVar(next_stream);
            next_stream += 1;
            let first = CommId(next_comm);
            next_comm += 1;
            shape.emit(saved, first, &mut out);
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
                    | InstKind::LaunchKernel { .. }
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
        })
    }

    fn emit(&self, saved: meshflow_ir::host::StreamVar, first: CommId, out: &mut Vec<Inst>) {
        let at = |block: &[Inst], value: Expr| -> Vec<Inst> {
            block
                .iter()
                .map(|i| with_var(i, self.var, &value))
                .collect()
        };
        let on_worker = [
            Inst::new(InstKind::SetCurrentStream {
                stream: StreamRef::Worker(Expr::c(0)),
            }),
            Inst::new(InstKind::Synchronize {
                stream: StreamRef::Var(saved),
            }),
        ];
        let back = Inst::new(InstKind::SetCurrentStream {
            stream: StreamRef::Var(saved),
        });
        let id = match &self.comm.kind {
            InstKind::CollectivePermute { id, .. } => *id,
            _ => first,
        };
        out.push(Inst::new(InstKind::GetCurrentStream { dst: saved }));
        // Prologue: the first chunk, after everything the main stream did before the loop
        // (which produced the transfer's input).
        out.extend(on_worker.iter().cloned());
        out.extend(at(self.pre, Expr::c(self.start)));
        let mut c0 = with_var(self.comm, self.var, &Expr::c(self.start));
        set_id(&mut c0, first);
        out.push(c0);
        out.push(back.clone());
        out.push(Inst::new(InstKind::Wait { comm: first }));
        // The loop: the transfer of chunk i + 1 under the compute of chunk i (the worker waits
        // for the main stream up to the compute of chunk i - 1, as measured; without that wait
        // the transfers could run further ahead, not measured yet).
        let next = Expr::var(self.var).add(Expr::c(1));
        let mut body = Vec::with_capacity(self.pre.len() * 2 + self.post.len() + 6);
        body.extend(on_worker.iter().cloned());
        body.extend(at(self.pre, next.clone()));
        body.push(with_var(self.comm, self.var, &next));
        body.push(back.clone());
        body.extend(self.pre.iter().cloned());
        body.extend(self.post.iter().cloned());
        body.push(Inst::new(InstKind::Wait { comm: id }));
        out.push(Inst::new(InstKind::ForLoop {
            index: self.var,
            start: Expr::c(self.start),
            stop: Expr::c(self.stop - 1),
            body,
        }));
        // The worker is done (every transfer was waited for); the last chunk's compute.
        out.push(Inst::new(InstKind::Synchronize {
            stream: StreamRef::Worker(Expr::c(0)),
        }));
        out.extend(at(self.pre, Expr::c(self.stop - 1)));
        out.extend(at(self.post, Expr::c(self.stop - 1)));
    }
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
    match &mut out.kind {
        InstKind::ShardByStream { index, .. } => *index = sub(index),
        InstKind::CollectivePermute {
            send_peer,
            recv_peer,
            ..
        } => {
            *send_peer = sub(send_peer);
            *recv_peer = sub(recv_peer);
        }
        InstKind::LaunchKernel { args, .. } => {
            for a in args.iter_mut() {
                *a = sub(a);
            }
        }
        _ => {}
    }
    out
}
