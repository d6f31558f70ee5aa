//! Scatter/gather round trips by level-1 layouts: 1-D and 2-D meshes, cyclic (inner) splits,
//! stream splits with and without swizzle, replicas, and partial sums (rejected).

use std::collections::BTreeMap;

use meshflow::ir::{parse_program, DType, EntityRef, Program, TensorId};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::shard::{ShardError, Sharding};

fn program(decls: &str) -> Program {
    let text = format!("program p {{\n{decls}\n}}\n");
    parse_program(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn iota_data(shape: &[u64]) -> TensorData {
    let n: u64 = shape.iter().product();
    TensorData::from_f32(
        DType::F32,
        shape,
        &(0..n).map(|i| i as f32).collect::<Vec<_>>(),
    )
    .unwrap()
}

fn round_trip(p: &Program, t: TensorId) -> BTreeMap<usize, TensorData> {
    let sharding = Sharding::of(p, t).unwrap();
    let full = iota_data(sharding.full_shape());
    let locals = sharding.scatter(&full).unwrap();
    assert_eq!(locals.len(), sharding.devices().len());
    for l in locals.values() {
        assert_eq!(l.shape(), sharding.local_shape().as_slice());
    }
    let back = sharding.gather(&locals).unwrap();
    assert!(back.bit_eq(&full), "round trip of `{}`", p.tensors[t].name);
    locals
}

fn first() -> TensorId {
    TensorId::new(0)
}

#[test]
fn one_dimensional_mesh_outer_split() {
    let p = program(
        "  mesh m = [0, 1, 2]\n  input x: f32[6, 2] on m {outer_split(0, 3), parallelize(0, DIDx)}",
    );
    let locals = round_trip(&p, first());
    assert_eq!(locals[&1].storage().to_f32_vec(), vec![4., 5., 6., 7.]);
}

#[test]
fn two_dimensional_mesh_splits_both_axes() {
    let p = program(
        "  mesh m = [[0, 1], [2, 3]]\n  input x: f32[4, 6] on m {outer_split(0, 2), parallelize(0, DIDy), outer_split(2, 2), parallelize(2, DIDx)}",
    );
    let locals = round_trip(&p, first());
    // Device 3 = row 1 (DIDy), column 1 (DIDx): rows 2..4, columns 3..6.
    assert_eq!(locals[&3].shape(), &[2, 3]);
    assert_eq!(
        locals[&3].storage().to_f32_vec(),
        vec![15., 16., 17., 21., 22., 23.]
    );
}

#[test]
fn inner_split_is_cyclic() {
    let p = program(
        "  mesh m = [0, 1]\n  input x: f32[8] on m {inner_split(0, 2), parallelize(1, DIDx)}",
    );
    let locals = round_trip(&p, first());
    assert_eq!(locals[&1].storage().to_f32_vec(), vec![1., 3., 5., 7.]);
}

#[test]
fn stream_splits_keep_placement_with_and_without_swizzle() {
    for sched in [
        "{outer_split(0, 4), swizzle1d(0, DIDx), parallelize(0, Stream)}",
        "{outer_split(0, 4), parallelize(0, Stream)}",
    ] {
        let p = program(&format!(
            "  mesh m = [0, 1, 2, 3]\n  input x: f32[8, 2] on m {sched}"
        ));
        let locals = round_trip(&p, first());
        for l in locals.values() {
            assert_eq!(
                l.shape(),
                &[8, 2],
                "{sched}: a stream split does not change placement"
            );
        }
    }
    // A stream split inside a device shard.
    let p = program(
        "  mesh m = [0, 1]\n  input x: f32[6, 4] on m {outer_split(1, 2), parallelize(1, DIDx), outer_split(0, 3), parallelize(0, Stream)}",
    );
    let locals = round_trip(&p, first());
    assert_eq!(locals[&1].shape(), &[6, 2]);
    assert_eq!(locals[&1].storage().to_f32_vec()[..4], [2., 3., 6., 7.]);
}

#[test]
fn replicas_must_agree_bit_for_bit() {
    let p = program("  mesh m = [[0, 1], [2, 3]]\n  input x: f32[4] on m {outer_split(0, 2), parallelize(0, DIDx)}");
    let locals = round_trip(&p, first());
    assert!(
        locals[&0].bit_eq(&locals[&2]),
        "devices 0 and 2 hold the same chunk"
    );
    let sharding = Sharding::of(&p, first()).unwrap();
    let mut bad = locals.clone();
    bad.insert(
        2,
        TensorData::from_f32(DType::F32, &[2], &[0., -1.]).unwrap(),
    );
    let err = sharding.gather(&bad).unwrap_err();
    assert_eq!(
        err,
        ShardError::ReplicaMismatch {
            tensor: "x".into(),
            first: 0,
            second: 2,
            index: vec![1]
        }
    );
    let mut missing = locals;
    missing.remove(&3);
    assert!(matches!(
        sharding.gather(&missing),
        Err(ShardError::MissingDevice { device: 3, .. })
    ));
}

#[test]
fn split_reduction_axes_are_rejected() {
    let p = program(
        "  mesh m = [0, 1]\n  input a: f32[4, 8] on m\n  input b: f32[8, 4] on m\n  tensor y: f32[4, 4, r8] on m {outer_split(2, 2), parallelize(2, DIDx)}\n  y = matmul(a, b)\n  output y",
    );
    let y = p.tensor_by_name("y").unwrap();
    let sharding = Sharding::of(&p, y).unwrap();
    let err = sharding.gather(&BTreeMap::new()).unwrap_err();
    assert!(
        matches!(err, ShardError::PartialSums { axis: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("partial sums"));
    // Not split on the reduction axis: the value drops it.
    let p = program(
        "  mesh m = [0, 1]\n  input a: f32[4, 8] on m\n  input b: f32[8, 4] on m\n  tensor y: f32[4, 4, r8] on m {outer_split(1, 2), parallelize(1, DIDx)}\n  y = matmul(a, b)\n  output y",
    );
    let y = p.tensor_by_name("y").unwrap();
    assert_eq!(Sharding::of(&p, y).unwrap().local_shape(), vec![4, 2]);
    round_trip(&p, y);
}

#[test]
fn a_split_that_does_not_match_the_mesh_is_an_error() {
    let p = program(
        "  mesh m = [0, 1, 2]\n  input x: f32[4] on m {outer_split(0, 2), parallelize(0, DIDx)}",
    );
    assert!(matches!(
        Sharding::of(&p, first()),
        Err(ShardError::MeshMismatch { parts: 2, .. })
    ));
}

#[test]
fn uneven_shards_are_padded_with_zeros() {
    // 5 rows over 4 devices: 2, 2, 1, 0 rows, every local tensor padded to 2 rows.
    let p = program(
        "  mesh m = [0, 1, 2, 3]\n  input x: f32[5, 1] on m {outer_split(0, 4), parallelize(0, DIDx)}",
    );
    let locals = round_trip(&p, first());
    let rows: Vec<Vec<f32>> = (0..4).map(|d| locals[&d].storage().to_f32_vec()).collect();
    assert_eq!(
        rows,
        vec![vec![0., 1.], vec![2., 3.], vec![4., 0.], vec![0., 0.]]
    );
    // Nested: 18 rows on a (4, 2) mesh, [DIDy, DIDx]: pieces 3, 2, 3, 2, 3, 2, 2, 1.
    let p = program(
        "  mesh m = iota(4, 2)\n  input x: f32[18] on m {outer_split(0, 4), parallelize(0, DIDy), outer_split(1, 2), parallelize(1, DIDx)}",
    );
    let locals = round_trip(&p, first());
    assert_eq!(locals[&6].storage().to_f32_vec(), vec![15., 16., 0.]);
    assert_eq!(locals[&7].storage().to_f32_vec(), vec![17., 0., 0.]);
}
