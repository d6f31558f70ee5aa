//! Uneven splits (the chunk rule, level by level): which elements each device holds.

use meshflow_ir::program::{Layout, LayoutError, LoopDomain, Transform};
use meshflow_ir::ParallelType::{self, DIDx, DIDy};

fn layout(extent: u64, schedule: &[Transform]) -> Result<Layout, LayoutError> {
    let domain = LoopDomain::replay(&[(extent, false)], schedule).expect("replays");
    Layout::of(&domain, 1)
}

fn split(axis: usize, parts: u64, pt: ParallelType) -> [Transform; 2] {
    [
        Transform::OuterSplit { axis, parts },
        Transform::Parallelize { axis, pt },
    ]
}

/// The global rows each device `(y, x)` holds, in local order.
fn rows(l: &Layout, dy: u64, dx: u64) -> Vec<Vec<u64>> {
    let local = l.local_shape()[0];
    let mut out = Vec::new();
    for y in 0..dy {
        for x in 0..dx {
            let team = |pt: ParallelType| if pt == DIDy { y } else { x };
            out.push(
                (0..local)
                    .filter_map(|i| l.local_to_global(&[i], team).map(|g| g[0]))
                    .collect(),
            );
        }
    }
    out
}

fn sizes(l: &Layout, dy: u64, dx: u64) -> Vec<usize> {
    rows(l, dy, dx).iter().map(Vec::len).collect()
}

#[test]
fn one_level_follows_torch_chunk() {
    for (extent, want) in [
        (16, vec![4, 4, 4, 4]),
        (10, vec![3, 3, 3, 1]),
        (5, vec![2, 2, 1, 0]),
        (6, vec![2, 2, 2, 0]),
        (1, vec![1, 0, 0, 0]),
    ] {
        let l = layout(extent, &split(0, 4, DIDx)).unwrap();
        assert_eq!(l.axes[0].ragged, extent % 4 != 0);
        assert_eq!(sizes(&l, 1, 4), want, "{extent} rows");
        // Padded to the largest piece on every device.
        assert_eq!(l.local_shape(), vec![extent.div_ceil(4)]);
    }
}

#[test]
fn nested_levels_chunk_the_actual_extent() {
    // [Shard(0), Shard(0)] on (4, 2): DIDy outer, DIDx inner.
    let s: Vec<Transform> = split(0, 4, DIDy)
        .into_iter()
        .chain(split(1, 2, DIDx))
        .collect();
    let l = layout(18, &s).unwrap();
    assert_eq!(sizes(&l, 4, 2), vec![3, 2, 3, 2, 3, 2, 2, 1]);
    assert_eq!(rows(&l, 4, 2)[6], vec![15, 16]);
    assert_eq!(rows(&l, 4, 2)[7], vec![17]);
    let l = layout(13, &s).unwrap();
    assert_eq!(sizes(&l, 4, 2), vec![2, 2, 2, 2, 2, 2, 1, 0]);
    // Every row exactly once.
    let mut all: Vec<u64> = rows(&l, 4, 2).concat();
    all.sort_unstable();
    assert_eq!(all, (0..13).collect::<Vec<_>>());
}

#[test]
fn the_other_shard_order() {
    // FSDP2 + TP: DIDx outer, DIDy inner; 8 rows on [[0, 1], [2, 3]] as (dy, dx) = (2, 2).
    let s: Vec<Transform> = split(0, 2, DIDx)
        .into_iter()
        .chain(split(1, 2, DIDy))
        .collect();
    let l = layout(8, &s).unwrap();
    // Devices (y, x) in row-major order: rank0 rows 0-1, rank1 4-5, rank2 2-3, rank3 6-7.
    assert_eq!(
        rows(&l, 2, 2),
        vec![vec![0, 1], vec![4, 5], vec![2, 3], vec![6, 7]]
    );
}

#[test]
fn uneven_splits_must_form_a_chain() {
    // Splitting the outer piece again is no chain: refused, with the axis.
    let s = vec![
        Transform::OuterSplit { axis: 0, parts: 3 },
        Transform::OuterSplit { axis: 0, parts: 3 },
    ];
    let domain = LoopDomain::replay(&[(10, false)], &s).unwrap();
    assert!(matches!(
        Layout::of(&domain, 1),
        Err(LayoutError::RaggedNotChain { axis: 0 })
    ));
    // An inner split must divide.
    let e = LoopDomain::replay(
        &[(10, false)],
        &[Transform::InnerSplit { axis: 0, factor: 3 }],
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("only an outer_split may cut unevenly"),
        "{e}"
    );
}
