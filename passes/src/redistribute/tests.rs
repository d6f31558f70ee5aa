use std::collections::BTreeMap;

use meshflow_ir::ParallelType;
use ParallelType::{DIDx as X, DIDy as Y, DIDz as Z};

use super::*;

fn pl(chains: &[&[ParallelType]], partial: &[ParallelType]) -> Placements {
    Placements {
        chains: chains
            .iter()
            .map(|c| c.iter().map(|&pt| Cut::Device(pt)).collect())
            .collect(),
        partial: partial.iter().copied().collect(),
    }
}

fn sizes(pts: &[(ParallelType, u64)]) -> BTreeMap<ParallelType, u64> {
    pts.iter().copied().collect()
}

/// Communications of a plan: (gathers, all-to-alls, reduces, reduce-scatters), one per step
/// that moves data (a merged step is one communication).
fn comms(from: &Placements, steps: &[Placements], to: &Placements) -> (u32, u32, u32, u32) {
    let mut all = vec![from.clone()];
    all.extend(steps.iter().cloned());
    all.push(to.clone());
    let mut c = (0, 0, 0, 0);
    let splits = |p: &Placements| -> usize {
        p.chains
            .iter()
            .flatten()
            .filter(|c| c.device().is_some())
            .count()
    };
    for w in all.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let (na, nb) = (splits(a), splits(b));
        if a.partial.len() > b.partial.len() {
            if nb > na {
                c.3 += 1;
            } else {
                c.2 += 1;
            }
        } else if na > nb {
            c.0 += 1;
        } else if na == nb {
            c.1 += 1;
        }
    }
    c
}

fn run_on(
    from: Placements,
    to: Placements,
    s: &[(ParallelType, u64)],
    extents: &[u64],
) -> (u32, u32, u32, u32) {
    let steps = plan(&from, &to, extents, &sizes(s), &|_| true, true).expect("reachable");
    comms(&from, &steps, &to)
}

fn run(from: Placements, to: Placements, s: &[(ParallelType, u64)]) -> (u32, u32, u32, u32) {
    run_on(from, to, s, &[16, 16, 16])
}

#[test]
fn dtensor_traces_on_a_2d_mesh() {
    let s2 = [(Y, 4), (X, 2)];
    // [S0, S0] -> [S0, R]: one all-gather over the inner mesh axis.
    assert_eq!(
        run(pl(&[&[Y, X], &[]], &[]), pl(&[&[Y], &[]], &[]), &s2),
        (1, 0, 0, 0)
    );
    // [S0, S1] -> [S1, S0]: all-gather, all-to-all, slice.
    assert_eq!(
        run(pl(&[&[Y], &[X]], &[]), pl(&[&[X], &[Y]], &[]), &s2),
        (1, 1, 0, 0)
    );
    // [R, S0] -> [S0, S0]: all-gather, then two slices.
    assert_eq!(
        run(pl(&[&[X], &[]], &[]), pl(&[&[Y, X], &[]], &[]), &s2),
        (1, 0, 0, 0)
    );
    // [P, S0] -> [S0, S0]: all-gather, reduce-scatter, slice.
    assert_eq!(
        run(pl(&[&[X], &[]], &[Y]), pl(&[&[Y, X], &[]], &[]), &s2),
        (1, 0, 0, 1)
    );
    // [P, S0] -> [P, S1]: one all-to-all, the partial sums untouched.
    assert_eq!(
        run(pl(&[&[X], &[]], &[Y]), pl(&[&[], &[X]], &[Y]), &s2),
        (0, 1, 0, 0)
    );
    // [S0, P] -> [R, R]: DTensor's all-reduce and all-gather (different kinds never merge).
    assert_eq!(
        run(pl(&[&[Y], &[]], &[X]), pl(&[&[], &[]], &[]), &s2),
        (1, 0, 1, 0)
    );
}

#[test]
fn merged_collectives_over_flattened_teams() {
    let s2 = [(Y, 4), (X, 2)];
    // [S0, S0] -> [R, R]: one all-gather over the flattened mesh.
    assert_eq!(
        run(pl(&[&[Y, X], &[]], &[]), pl(&[&[], &[]], &[]), &s2),
        (1, 0, 0, 0)
    );
    // [P, P] -> [R, R]: one all-reduce; [P, P] -> [S0, S0]: one reduce-scatter.
    assert_eq!(
        run(pl(&[&[], &[]], &[X, Y]), pl(&[&[], &[]], &[]), &s2),
        (0, 0, 1, 0)
    );
    assert_eq!(
        run(pl(&[&[], &[]], &[X, Y]), pl(&[&[Y, X], &[]], &[]), &s2),
        (0, 0, 0, 1)
    );
    // Uneven: 4 rows over (2, 3) are cut differently by one reduce-scatter over 6 devices
    // (1, 1, 1, 1, 0, 0) than by two nested ones (1, 1, 0, 1, 1, 0): two reduce-scatters,
    // as DTensor's uneven flattened test.
    assert_eq!(
        run_on(
            pl(&[&[], &[]], &[X, Y]),
            pl(&[&[Y, X], &[]], &[]),
            &[(Y, 2), (X, 3)],
            &[4, 4]
        ),
        (0, 0, 0, 2)
    );
    // [S1, S0] chain order (DIDx outer): the flattened team's order is not the chain's.
    assert_eq!(
        run(pl(&[&[X, Y], &[]], &[]), pl(&[&[], &[]], &[]), &s2),
        (2, 0, 0, 0)
    );
    // [S0, S1] -> [R, R]: two axes, two all-gathers.
    assert_eq!(
        run(pl(&[&[Y], &[X]], &[]), pl(&[&[], &[]], &[]), &s2),
        (2, 0, 0, 0)
    );
}

#[test]
fn shard_orders_on_a_3d_mesh() {
    let s3 = [(Z, 2), (Y, 2), (X, 2)];
    // Order (0, 1, 2) -> (1, 2): everything gathered at once, then sliced again.
    assert_eq!(
        run(
            pl(&[&[Z, Y, X], &[], &[]], &[]),
            pl(&[&[Y, X], &[], &[]], &[]),
            &s3
        ),
        (1, 0, 0, 0)
    );
    // Order (1, 0, 2) -> (1, 2): DIDz and DIDx gathered over their flattened team.
    assert_eq!(
        run(
            pl(&[&[Y, Z, X], &[], &[]], &[]),
            pl(&[&[Y, X], &[], &[]], &[]),
            &s3
        ),
        (1, 0, 0, 0)
    );
    // [P, R, P] -> [R, R, R]: one all-reduce over DIDz and DIDx.
    assert_eq!(
        run(
            pl(&[&[], &[], &[]], &[Z, X]),
            pl(&[&[], &[], &[]], &[]),
            &s3
        ),
        (0, 0, 1, 0)
    );
}

#[test]
fn strided_chains_go_through_their_prefixes() {
    let s2 = [(Y, 2), (X, 2)];
    let strided = |chains: Vec<Vec<Cut>>| Placements {
        chains,
        partial: Default::default(),
    };
    use Cut::{Device as D, Serial as S};
    // [S(serial 3, DIDx)] -> R: one all-gather; back: a local slice.
    let ss = strided(vec![vec![S(3), D(X)], vec![]]);
    let r = Placements::replicated(2);
    assert_eq!(run_on(ss.clone(), r.clone(), &s2, &[12, 4]), (1, 0, 0, 0));
    assert_eq!(run_on(r, ss, &s2, &[12, 4]), (0, 0, 0, 0));
    // [S(DIDy, serial 3, DIDx), R] from [S(DIDy), S(DIDx)]: the DIDx split is gathered
    // from axis 1 and added inside the serial pieces of axis 0.
    let from = pl(&[&[Y], &[X]], &[]);
    let to = strided(vec![vec![D(Y), S(3), D(X)], vec![]]);
    let steps = plan(&from, &to, &[24, 4], &sizes(&s2), &|_| true, true).expect("reachable");
    assert_eq!(comms(&from, &steps, &to), (1, 0, 0, 0));
    assert_eq!(steps.len(), 1);
    // Strided source: gathered from the inside out.
    let from = strided(vec![vec![S(2), D(Y), S(3), D(X)], vec![]]);
    let steps = plan(
        &from,
        &Placements::replicated(2),
        &[24, 4],
        &sizes(&s2),
        &|_| true,
        true,
    )
    .expect("reachable");
    assert_eq!(steps, vec![strided(vec![vec![S(2), D(Y)], vec![]])]);
}

#[test]
fn partial_targets_need_partial_sources() {
    let s2 = [(Y, 2), (X, 2)];
    let none = plan(
        &pl(&[&[Y], &[]], &[]),
        &pl(&[&[], &[]], &[X]),
        &[8, 8],
        &sizes(&s2),
        &|_| true,
        true,
    );
    assert!(none.is_none());
    let same = plan(
        &pl(&[&[], &[]], &[X]),
        &pl(&[&[], &[]], &[X]),
        &[8, 8],
        &sizes(&s2),
        &|_| true,
        true,
    );
    assert_eq!(same, Some(Vec::new()));
}
