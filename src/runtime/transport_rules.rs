//! The transport selection rules of the GPU backend: which transport object carries each
//! communication of a program, decided once per team and label when the program is prepared
//! (by `src/runtime/cuda/transport/mod.rs`). All rules live here, so adding a transport means
//! its file under `src/runtime/cuda/transport/` and one rule below. The rules are plain
//! functions of the program and the team's facts, built and tested without the `cuda` feature.
//!
//! | communication | team | carrier |
//! |---|---|---|
//! | MoE dispatch/combine | GPUs that reach each other's memory | MoE over NVLink |
//! | MoE dispatch/combine | otherwise (other nodes included, through the proxy) | MoE over NCCL |
//! | collective permute | a member on another node | host proxy (NCCL for this node's peers) |
//! | permute, broadcast, sum reduce-scatter of floats, outside a coalescing group, steps not recorded as CUDA graphs | GPUs that reach each other's memory | copy engine |
//! | anything else | | NCCL |
//!
//! GPUs *reach each other's memory* when every pair has peer access and the ranks are threads
//! of one process (meeting in the launch's hub), or processes of one host that share memory
//! over CUDA IPC (each member checked it could map every other's memory, and all agreed at the
//! rendezvous). A forced transport (`CudaConfig::transport`) takes the communications it can
//! carry and is an error for a team that cannot use it; forcing NCCL keeps everything on NCCL
//! but the host proxy, which only the split into nodes selects.
//!
//! The facts a rule reads are the same on every member of a team (the program, the forced
//! transport, and the peer-access decision the members take together once per team), so the
//! members agree.

use meshflow_ir::{CommKind, ReduceOp};
use meshflow_passes::Transport;

use crate::runtime::backend::CommOp;

/// The transport object that carries a communication (one file each under
/// `src/runtime/cuda/transport/`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Carrier {
    /// Collectives and permutes over NCCL (`nccl.rs`).
    Nccl,
    /// Permutes, broadcasts and reduce-scatters over the copy engine (`copy_engine.rs`).
    CopyEngine,
    /// Permutes with peers on other nodes through the host proxy (`proxy.rs`).
    HostProxy,
    /// MoE dispatch and combine over NCCL (`moe_nccl.rs`).
    MoeNccl,
    /// MoE dispatch and combine over the NVLink kernels (`moe_nvlink.rs`).
    MoeNvlink,
}

impl Carrier {
    /// The transport this object implements.
    pub fn transport(self) -> Transport {
        match self {
            Carrier::Nccl | Carrier::MoeNccl => Transport::Nccl,
            Carrier::CopyEngine => Transport::CopyEngine,
            Carrier::HostProxy => Transport::HostProxy,
            Carrier::MoeNvlink => Transport::Nvlink,
        }
    }
}

/// What the rules know about a team.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct TeamFacts {
    /// Its number of members.
    pub size: usize,
    /// Every pair of the members' GPUs reaches each other's memory: threads of this process
    /// with peer access, or processes of this host over CUDA IPC.
    pub peer_access: bool,
    /// Some member is on another node than this rank.
    pub crosses_nodes: bool,
}

/// What a program asks of its transports besides moving bytes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Wants {
    /// The transport to force, where it can carry a communication.
    pub forced: Option<Transport>,
    /// Steps are recorded as CUDA graphs: transports that need the host during a step (the
    /// copy engine) are not selected unless forced. MoE over NVLink keeps its step number on
    /// the device and replays.
    pub graph: bool,
}

/// The carrier of a communication `op` of a team with `facts` (`grouped`: posted inside a
/// coalescing group), given what the program wants; `Err` says why a forced transport cannot
/// be used.
pub(crate) fn select(
    op: &CommOp,
    grouped: bool,
    facts: &TeamFacts,
    wants: Wants,
) -> Result<Carrier, String> {
    let forced = wants.forced;
    if forced == Some(Transport::HostProxy) {
        return Err(
            "the host proxy cannot be forced: it carries the traffic between nodes, \
                    which the split into nodes selects"
                .into(),
        );
    }
    let multi = facts.size > 1;
    let why_not = || {
        if facts.crosses_nodes {
            "its members span several nodes".to_string()
        } else {
            "its GPUs do not all reach each other's memory".to_string()
        }
    };
    // Peers that reach each other's memory can use `t`, unless graphs are recorded, `t`
    // needs the host during a step, and `t` was not asked for (graph replays need transports
    // without host work during a step).
    let peers_for = |t: Transport| {
        let replays = t != Transport::CopyEngine;
        multi
            && facts.peer_access
            && !facts.crosses_nodes
            && (!wants.graph || replays || forced == Some(t))
    };
    match op {
        CommOp::MoeDispatch | CommOp::MoeCombine => match forced {
            Some(Transport::Nccl) => Ok(Carrier::MoeNccl),
            _ if peers_for(Transport::Nvlink) => Ok(Carrier::MoeNvlink),
            Some(Transport::Nvlink) if multi => Err(format!(
                "MoE over NVLink needs the team's GPUs to reach each other's memory (peer access \
                 in one process, or CUDA IPC between processes of one host): {}",
                why_not()
            )),
            _ => Ok(Carrier::MoeNccl),
        },
        CommOp::Permute if facts.crosses_nodes => Ok(Carrier::HostProxy),
        CommOp::Permute
        | CommOp::Collective {
            kind: CommKind::Broadcast,
            ..
        } => copy_engine_or_nccl(
            grouped,
            multi,
            peers_for(Transport::CopyEngine),
            forced,
            &why_not,
        ),
        CommOp::Collective {
            kind: CommKind::ReduceScatter,
            op: ReduceOp::Sum,
            dtype,
        } if dtype.is_float() => copy_engine_or_nccl(
            grouped,
            multi,
            peers_for(Transport::CopyEngine),
            forced,
            &why_not,
        ),
        CommOp::Collective { .. } | CommOp::Group => Ok(Carrier::Nccl),
    }
}

/// The copy engine for a communication it can carry, where the team allows it (`usable`) or
/// it is forced, else NCCL.
fn copy_engine_or_nccl(
    grouped: bool,
    multi: bool,
    usable: bool,
    forced: Option<Transport>,
    why_not: &dyn Fn() -> String,
) -> Result<Carrier, String> {
    // A coalescing group is issued as one NCCL group; a team of one moves nothing.
    if grouped || !multi || forced == Some(Transport::Nccl) {
        return Ok(Carrier::Nccl);
    }
    if usable {
        return Ok(Carrier::CopyEngine);
    }
    if forced == Some(Transport::CopyEngine) {
        return Err(format!(
            "the copy-engine transport needs every rank of the team to reach the others' GPU \
             memory (peer access in one process, or CUDA IPC between processes of one host): {}",
            why_not()
        ));
    }
    Ok(Carrier::Nccl)
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow_ir::DType;

    const PERMUTE: CommOp = CommOp::Permute;

    fn facts(peer_access: bool, crosses_nodes: bool) -> TeamFacts {
        TeamFacts {
            size: 2,
            peer_access,
            crosses_nodes,
        }
    }

    fn auto() -> Wants {
        Wants::default()
    }

    fn force(t: Option<Transport>) -> Wants {
        Wants {
            forced: t,
            graph: false,
        }
    }

    fn collective(kind: CommKind, op: ReduceOp, dtype: DType) -> CommOp {
        CommOp::Collective { kind, op, dtype }
    }

    #[test]
    fn peers_of_one_process_use_the_copy_engine_and_nvlink() {
        let f = facts(true, false);
        assert_eq!(select(&PERMUTE, false, &f, auto()), Ok(Carrier::CopyEngine));
        let bc = collective(CommKind::Broadcast, ReduceOp::Sum, DType::I32);
        assert_eq!(select(&bc, false, &f, auto()), Ok(Carrier::CopyEngine));
        let rs = collective(CommKind::ReduceScatter, ReduceOp::Sum, DType::BF16);
        assert_eq!(select(&rs, false, &f, auto()), Ok(Carrier::CopyEngine));
        assert_eq!(
            select(&CommOp::MoeDispatch, false, &f, auto()),
            Ok(Carrier::MoeNvlink)
        );
        assert_eq!(
            select(&CommOp::MoeCombine, false, &f, auto()),
            Ok(Carrier::MoeNvlink)
        );
        // What the copy engine does not carry stays on NCCL.
        let ag = collective(CommKind::AllGather, ReduceOp::Sum, DType::F32);
        assert_eq!(select(&ag, false, &f, auto()), Ok(Carrier::Nccl));
        let max = collective(CommKind::ReduceScatter, ReduceOp::Max, DType::F32);
        assert_eq!(select(&max, false, &f, auto()), Ok(Carrier::Nccl));
        let ints = collective(CommKind::ReduceScatter, ReduceOp::Sum, DType::I32);
        assert_eq!(select(&ints, false, &f, auto()), Ok(Carrier::Nccl));
        // Coalescing groups are NCCL groups; a team of one moves nothing.
        assert_eq!(select(&PERMUTE, true, &f, auto()), Ok(Carrier::Nccl));
        let one = TeamFacts { size: 1, ..f };
        assert_eq!(select(&PERMUTE, false, &one, auto()), Ok(Carrier::Nccl));
        assert_eq!(
            select(&CommOp::MoeDispatch, false, &one, auto()),
            Ok(Carrier::MoeNccl)
        );
    }

    #[test]
    fn other_nodes_go_through_the_proxy_and_the_rest_through_nccl() {
        let f = facts(false, true);
        assert_eq!(select(&PERMUTE, false, &f, auto()), Ok(Carrier::HostProxy));
        assert_eq!(select(&PERMUTE, true, &f, auto()), Ok(Carrier::HostProxy));
        assert_eq!(
            select(&CommOp::MoeDispatch, false, &f, auto()),
            Ok(Carrier::MoeNccl)
        );
        let ar = collective(CommKind::AllReduce, ReduceOp::Sum, DType::F32);
        assert_eq!(select(&ar, false, &f, auto()), Ok(Carrier::Nccl));
        let apart = facts(false, false);
        assert_eq!(select(&PERMUTE, false, &apart, auto()), Ok(Carrier::Nccl));
        assert_eq!(
            select(&CommOp::MoeCombine, false, &apart, auto()),
            Ok(Carrier::MoeNccl)
        );
    }

    #[test]
    fn a_forced_transport_wins_or_says_why_it_cannot() {
        let here = facts(true, false);
        let nccl = Some(Transport::Nccl);
        assert_eq!(
            select(&PERMUTE, false, &here, force(nccl)),
            Ok(Carrier::Nccl)
        );
        assert_eq!(
            select(&CommOp::MoeDispatch, false, &here, force(nccl)),
            Ok(Carrier::MoeNccl)
        );
        // Forcing NCCL keeps the proxy between nodes.
        let far = facts(false, true);
        assert_eq!(
            select(&PERMUTE, false, &far, force(nccl)),
            Ok(Carrier::HostProxy)
        );
        let apart = facts(false, false);
        let ce = Some(Transport::CopyEngine);
        let e = select(&PERMUTE, false, &apart, force(ce)).unwrap_err();
        assert!(e.contains("copy-engine transport needs"), "{e}");
        assert_eq!(
            select(&CommOp::MoeDispatch, false, &here, force(ce)),
            Ok(Carrier::MoeNvlink)
        );
        let nv = Some(Transport::Nvlink);
        let e = select(&CommOp::MoeDispatch, false, &far, force(nv)).unwrap_err();
        assert!(e.contains("span several nodes"), "{e}");
        assert_eq!(
            select(&PERMUTE, false, &here, force(nv)),
            Ok(Carrier::CopyEngine)
        );
        let e = select(&PERMUTE, false, &here, force(Some(Transport::HostProxy))).unwrap_err();
        assert!(e.contains("cannot be forced"), "{e}");
    }

    #[test]
    fn recording_graphs_keeps_the_automatic_choice_on_transports_that_replay() {
        let here = facts(true, false);
        let graph = Wants {
            forced: None,
            graph: true,
        };
        // The copy engine needs the host during a step; MoE over NVLink replays.
        assert_eq!(select(&PERMUTE, false, &here, graph), Ok(Carrier::Nccl));
        assert_eq!(
            select(&CommOp::MoeDispatch, false, &here, graph),
            Ok(Carrier::MoeNvlink)
        );
        assert_eq!(
            select(&CommOp::MoeCombine, false, &facts(false, false), graph),
            Ok(Carrier::MoeNccl)
        );
        // A forced transport stays forced (the backend then refuses to record, saying why);
        // what it does not carry keeps to transports that replay.
        let forced = Wants {
            forced: Some(Transport::CopyEngine),
            graph: true,
        };
        assert_eq!(
            select(&PERMUTE, false, &here, forced),
            Ok(Carrier::CopyEngine)
        );
        assert_eq!(
            select(&CommOp::MoeCombine, false, &here, forced),
            Ok(Carrier::MoeNvlink)
        );
        let nccl = Wants {
            forced: Some(Transport::Nccl),
            graph: true,
        };
        assert_eq!(
            select(&CommOp::MoeCombine, false, &here, nccl),
            Ok(Carrier::MoeNccl)
        );
    }
}
