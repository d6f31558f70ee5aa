//! `assign_streams`: runs the iterations of stream loops on a bounded pool of worker streams.
//!
//! Around each top-level `for` loop whose body holds both communication and compute (the only
//! loops where overlap pays; nested loops, and loops whose body already sets streams, are left
//! alone):
//!
//! ```text
//! s0 = get_current_stream
//! for i in 0..n {
//!   set_current_stream worker(i % num_streams)   // worker(i) when n <= num_streams
//!   synchronize s0
//!   ...
//! }
//! set_current_stream s0
//! for j in 0..min(num_streams, n) { synchronize worker(j) }
//! ```

use meshflow_ir::host::{Expr, Inst, InstKind, LoopVar, StreamRef, StreamVar};
use meshflow_ir::HostProgram;

use crate::error::PassError;
use crate::host_util::any_deep;
use crate::manager::HostPass;
use crate::options::PassContext;

/// The pass.
pub struct AssignStreams;

impl HostPass for AssignStreams {
    fn name(&self) -> &'static str {
        "assign_streams"
    }

    fn run(&self, host: &mut HostProgram, cx: &mut PassContext) -> Result<(), PassError> {
        if cx.options.num_streams == 0 {
            return Err(PassError::Options(
                "the stream pool needs at least 1 stream".into(),
            ));
        }
        let pool = cx.options.num_streams as i64;
        let mut next_stream = host.fresh_stream_var().0;
        let mut next_loop = host.fresh_loop_var().0;
        let body = std::mem::take(&mut host.body);
        let mut out = Vec::with_capacity(body.len());
        for inst in body {
            let InstKind::ForLoop {
                index,
                start,
                stop,
                body,
            } = inst.kind
            else {
                out.push(inst);
                continue;
            };
            let trips = match (start.as_const(), stop.as_const()) {
                (Some(a), Some(b)) => Some(b - a),
                _ => None,
            };
            // Loops that already place their work on streams (`prefetch_transfers`) stay as
            // they are.
            let placed = any_deep(&body, &|k| matches!(k, InstKind::SetCurrentStream { .. }));
            let worth = !placed
                && any_deep(&body, &|k| k.is_communication())
                && any_deep(&body, &|k| {
                    matches!(k, InstKind::Compute { .. } | InstKind::CallKernel { .. })
                });
            let (Some(trips), true) = (trips, worth) else {
                out.push(Inst::new(InstKind::ForLoop {
                    index,
                    start,
                    stop,
                    body,
                }));
                continue;
            };
            let saved = StreamVar(next_stream);
            next_stream += 1;
            let worker = if pool == 1 {
                Expr::c(0)
            } else if trips <= pool && start.as_const() == Some(0) {
                Expr::var(index)
            } else {
                Expr::var(index).rem(Expr::c(pool))
            };
            let mut new_body = Vec::with_capacity(body.len() + 2);
            new_body.push(Inst::new(InstKind::SetCurrentStream {
                stream: StreamRef::Worker(worker),
            }));
            new_body.push(Inst::new(InstKind::Synchronize {
                stream: StreamRef::Var(saved),
            }));
            new_body.extend(body);
            out.push(Inst::new(InstKind::GetCurrentStream { dst: saved }));
            out.push(Inst::new(InstKind::ForLoop {
                index,
                start,
                stop,
                body: new_body,
            }));
            out.push(Inst::new(InstKind::SetCurrentStream {
                stream: StreamRef::Var(saved),
            }));
            let join = LoopVar(next_loop);
            next_loop += 1;
            out.push(Inst::new(InstKind::ForLoop {
                index: join,
                start: Expr::c(0),
                stop: Expr::c(pool.min(trips.max(0))),
                body: vec![Inst::new(InstKind::Synchronize {
                    stream: StreamRef::Worker(Expr::var(join)),
                })],
            }));
        }
        host.body = out;
        Ok(())
    }
}
