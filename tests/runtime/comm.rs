//! Every communication kind on 1, 2, 3, 4 and 8 CPU ranks against expected buffers, rings of
//! collective permutes, and coalescing groups.

use crate::support::runtime as common;

use std::collections::BTreeMap;

use common::*;
use meshflow::ir::{DType, HostProgram};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::{run_cpu, RunInputs};

const RANKS: [usize; 5] = [1, 2, 3, 4, 8];

/// Rank `r`'s input: element `i` is `100 r + i`.
fn input(r: usize, dtype: DType, shape: &[u64]) -> TensorData {
    let n: u64 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| (100 * r as u64 + i) as f32).collect();
    TensorData::from_f32(dtype, shape, &v).unwrap()
}

/// Options for programs whose output some ranks leave unwritten by design (the non-roots of
/// rooted collectives, the sender of a `send_recv`): those outputs are not checked, so the
/// CPU backend's "output never written" check is switched off with the poisoning that drives it.
fn options_rooted() -> meshflow::runtime::CpuOptions {
    let mut o = options();
    o.config.poison = false;
    o
}

fn vals(r: usize, n: u64) -> Vec<f32> {
    (0..n).map(|i| (100 * r as u64 + i) as f32).collect()
}

/// One communication `kind(a -> b, team=slice(m0, DIDx) extra)` on `d` ranks; returns every
/// rank's `b`.
fn run_one(
    d: usize,
    dtype: DType,
    kind: &str,
    in_shape: &[u64],
    out_shape: &[u64],
    extra: &str,
) -> Vec<Vec<f32>> {
    let shape = |s: &[u64]| s.iter().map(u64::to_string).collect::<Vec<_>>().join(", ");
    let text = format!(
        "host one {{\n  mesh m0 = {mesh}\n  in a: {dtype}[{i}] on m0\n  out b: {dtype}[{o}] on m0\n  c0 = {kind}(a -> b, team=slice(m0, DIDx){extra})\n  wait c0\n}}\n",
        mesh = iota(d as i64),
        i = shape(in_shape),
        o = shape(out_shape),
    );
    let host = meshflow::ir::parse_host(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let inputs = (0..d)
        .map(|r| {
            (
                r,
                BTreeMap::from([("a".to_string(), input(r, dtype, in_shape))]),
            )
        })
        .collect();
    let out = run_cpu(&host, RunInputs::PerRank(inputs), &options_rooted())
        .unwrap_or_else(|e| panic!("{kind} on {d}: {e}"));
    (0..d)
        .map(|r| out.outputs[&r]["b"].storage().to_f32_vec())
        .collect()
}

#[test]
fn all_gather() {
    for d in RANKS {
        for dtype in [DType::F32, DType::BF16] {
            let got = run_one(d, dtype, "all_gather", &[2, 3], &[2 * d as u64, 3], "");
            let exact: Vec<f32> = (0..d).flat_map(|j| vals(j, 6)).collect();
            // Expected values rounded to the element type once, like the inputs.
            let want = TensorData::from_f32(dtype, &[exact.len() as u64], &exact)
                .unwrap()
                .storage()
                .to_f32_vec();
            for g in got {
                assert_eq!(g, want, "d={d} {dtype}");
            }
        }
    }
}

#[test]
fn reduce_scatter_sums_in_team_order() {
    for d in RANKS {
        let got = run_one(
            d,
            DType::F32,
            "reduce_scatter",
            &[2 * d as u64, 3],
            &[2, 3],
            ", op=sum",
        );
        for (j, g) in got.iter().enumerate() {
            let want: Vec<f32> = (0..6)
                .map(|i| (0..d).map(|r| vals(r, 6 * d as u64)[j * 6 + i]).sum())
                .collect();
            assert_eq!(*g, want, "d={d} member {j}");
        }
    }
}

#[test]
fn all_reduce_sum_max_min_and_integers() {
    for d in RANKS {
        for (op, f) in [
            ("sum", (|v: &[f32]| v.iter().sum()) as fn(&[f32]) -> f32),
            ("max", |v: &[f32]| {
                v.iter().copied().fold(f32::MIN, f32::max)
            }),
            ("min", |v: &[f32]| {
                v.iter().copied().fold(f32::MAX, f32::min)
            }),
        ] {
            for dtype in [DType::F32, DType::I32] {
                let got = run_one(d, dtype, "all_reduce", &[5], &[5], &format!(", op={op}"));
                let want: Vec<f32> = (0..5)
                    .map(|i| f(&(0..d).map(|r| vals(r, 5)[i]).collect::<Vec<_>>()))
                    .collect();
                for g in got {
                    assert_eq!(g, want, "d={d} {op} {dtype}");
                }
            }
        }
    }
}

#[test]
fn broadcast_gather_scatter_reduce() {
    for d in RANKS {
        let root = d - 1;
        for g in run_one(
            d,
            DType::F32,
            "broadcast",
            &[4],
            &[4],
            &format!(", root={root}"),
        ) {
            assert_eq!(g, vals(root, 4), "broadcast d={d}");
        }
        let got = run_one(d, DType::F32, "gather", &[2], &[2 * d as u64], ", root=0");
        assert_eq!(
            got[0],
            (0..d).flat_map(|j| vals(j, 2)).collect::<Vec<_>>(),
            "gather d={d}"
        );
        let got = run_one(
            d,
            DType::F32,
            "scatter",
            &[2 * d as u64],
            &[2],
            &format!(", root={root}"),
        );
        for (j, g) in got.iter().enumerate() {
            assert_eq!(
                *g,
                vals(root, 2 * d as u64)[2 * j..2 * j + 2],
                "scatter d={d}"
            );
        }
        let got = run_one(
            d,
            DType::F32,
            "reduce",
            &[3],
            &[3],
            &format!(", root={root}, op=sum"),
        );
        let want: Vec<f32> = (0..3)
            .map(|i| (0..d).map(|r| vals(r, 3)[i]).sum())
            .collect();
        assert_eq!(got[root], want, "reduce d={d}");
    }
}

#[test]
fn all_to_all() {
    for d in RANKS {
        let n = 2 * d as u64;
        let got = run_one(d, DType::F32, "all_to_all", &[n, 2], &[n, 2], "");
        for (j, g) in got.iter().enumerate() {
            // Member j's chunk k comes from member k's chunk j.
            let want: Vec<f32> = (0..d)
                .flat_map(|k| vals(k, 2 * n)[j * 4..j * 4 + 4].to_vec())
                .collect();
            assert_eq!(*g, want, "d={d} member {j}");
        }
    }
}

/// Collectives over flattened teams (several mesh axes at once) on `iota(2, 2, 2)`: every
/// team is the row-major sub-mesh through the rank, and the program passes the cross-rank check.
#[test]
fn collectives_over_flattened_teams() {
    let cases: [(&str, &[usize; 3]); 3] = [
        ("DIDy, DIDx", &[0, 1, 1]),
        ("DIDz, DIDx", &[1, 0, 1]),
        ("DIDz, DIDy, DIDx", &[1, 1, 1]),
    ];
    for (pts, over) in cases {
        let d: usize = over.iter().filter(|&&o| o == 1).count();
        let size = 1usize << d;
        let text = format!(
            "host flat {{\n  mesh m0 = iota(2, 2, 2)\n  in a: f32[2, 3] on m0\n  out g: f32[{n}, 3] on m0\n  out s: f32[2, 3] on m0\n  c0 = all_gather(a -> g, team=flattened(m0, {pts}))\n  c1 = all_reduce(a -> s, team=flattened(m0, {pts}), op=sum)\n  wait c0\n  wait c1\n}}\n",
            n = 2 * size
        );
        let host = meshflow::ir::parse_host(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        meshflow::check::check_program(&host, 8).unwrap_or_else(|e| panic!("{pts}: {e}"));
        let inputs = (0..8)
            .map(|r| {
                (
                    r,
                    BTreeMap::from([("a".to_string(), input(r, DType::F32, &[2, 3]))]),
                )
            })
            .collect();
        let out = run_cpu(&host, RunInputs::PerRank(inputs), &options())
            .unwrap_or_else(|e| panic!("{pts}: {e}"));
        // Rank r = 4z + 2y + x; its team varies the coordinates marked in `over`.
        for r in 0..8usize {
            let c = [r / 4, (r / 2) % 2, r % 2];
            let mut members = Vec::new();
            for f in 0..size {
                let mut m = c;
                let mut rest = f;
                for k in (0..3).rev().filter(|&k| over[k] == 1) {
                    m[k] = rest % 2;
                    rest /= 2;
                }
                members.push(4 * m[0] + 2 * m[1] + m[2]);
            }
            let gathered: Vec<f32> = members.iter().flat_map(|&j| vals(j, 6)).collect();
            assert_eq!(
                out.outputs[&r]["g"].storage().to_f32_vec(),
                gathered,
                "{pts} rank {r}"
            );
            let summed: Vec<f32> = (0..6)
                .map(|i| members.iter().map(|&j| vals(j, 6)[i]).sum())
                .collect();
            assert_eq!(
                out.outputs[&r]["s"].storage().to_f32_vec(),
                summed,
                "{pts} rank {r}"
            );
        }
    }
}

#[test]
fn send_recv_between_two_devices_of_a_larger_mesh() {
    for d in [2usize, 3, 4, 8] {
        let last = d - 1;
        let text = format!(
            "host sr {{\n  mesh m0 = {}\n  in a: f32[3] on m0\n  out b: f32[3] on m0\n  c0 = send_recv(a -> b, team=devices(0, {last}), root=0)\n  wait c0\n}}\n",
            iota(d as i64)
        );
        let host = meshflow::ir::parse_host(&text).unwrap();
        let inputs = (0..d)
            .map(|r| {
                (
                    r,
                    BTreeMap::from([("a".to_string(), input(r, DType::F32, &[3]))]),
                )
            })
            .collect();
        let out = run_cpu(&host, RunInputs::PerRank(inputs), &options_rooted()).unwrap();
        assert_eq!(
            out.outputs[&last]["b"].storage().to_f32_vec(),
            vals(0, 3),
            "d={d}"
        );
    }
}

fn ring(d: usize, shift: i64) -> HostProgram {
    let text = format!(
        "host ring {{\n  mesh m0 = {mesh}\n  in a: f32[4] on m0\n  out b: f32[4] on m0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + {s}) % {d}, recv=(my(m0, DIDx) + {r}) % {d})\n  wait c0\n}}\n",
        mesh = iota(d as i64),
        s = shift.rem_euclid(d as i64),
        r = (-shift).rem_euclid(d as i64),
    );
    meshflow::ir::parse_host(&text).unwrap()
}

#[test]
fn collective_permute_rings_in_both_directions_and_self_copy() {
    for d in RANKS {
        for shift in [0i64, 1, -1, 2] {
            let inputs = (0..d)
                .map(|r| {
                    (
                        r,
                        BTreeMap::from([("a".to_string(), input(r, DType::F32, &[4]))]),
                    )
                })
                .collect();
            let out = run_cpu(&ring(d, shift), RunInputs::PerRank(inputs), &options()).unwrap();
            for j in 0..d {
                let src = (j as i64 - shift).rem_euclid(d as i64) as usize;
                assert_eq!(
                    out.outputs[&j]["b"].storage().to_f32_vec(),
                    vals(src, 4),
                    "d={d} shift={shift}"
                );
            }
        }
    }
}

#[test]
fn coalescing_group_posts_all_members_and_its_label_covers_them() {
    // Two opposite rings and an all-reduce in one group; only the group label is waited.
    for d in RANKS {
        let text = format!(
            "host group {{\n  mesh m0 = {mesh}\n  in a: f32[4] on m0\n  out l: f32[4] on m0\n  out r: f32[4] on m0\n  out s: f32[4] on m0\n  start_coalescing\n  c0 = collective_permute(a -> l, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % {d}, recv=(my(m0, DIDx) + {dm1}) % {d})\n  c1 = collective_permute(a -> r, team=slice(m0, DIDx), send=(my(m0, DIDx) + {dm1}) % {d}, recv=(my(m0, DIDx) + 1) % {d})\n  c2 = all_reduce(a -> s, team=slice(m0, DIDx), op=sum)\n  c3 = end_coalescing\n  $WAIT\n  gelu(s -> s)\n}}\n",
            mesh = iota(d as i64),
            dm1 = d - 1,
        );
        let inputs: BTreeMap<_, _> = (0..d)
            .map(|r| {
                (
                    r,
                    BTreeMap::from([("a".to_string(), input(r, DType::F32, &[4]))]),
                )
            })
            .collect();
        let host = meshflow::ir::parse_host(&text.replace("$WAIT", "wait c3")).unwrap();
        let out = run_cpu(&host, RunInputs::PerRank(inputs.clone()), &options()).unwrap();
        let sum: Vec<f32> = (0..4)
            .map(|i| (0..d).map(|r| vals(r, 4)[i]).sum::<f32>())
            .collect();
        let gelu: Vec<f32> = sum
            .iter()
            .map(|&v| meshflow::runtime::cpu_ops::gelu_scalar(v))
            .collect();
        for j in 0..d {
            let o = &out.outputs[&j];
            assert_eq!(o["l"].storage().to_f32_vec(), vals((j + d - 1) % d, 4));
            assert_eq!(o["r"].storage().to_f32_vec(), vals((j + 1) % d, 4));
            assert_eq!(o["s"].storage().to_f32_vec(), gelu);
        }
        // Without the wait, reading the all-reduce output is a race that names the group.
        let racy = meshflow::ir::parse_host(&text.replace("$WAIT", "")).unwrap();
        let err = run_cpu(&racy, RunInputs::PerRank(inputs), &options())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("missing `wait c3` (the coalescing group of c2)"),
            "{err}"
        );
    }
}

#[test]
fn mismatched_buffer_sizes_are_errors_not_panics() {
    let text = "host bad {\n  mesh m0 = [0, 1]\n  in a: f32[3] on m0\n  out b: f32[5] on m0\n  c0 = all_gather(a -> b, team=slice(m0, DIDx))\n  wait c0\n}\n";
    let host = meshflow::ir::parse_host(text).unwrap();
    let inputs = (0..2)
        .map(|r| {
            (
                r,
                BTreeMap::from([("a".to_string(), input(r, DType::F32, &[3]))]),
            )
        })
        .collect();
    let err = run_cpu(&host, RunInputs::PerRank(inputs), &options())
        .unwrap_err()
        .to_string();
    assert!(err.contains("all_gather"), "{err}");
    assert!(err.contains("cannot be cut into 2 equal chunks"), "{err}");
}
