//! One test (at least) per row of the decision table: each builds a small program whose one
//! resharding is that row, lowers it (level-1 passes, lowering, index simplification) and
//! checks the communication, its team and root. Snapshots show the whole lowered program.

mod common;

use common::{builder, comms, count, insts, lower, lower_full};
use meshflow_ir::host::{CommKind, Expr, InstKind, Team};
use meshflow_ir::{verify_host, DType, DeviceMesh, ParallelType::*, Program, ProgramBuilder};

fn team_of(i: &meshflow_ir::Inst) -> Team {
    i.kind.team().cloned().expect("a communication")
}

fn root_of(i: &meshflow_ir::Inst) -> Option<Expr> {
    match &i.kind {
        InstKind::Communication { root, .. } => root.clone(),
        _ => None,
    }
}

/// `y = set(x)` with `x` scheduled by `px` and `y` by `py` on a 1-D mesh of `d`.
fn one_set(
    d: usize,
    shape: &[u64],
    px: impl FnOnce(&mut ProgramBuilder, meshflow_ir::TensorId),
    py: impl FnOnce(&mut ProgramBuilder, meshflow_ir::TensorId),
) -> Program {
    let (mut b, m) = builder("one_set", d);
    let x = b.input("x", DType::F32, shape, m).unwrap();
    px(&mut b, x);
    let y = b.set(x).unwrap();
    b.rename(y, "y").unwrap();
    py(&mut b, y);
    b.output(y);
    b.build().unwrap()
}

/// Two 1-D meshes `a` and `b` with the given devices; `x[8, 4]` on `a`, `y = set(x)` on `b`.
fn two_meshes(
    a: &[usize],
    bdev: &[usize],
    px: impl FnOnce(&mut ProgramBuilder, meshflow_ir::TensorId),
    py: impl FnOnce(&mut ProgramBuilder, meshflow_ir::TensorId),
) -> Program {
    let mut b = ProgramBuilder::new("two_meshes");
    let ma = b
        .mesh("a", DeviceMesh::new(vec![a.len()], a.to_vec()).unwrap())
        .unwrap();
    let mb = b
        .mesh(
            "b",
            DeviceMesh::new(vec![bdev.len()], bdev.to_vec()).unwrap(),
        )
        .unwrap();
    let x = b.input("x", DType::F32, &[8, 4], ma).unwrap();
    px(&mut b, x);
    let y = b.set(x).unwrap();
    b.rename(y, "y").unwrap();
    b.place(y, mb);
    py(&mut b, y);
    b.output(y);
    b.build().unwrap()
}

fn split2(b: &mut ProgramBuilder, t: meshflow_ir::TensorId) {
    b.schedule(t).outer_split(0, 2).parallelize(0, DIDx);
}

fn comm_names(host: &meshflow_ir::HostProgram) -> Vec<&'static str> {
    insts(host)
        .iter()
        .filter(|(i, _)| i.kind.is_communication())
        .map(|(i, _)| i.kind.name())
        .collect()
}

#[test]
fn sharded_to_replicated_same_mesh_is_all_gather() {
    let p = one_set(
        4,
        &[8, 4],
        |b, x| {
            b.schedule(x).outer_split(0, 4).parallelize(0, DIDx);
        },
        |b, y| b.replicate(y),
    );
    let host = lower(&p);
    let ag = comms(&host, CommKind::AllGather);
    assert_eq!(ag.len(), 1);
    assert!(matches!(team_of(&ag[0].0), Team::Slice { pt: DIDx, .. }));
    assert_eq!(count(&host, "permute"), 0);
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn all_gather_of_an_inner_axis_is_staged_through_permutes() {
    let p = one_set(
        4,
        &[8, 4],
        |b, x| {
            b.schedule(x).outer_split(1, 4).parallelize(1, DIDx);
        },
        |b, y| b.replicate(y),
    );
    let host = lower(&p);
    assert_eq!(comms(&host, CommKind::AllGather).len(), 1);
    assert_eq!(count(&host, "permute"), 2, "{host}");
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn sharded_to_replicated_other_mesh_is_one_gather_per_receiver() {
    // The receivers are devices of the sender mesh: each one roots a gather over it.
    let p = two_meshes(
        &[0, 1, 2, 3],
        &[1, 3],
        |b, x| {
            b.schedule(x).outer_split(0, 4).parallelize(0, DIDx);
        },
        |b, y| b.replicate(y),
    );
    let host = lower(&p);
    let g = comms(&host, CommKind::Gather);
    assert_eq!(g.len(), 2);
    assert!(matches!(team_of(&g[0].0), Team::Mesh(_)));
    assert_eq!(root_of(&g[0].0), Some(Expr::c(1)));
    assert_eq!(root_of(&g[1].0), Some(Expr::c(3)));
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn sharded_to_replicated_on_a_disjoint_mesh_gathers_then_transfers() {
    let p = two_meshes(&[0, 1], &[2, 3], split2, |b, y| b.replicate(y));
    let host = lower_full(&p);
    assert_eq!(comm_names(&host), vec!["all_gather", "broadcast"]);
    verify_host(&host).unwrap();
}
#[test]
fn replicated_to_sharded_same_mesh_is_a_local_slice() {
    let p = one_set(
        4,
        &[8, 4],
        |b, x| b.replicate(x),
        |b, y| {
            b.schedule(y).outer_split(0, 4).parallelize(0, DIDx);
        },
    );
    let host = lower(&p);
    assert!(insts(&host).iter().all(|(i, _)| !i.kind.is_communication()));
    let text = host.to_string();
    assert!(
        text.contains("x_slice = shard_by_stream(x, axis=0, chunks=4, index=my(m0, DIDx))"),
        "{text}"
    );
    assert!(text.contains("copy(x_slice -> y)"), "{text}");
}

#[test]
fn replicated_to_sharded_other_mesh_is_scatter() {
    // Device 1 holds x and is the first member of b: it roots the scatter over b.
    let p = two_meshes(&[0, 1], &[1, 2], |b, x| b.replicate(x), split2);
    let host = lower(&p);
    let s = comms(&host, CommKind::Scatter);
    assert_eq!(s.len(), 1);
    assert!(matches!(team_of(&s[0].0), Team::Mesh(_)));
    assert_eq!(root_of(&s[0].0), Some(Expr::c(0)));
}

#[test]
fn replicated_to_sharded_on_a_disjoint_mesh_transfers_then_slices() {
    let p = two_meshes(&[0], &[1, 2], |b, x| b.replicate(x), split2);
    let host = lower_full(&p);
    assert_eq!(comm_names(&host), vec!["broadcast"]);
    assert!(host
        .to_string()
        .contains("shard_by_stream(y_step, axis=0, chunks=2, index=my(b, DIDx))"));
    verify_host(&host).unwrap();
}
#[test]
fn sharded_on_another_axis_is_all_to_all() {
    let p = one_set(
        2,
        &[4, 6],
        |b, x| {
            b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
        },
        |b, y| {
            b.schedule(y).outer_split(1, 2).parallelize(1, DIDx);
        },
    );
    let host = lower(&p);
    assert_eq!(comms(&host, CommKind::AllToAll).len(), 1);
    assert!(
        count(&host, "permute") >= 1,
        "exchanged axis 1 is not outermost"
    );
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn same_split_other_mesh_is_send_recv_per_pair() {
    let p = two_meshes(&[0, 1], &[2, 3], split2, split2);
    let host = lower(&p);
    let sr = comms(&host, CommKind::SendRecv);
    assert_eq!(sr.len(), 2);
    assert_eq!(team_of(&sr[0].0), Team::Devices(vec![0, 2]));
    assert_eq!(team_of(&sr[1].0), Team::Devices(vec![1, 3]));
    assert_eq!(root_of(&sr[0].0), Some(Expr::c(0)));
}

#[test]
fn replicated_other_mesh_is_broadcast() {
    let p = two_meshes(&[0], &[1, 2], |b, x| b.replicate(x), |b, y| b.replicate(y));
    let host = lower(&p);
    let bc = comms(&host, CommKind::Broadcast);
    assert_eq!(bc.len(), 1);
    assert_eq!(team_of(&bc[0].0), Team::Devices(vec![1, 2, 0]));
    assert_eq!(root_of(&bc[0].0), Some(Expr::c(2)));
}

fn did_to_stream(swizzle: bool) -> Program {
    one_set(
        4,
        &[8, 4],
        |b, x| {
            b.schedule(x).outer_split(0, 4).parallelize(0, DIDx);
        },
        |b, y| {
            let s = b.schedule(y).outer_split(0, 4);
            let s = if swizzle { s.swizzle1d(0, DIDx) } else { s };
            s.parallelize(0, Stream);
        },
    )
}

#[test]
fn did_to_swizzled_stream_is_a_collective_permute_ring() {
    let host = lower(&did_to_stream(true));
    let cps: Vec<_> = insts(&host)
        .into_iter()
        .filter(|(i, _)| matches!(i.kind, InstKind::CollectivePermute { .. }))
        .collect();
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].1, 1);
    let text = host.to_string();
    assert!(
        text.contains(
            "team=slice(m0, DIDx), send=(my(m0, DIDx) - i0) % 4, recv=(i0 + my(m0, DIDx)) % 4"
        ),
        "{text}"
    );
    insta::assert_snapshot!(text);
}

#[test]
fn did_to_stream_without_swizzle_is_a_stream_broadcast() {
    let host = lower(&did_to_stream(false));
    let bc = comms(&host, CommKind::Broadcast);
    assert_eq!(bc.len(), 1);
    assert_eq!(bc[0].1, 1);
    assert_eq!(root_of(&bc[0].0), Some(Expr::var(meshflow_ir::LoopVar(0))));
}

/// `p = linear(x, w)` with K split (partial sums) on devices [0, 1], then `y = set(p)`
/// scheduled by `py`, on `y_mesh` (default: the same mesh).
fn partial(
    py: impl FnOnce(&mut ProgramBuilder, meshflow_ir::TensorId),
    y_mesh: Option<&[usize]>,
) -> Program {
    let mut b = ProgramBuilder::new("partial");
    let m = b.mesh("m0", DeviceMesh::iota(vec![2], 0).unwrap()).unwrap();
    let x = b.input("x", DType::F32, &[4, 8], m).unwrap();
    let w = b.input("w", DType::F32, &[6, 8], m).unwrap();
    b.schedule(x).outer_split(1, 2).parallelize(1, DIDx);
    b.schedule(w).outer_split(1, 2).parallelize(1, DIDx);
    let p = b.linear(x, w).unwrap();
    b.rename(p, "p").unwrap();
    let y = b.set(p).unwrap();
    b.rename(y, "y").unwrap();
    if let Some(devs) = y_mesh {
        let m1 = b
            .mesh(
                "m1",
                DeviceMesh::new(vec![devs.len()], devs.to_vec()).unwrap(),
            )
            .unwrap();
        b.place(y, m1);
    }
    py(&mut b, y);
    b.output(y);
    b.build().unwrap()
}

#[test]
fn partial_sums_to_replicated_is_all_reduce() {
    let host = lower(&partial(|b, y| b.replicate(y), None));
    let ar = comms(&host, CommKind::AllReduce);
    assert_eq!(ar.len(), 1);
    assert!(matches!(team_of(&ar[0].0), Team::Slice { pt: DIDx, .. }));
}

#[test]
fn partial_sums_to_another_mesh_is_one_reduce_per_receiver() {
    let host = lower(&partial(|b, y| b.replicate(y), Some(&[1])));
    let r = comms(&host, CommKind::Reduce);
    assert_eq!(r.len(), 1);
    assert!(matches!(team_of(&r[0].0), Team::Mesh(_)));
    assert_eq!(root_of(&r[0].0), Some(Expr::c(1)));
}

#[test]
fn partial_sums_to_a_disjoint_mesh_reduce_then_transfer() {
    let host = lower_full(&partial(|b, y| b.replicate(y), Some(&[2, 3])));
    assert_eq!(comm_names(&host), vec!["all_reduce", "broadcast"]);
    verify_host(&host).unwrap();
}

#[test]
fn partial_sums_to_sharded_is_reduce_scatter() {
    let host = lower(&partial(
        |b, y| {
            b.schedule(y).outer_split(0, 2).parallelize(0, DIDx);
        },
        None,
    ));
    assert_eq!(comms(&host, CommKind::ReduceScatter).len(), 1);
    assert_eq!(comms(&host, CommKind::AllReduce).len(), 0);
}

#[test]
fn reduction_inside_a_stream_loop_is_per_chunk() {
    // x[B, M, K] with K on DIDx and B in 3 stream chunks; the result is split on M.
    let (mut b, m) = builder("chunked", 2);
    let x = b.input("x", DType::F32, &[3, 4, 8], m).unwrap();
    let w = b.input("w", DType::F32, &[6, 8], m).unwrap();
    b.schedule(x)
        .outer_split(0, 3)
        .parallelize(0, Stream)
        .outer_split(3, 2)
        .parallelize(3, DIDx);
    b.schedule(w).outer_split(1, 2).parallelize(1, DIDx);
    let p = b.linear(x, w).unwrap();
    b.rename(p, "p").unwrap();
    let y = b.set(p).unwrap();
    b.rename(y, "y").unwrap();
    b.schedule(y)
        .outer_split(0, 3)
        .parallelize(0, Stream)
        .outer_split(2, 2)
        .parallelize(2, DIDx);
    b.output(y);
    let host = lower(&b.build().unwrap());
    let rs = comms(&host, CommKind::ReduceScatter);
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].1, 1, "per-chunk reduce_scatter in the loop");
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn two_dimensional_mesh_teams_are_slices() {
    let mut b = ProgramBuilder::new("mesh2d");
    let m = b
        .mesh("m", DeviceMesh::iota(vec![2, 3], 0).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[4, 6], m).unwrap();
    b.schedule(x).outer_split(0, 2).parallelize(0, DIDy);
    let y = b.set(x).unwrap();
    b.rename(y, "y").unwrap();
    b.replicate(y);
    b.output(y);
    let host = lower(&b.build().unwrap());
    let ag = comms(&host, CommKind::AllGather);
    assert_eq!(ag.len(), 1);
    assert!(matches!(team_of(&ag[0].0), Team::Slice { pt: DIDy, .. }));
}

#[test]
fn a_change_on_two_parallel_types_is_two_steps() {
    let mut b = ProgramBuilder::new("two_steps");
    let m = b
        .mesh("m", DeviceMesh::iota(vec![2, 2], 0).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[4, 6], m).unwrap();
    b.schedule(x)
        .outer_split(0, 2)
        .parallelize(0, DIDy)
        .outer_split(2, 2)
        .parallelize(2, DIDx);
    let y = b.set(x).unwrap();
    b.rename(y, "y").unwrap();
    b.replicate(y);
    b.output(y);
    let p = b.build().unwrap();
    let host = lower_full(&p);
    let ag = comms(&host, CommKind::AllGather);
    assert_eq!(ag.len(), 2);
    let pts: Vec<Team> = ag.iter().map(|(i, _)| team_of(i)).collect();
    assert!(matches!(pts[0], Team::Slice { pt: DIDx, .. }));
    assert!(matches!(pts[1], Team::Slice { pt: DIDy, .. }));
    verify_host(&host).unwrap();
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn swapping_the_axes_of_two_parallel_types_goes_through_a_valid_intermediate() {
    // x: rows on DIDy, columns on DIDx; y: rows on DIDx, columns on DIDy. As DTensor plans
    // `[S0, S1] -> [S1, S0]`: gather the columns over DIDx, move the DIDy split from the rows
    // to the columns (all-to-all), then slice the rows over DIDx.
    let mut b = ProgramBuilder::new("swap");
    let m = b
        .mesh("m", DeviceMesh::iota(vec![2, 2], 0).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[4, 4], m).unwrap();
    b.schedule(x)
        .outer_split(0, 2)
        .parallelize(0, DIDy)
        .outer_split(2, 2)
        .parallelize(2, DIDx);
    let y = b.set(x).unwrap();
    b.rename(y, "y").unwrap();
    b.schedule(y)
        .outer_split(0, 2)
        .parallelize(0, DIDx)
        .outer_split(2, 2)
        .parallelize(2, DIDy);
    b.output(y);
    let host = lower_full(&b.build().unwrap());
    verify_host(&host).unwrap();
    let kinds: Vec<&str> = insts(&host)
        .iter()
        .filter(|(i, _)| i.kind.is_communication())
        .map(|(i, _)| i.kind.name())
        .collect();
    assert_eq!(
        kinds,
        vec!["all_gather", "all_to_all"],
        "then a local slice"
    );
}
