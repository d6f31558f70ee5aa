//! Resharding detection, including swizzles and partial sums.

use meshflow_ir::{DType, DeviceMesh, MeshId, ParallelType::*, TensorType, Transform};
use meshflow_passes::analysis::Sharding;
use meshflow_passes::resharding::analyze;

fn sh(shape: &[u64], schedule: Vec<Transform>) -> Sharding {
    Sharding::from_parts(
        "t",
        &TensorType::new(DType::F32, shape),
        mesh_id(),
        &schedule,
    )
    .expect("valid schedule")
}

fn mesh_id() -> MeshId {
    <MeshId as meshflow_ir::EntityRef>::new(0)
}

fn split(axis: usize, parts: u64, pt: meshflow_ir::ParallelType) -> Vec<Transform> {
    vec![
        Transform::OuterSplit { axis, parts },
        Transform::Parallelize { axis, pt },
    ]
}

fn stream(axis: usize, chunks: u64, swizzle: Option<meshflow_ir::ParallelType>) -> Vec<Transform> {
    let mut t = vec![Transform::OuterSplit {
        axis,
        parts: chunks,
    }];
    if let Some(pt) = swizzle {
        t.push(Transform::Swizzle1d { axis, pt });
    }
    t.push(Transform::Parallelize { axis, pt: Stream });
    t
}

fn mesh(d: usize) -> DeviceMesh {
    DeviceMesh::iota(vec![d], 0).unwrap()
}

#[test]
fn same_stream_split_and_swizzle_is_not_resharding() {
    let p = sh(&[16, 4], stream(0, 4, Some(DIDx)));
    let c = sh(&[16, 4], stream(0, 4, Some(DIDx)));
    let r = analyze(&p, &mesh(4), &c, &mesh(4));
    assert!(!r.is_resharding(), "{r:?}");
}

#[test]
fn different_swizzle_on_the_same_stream_split_is_resharding_only_when_the_producer_holds_chunks() {
    // A producer with no device split holds every chunk: a differently swizzled consumer
    // visits chunks in another order but never needs remote data.
    let p = sh(&[16, 4], stream(0, 4, None));
    let c = sh(&[16, 4], stream(0, 4, Some(DIDx)));
    assert!(!analyze(&p, &mesh(4), &c, &mesh(4)).is_resharding());
}

#[test]
fn did_to_swizzled_stream_is_resharding_on_did_and_stream() {
    let p = sh(&[16, 4], split(0, 4, DIDx));
    let c = sh(&[16, 4], stream(0, 4, Some(DIDx)));
    let r = analyze(&p, &mesh(4), &c, &mesh(4));
    assert_eq!(r.device, vec![DIDx]);
    assert!(r.stream);
    assert!(!r.mesh_changed);
}

#[test]
fn did_to_plain_stream_is_resharding_on_did_and_stream() {
    let p = sh(&[16, 4], split(0, 4, DIDx));
    let c = sh(&[16, 4], stream(0, 4, None));
    let r = analyze(&p, &mesh(4), &c, &mesh(4));
    assert_eq!(r.device, vec![DIDx]);
    assert!(r.stream);
}

#[test]
fn stream_within_the_device_shard_is_not_resharding() {
    // Both split on DIDx; the consumer loops over chunks of its own shard.
    let p = sh(&[16, 4], split(0, 4, DIDx));
    let mut sched = split(0, 4, DIDx);
    sched.extend(stream(1, 2, None));
    let c = sh(&[16, 4], sched);
    let r = analyze(&p, &mesh(4), &c, &mesh(4));
    assert!(!r.is_resharding(), "{r:?}");
}

#[test]
fn same_device_split_is_not_resharding_and_other_axis_is() {
    let p = sh(&[16, 8], split(0, 4, DIDx));
    assert!(!analyze(&p, &mesh(4), &sh(&[16, 8], split(0, 4, DIDx)), &mesh(4)).is_resharding());
    let r = analyze(&p, &mesh(4), &sh(&[16, 8], split(1, 4, DIDx)), &mesh(4));
    assert_eq!(r.device, vec![DIDx]);
    assert!(!r.stream);
}

#[test]
fn partial_sums_to_full_values_is_resharding() {
    let mut ty = TensorType::new(DType::F32, &[4, 6]);
    ty.axes.push(meshflow_ir::Axis::reduce(8));
    let p = Sharding::from_parts("p", &ty, mesh_id(), &split(2, 4, DIDx)).unwrap();
    let c = sh(&[4, 6], vec![]);
    assert_eq!(analyze(&p, &mesh(4), &c, &mesh(4)).device, vec![DIDx]);
}

#[test]
fn a_change_of_mesh_is_resharding() {
    let other = DeviceMesh::iota(vec![4], 4).unwrap();
    let p = sh(&[16, 4], split(0, 4, DIDx));
    let mut c = sh(&[16, 4], split(0, 4, DIDx));
    c.mesh = <MeshId as meshflow_ir::EntityRef>::new(1);
    let r = analyze(&p, &mesh(4), &c, &other);
    assert!(r.mesh_changed);
    assert_eq!(r.device, vec![DIDx]);
}

#[test]
fn two_dimensional_mesh_types_are_checked_separately() {
    let m = DeviceMesh::iota(vec![2, 2], 0).unwrap();
    let mut both = split(0, 2, DIDy);
    both.extend(split(2, 2, DIDx));
    let p = sh(&[4, 4], both);
    let c = sh(&[4, 4], split(0, 2, DIDy));
    assert_eq!(analyze(&p, &m, &c, &m).device, vec![DIDx]);
}
