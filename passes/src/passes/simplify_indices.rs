//! `simplify_indices`: canonicalizes every scalar expression of the host program with egg
//! (see [`crate::index`]) and proves the equalities the lowering relies on.
//!
//! Facts: a loop index lies in `[start, stop)` of its loop, `my(m, pt)` in `[0, team size)`,
//! `rank` in `[0, world size)`. Every expression becomes its affine-mod canonical form
//! (`(c0 + c1*my + c2*i) % d`, coefficients reduced modulo `d`, constants folded, `% d`
//! dropped when the value is known to lie in `[0, d)`). For every collective permute over a
//! team slice, the pass proves that the send and receive peers are inverse permutations (the
//! member at team index `send(my)` receives from `my`), and fails if it cannot.

use meshflow_ir::host::{Block, Expr, InstKind, Team};
use meshflow_ir::HostProgram;

use crate::error::PassError;
use crate::index::{host_facts, loop_fact, Facts, Simplifier};
use crate::manager::HostPass;
use crate::options::PassContext;

/// The pass.
pub struct SimplifyIndices;

impl HostPass for SimplifyIndices {
    fn name(&self) -> &'static str {
        "simplify_indices"
    }

    fn run(&self, host: &mut HostProgram, _cx: &mut PassContext) -> Result<(), PassError> {
        let facts = host_facts(host);
        let mut body = std::mem::take(&mut host.body);
        let result = simplify_block(&mut body, &facts);
        host.body = body;
        result
    }
}

fn simplify_block(block: &mut Block, facts: &Facts) -> Result<(), PassError> {
    let mut simp = Simplifier::new(facts.clone());
    for inst in block.iter_mut() {
        let mut s = |e: &mut Expr| *e = simp.simplify(e);
        match &mut inst.kind {
            InstKind::ForLoop {
                index,
                start,
                stop,
                body,
            } => {
                s(start);
                s(stop);
                let mut inner = facts.clone();
                if let (Some(a), Some(b)) = (start.as_const(), stop.as_const()) {
                    if b > a {
                        loop_fact(&mut inner, *index, a, b);
                    }
                }
                simplify_block(body, &inner)?;
            }
            InstKind::CollectivePermute {
                id,
                team,
                send_peer,
                recv_peer,
                ..
            } => {
                s(send_peer);
                s(recv_peer);
                if let Team::Slice { mesh, pt } = team {
                    let my = Expr::my(*mesh, *pt);
                    if !simp.prove_peer_inverse(send_peer, recv_peer, &my) {
                        return Err(PassError::internal(
                            "simplify_indices",
                            format!(
                                "cannot prove that the send peer `{send_peer}` and the recv peer \
                                 `{recv_peer}` of {id} are inverse permutations"
                            ),
                        ));
                    }
                }
            }
            kind => kind.exprs_mut().into_iter().for_each(s),
        }
    }
    Ok(())
}
