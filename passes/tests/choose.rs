//! `choose_decompositions`: the cost model decides for unannotated consumers, user
//! annotations win, overrides force a variant, and every decision is explained.

mod common;

use meshflow_ir::host::{CommKind, InstKind};
use meshflow_ir::{DType, ParallelType::*, Program};
use meshflow_passes::{Decomposition, PassError, PassOptions, PassOutput};

/// `y = linear(x, w)`: x sequence-parallel (M split), w column-parallel; nothing else
/// annotated, so x must be gathered before the GEMM.
fn column_parallel(d: u64, m: u64, k: u64, n: u64) -> Program {
    let (mut b, mesh) = common::builder("cp", d as usize);
    let x = b.input("x", DType::BF16, &[m, k], mesh).unwrap();
    let w = b.input("w", DType::BF16, &[n, k], mesh).unwrap();
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, d).parallelize(0, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    b.build().unwrap()
}

fn run(
    p: &Program,
    forced: &[(&str, Decomposition)],
) -> Result<(meshflow_ir::HostProgram, PassOutput), PassError> {
    let mut options = PassOptions::default();
    for (t, d) in forced {
        options.decompositions.insert(t.to_string(), *d);
    }
    let out = common::all_passes().run(p.clone(), &options)?;
    Ok((out.host.clone(), out))
}

fn has_permute(h: &meshflow_ir::HostProgram) -> bool {
    common::insts(h)
        .iter()
        .any(|(i, _)| matches!(i.kind, InstKind::CollectivePermute { .. }))
}

#[test]
fn small_gathers_stay_collective() {
    let (host, cx) = run(&column_parallel(4, 64, 32, 48), &[]).unwrap();
    assert_eq!(common::comms(&host, CommKind::AllGather).len(), 1);
    let r = &cx.explain[0];
    assert_eq!(r.tensor, "x_gathered");
    assert_eq!(r.chosen, "collective(s=1, nccl)", "{r}");
    // Six plans (collective, broadcast, ring per iteration and prefetched, forward and
    // bidirectional rings) over each of the profile's two transports, all priced.
    assert_eq!(r.variants.len(), 12, "{r}");
    assert!(r.variants.iter().all(|v| v.cost_us.is_some()));
    assert_eq!(cx.transport, Some(meshflow_passes::Transport::Nccl));
}

#[test]
fn large_gathers_feeding_a_gemm_become_a_ring() {
    let (host, cx) = run(&column_parallel(4, 16384, 8192, 8192), &[]).unwrap();
    assert!(has_permute(&host), "{host}");
    assert!(common::comms(&host, CommKind::AllGather).is_empty());
    let r = &cx.explain[0];
    assert!(r.chosen.starts_with("ring"), "{r}");
    // The consumer joined the loop: the GEMM is inside it.
    assert!(common::insts(&host)
        .iter()
        .any(|(i, d)| *d == 1 && i.kind.name() == "linear"));
    meshflow_ir::verify_host(&host).unwrap();
}

#[test]
fn overrides_force_a_variant() {
    let p = column_parallel(4, 64, 32, 48);
    let (host, cx) = run(&p, &[("x_gathered", Decomposition::StreamBroadcast)]).unwrap();
    assert_eq!(common::comms(&host, CommKind::Broadcast).len(), 1);
    assert!(
        cx.explain[0].reason.starts_with("forced by the options"),
        "{}",
        cx.explain[0]
    );
    for d in [
        Decomposition::Ring,
        Decomposition::RingForward,
        Decomposition::RingBidirectional,
    ] {
        let (host, cx) = run(&p, &[("x_gathered", d)]).unwrap();
        assert!(has_permute(&host), "{d:?}\n{host}");
        assert!(
            cx.explain[0].chosen.starts_with(d.name()),
            "{}",
            cx.explain[0]
        );
    }
    // A reduce-scatter ring is no decomposition of an all-gather.
    let e = run(&p, &[("x_gathered", Decomposition::StreamReduce)]).unwrap_err();
    assert!(
        e.to_string().contains("cannot be decomposed as `reduce`"),
        "{e}"
    );
}

#[test]
fn overrides_of_unknown_or_annotated_tensors_are_errors() {
    let p = column_parallel(4, 64, 32, 48);
    let e = run(&p, &[("nope", Decomposition::Ring)]).unwrap_err();
    assert!(
        e.to_string().contains("`nope`") && e.to_string().contains("x_gathered"),
        "{e}"
    );
    // An annotated consumer: the user's choice wins and cannot be overridden.
    let (mut b, mesh) = common::builder("cp", 4);
    let x = b.input("x", DType::F32, &[16, 4], mesh).unwrap();
    b.schedule(x).outer_split(0, 4).parallelize(0, DIDx);
    let ag = b.set(x).unwrap();
    b.rename(ag, "ag").unwrap();
    b.replicate(ag);
    b.output(ag);
    let p = b.build().unwrap();
    let e = run(&p, &[("ag", Decomposition::Ring)]).unwrap_err();
    assert!(e.to_string().contains("annotated by the user"), "{e}");
    let (host, cx) = run(&p, &[]).unwrap();
    assert_eq!(common::comms(&host, CommKind::AllGather).len(), 1);
    assert_eq!(cx.explain[0].reason, "annotated by the user");
}

#[test]
fn copy_engine_transport_changes_the_estimates() {
    let p = column_parallel(4, 4096, 4096, 4096);
    let nccl = run(&p, &[]).unwrap().1.explain[0].clone();
    let mut options = PassOptions::default();
    options.cost_model.transport = Some(meshflow_passes::Transport::CopyEngine);
    let cx = common::all_passes().run(p.clone(), &options).unwrap();
    let ce = cx.explain[0].clone();
    assert_ne!(nccl.variants, ce.variants);
    assert!(
        ce.variants
            .iter()
            .all(|v| v.variant.ends_with("copy_engine)")),
        "{ce}"
    );
    assert_eq!(cx.transport, Some(meshflow_passes::Transport::CopyEngine));
}
