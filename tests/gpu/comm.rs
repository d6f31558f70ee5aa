//! Every communication kind on 1, 2 and 4 GPUs (those present), f32 and bf16, against the CPU backend
//! backend with the same inputs; strided (non-packed) send and receive views; coalescing
//! groups; collective-permute rings.
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

use crate::support::gpu as support;

use support::*;

fn shape(s: &[u64]) -> String {
    s.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
}

/// One `kind(a -> b, team=slice(m0, DIDx) extra)`.
fn one(
    d: usize,
    dtype: &str,
    kind: &str,
    i: &[u64],
    o: &[u64],
    extra: &str,
) -> meshflow::ir::HostProgram {
    host(
        "host one {\n  mesh m0 = $MESH\n  in a: $T[$I] on m0\n  out b: $T[$O] on m0\n  c0 = $KIND(a -> b, team=slice(m0, DIDx)$EXTRA)\n  wait c0\n}\n",
        &[
            ("MESH", iota(d)),
            ("T", dtype.into()),
            ("I", shape(i)),
            ("O", shape(o)),
            ("KIND", kind.into()),
            ("EXTRA", extra.into()),
        ],
    )
}

/// (name, kind, in shape, out shape, extra arguments, the only rank that writes the output)
type Case = (
    String,
    &'static str,
    Vec<u64>,
    Vec<u64>,
    String,
    Option<usize>,
);

#[test]
fn collectives_match_the_cpu_backend() {
    for d in rank_counts("collectives_match_the_cpu_backend") {
        let n = d as u64;
        for dtype in ["f32", "bf16"] {
            let mut cases: Vec<Case> = vec![
                (
                    "all_gather".into(),
                    "all_gather",
                    vec![4, 6],
                    vec![4 * n, 6],
                    String::new(),
                    None,
                ),
                (
                    "reduce_scatter".into(),
                    "reduce_scatter",
                    vec![2 * n, 5],
                    vec![2, 5],
                    ", op=sum".into(),
                    None,
                ),
                (
                    "all_to_all".into(),
                    "all_to_all",
                    vec![3 * n, 4],
                    vec![3 * n, 4],
                    String::new(),
                    None,
                ),
            ];
            for op in ["sum", "max", "min"] {
                cases.push((
                    format!("all_reduce {op}"),
                    "all_reduce",
                    vec![7, 3],
                    vec![7, 3],
                    format!(", op={op}"),
                    None,
                ));
            }
            for root in [0, d - 1] {
                let r = format!(", root={root}");
                cases.push((
                    format!("broadcast root {root}"),
                    "broadcast",
                    vec![9],
                    vec![9],
                    r.clone(),
                    None,
                ));
                cases.push((
                    format!("gather root {root}"),
                    "gather",
                    vec![2, 3],
                    vec![2 * n, 3],
                    r.clone(),
                    Some(root),
                ));
                cases.push((
                    format!("scatter root {root}"),
                    "scatter",
                    vec![2 * n, 3],
                    vec![2, 3],
                    r.clone(),
                    None,
                ));
                cases.push((
                    format!("reduce root {root}"),
                    "reduce",
                    vec![4, 4],
                    vec![4, 4],
                    format!("{r}, op=sum"),
                    Some(root),
                ));
            }
            for (name, kind, i, o, extra, only) in cases {
                let h = one(d, dtype, kind, &i, &o, &extra);
                let inputs = per_rank_inputs(&h, d, 11);
                let err = cpu_vs_cuda_on(&name, &h, d, inputs, &|r| only.is_none_or(|x| x == r));
                eprintln!("{name} {dtype} d={d}: max rel err {err:.2e}");
            }
        }
    }
}

/// Collectives over a flattened team (both axes of a 2-D mesh: its own NCCL communicator)
/// interleaved with one over a slice of the same mesh, against the CPU backend.
#[test]
fn flattened_teams_match_the_cpu_backend() {
    for d in rank_counts("flattened_teams_match_the_cpu_backend") {
        let (dy, dx) = if d >= 4 { (d / 2, 2) } else { (d, 1) };
        let h = host(
            "host flat {\n  mesh m0 = iota($DY, $DX)\n  in a: f32[4, 6] on m0\n  out g: f32[$G, 6] on m0\n  out s: f32[4, 6] on m0\n  out t: f32[4, 6] on m0\n  c0 = all_gather(a -> g, team=flattened(m0, DIDy, DIDx))\n  c1 = all_reduce(a -> s, team=flattened(m0, DIDy, DIDx), op=sum)\n  c2 = all_reduce(a -> t, team=slice(m0, DIDx), op=max)\n  wait c0\n  wait c1\n  wait c2\n}\n",
            &[
                ("DY", dy.to_string()),
                ("DX", dx.to_string()),
                ("G", (4 * d).to_string()),
            ],
        );
        let inputs = per_rank_inputs(&h, d, 7);
        let err = cpu_vs_cuda("flattened collectives", &h, d, inputs);
        eprintln!("flattened collectives d={d}: max rel err {err:.2e}");
    }
}

#[test]
fn send_recv_between_the_ends_of_the_mesh() {
    if skip_unless(2, "send_recv_between_the_ends_of_the_mesh") {
        return;
    }
    let d = gpus().unwrap_or(2).clamp(2, 4);
    let h = host(
        "host sr {\n  mesh m0 = $MESH\n  in a: f32[3, 5] on m0\n  out b: f32[3, 5] on m0\n  c0 = send_recv(a -> b, team=devices(0, $LAST), root=0)\n  wait c0\n}\n",
        &[("MESH", iota(d)), ("LAST", (d - 1).to_string())],
    );
    let inputs = per_rank_inputs(&h, d, 3);
    // Only the receiver (the last device) writes `b`.
    cpu_vs_cuda_on("send_recv", &h, d, inputs, &|r| r == d - 1);
}

#[test]
fn strided_send_and_receive_views_are_staged() {
    // Column halves (strided views) as the send buffer of one all_gather and as the receive
    // buffers of two others.
    for d in rank_counts("strided_send_and_receive_views_are_staged") {
        let h = host(
            "host strided {\n  mesh m0 = $MESH\n  in a: f32[4, 6] on m0\n  out b: f32[$R, 3] on m0\n  out c: f32[$R, 6] on m0\n  tensor a_half: f32[4, 3] on m0\n  tensor c_half: f32[$R, 3] on m0\n  a_half = shard_by_stream(a, axis=1, chunks=2, index=1)\n  c0 = all_gather(a_half -> b, team=slice(m0, DIDx))\n  wait c0\n  c_half = shard_by_stream(c, axis=1, chunks=2, index=0)\n  c1 = all_gather(a_half -> c_half, team=slice(m0, DIDx))\n  wait c1\n  c_half = shard_by_stream(c, axis=1, chunks=2, index=1)\n  c2 = all_gather(a_half -> c_half, team=slice(m0, DIDx))\n  wait c2\n}\n",
            &[("MESH", iota(d)), ("R", (4 * d).to_string())],
        );
        let inputs = per_rank_inputs(&h, d, 5);
        cpu_vs_cuda("strided all_gather", &h, d, inputs);
    }
}

#[test]
fn permute_rings_and_coalescing_groups() {
    for d in rank_counts("permute_rings_and_coalescing_groups") {
        for (s, r) in [(1, d - 1), (0, 0), (d - 1, 1)] {
            let h = host(
                "host ring {\n  mesh m0 = $MESH\n  in a: bf16[4, 8] on m0\n  out b: bf16[4, 8] on m0\n  c0 = collective_permute(a -> b, team=slice(m0, DIDx), send=(my(m0, DIDx) + $S) % $D, recv=(my(m0, DIDx) + $R) % $D)\n  wait c0\n}\n",
                &[("MESH", iota(d)), ("S", (s % d).to_string()), ("R", (r % d).to_string()), ("D", d.to_string())],
            );
            let inputs = per_rank_inputs(&h, d, 9);
            cpu_vs_cuda(&format!("permute +{s}/+{r}"), &h, d, inputs);
        }
        let dm1 = (d - 1).to_string();
        let h = host(
            "host group {\n  mesh m0 = $MESH\n  in a: f32[4] on m0\n  out l: f32[4] on m0\n  out r: f32[4] on m0\n  out s: f32[4] on m0\n  start_coalescing\n  c0 = collective_permute(a -> l, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % $D, recv=(my(m0, DIDx) + $DM1) % $D)\n  c1 = collective_permute(a -> r, team=slice(m0, DIDx), send=(my(m0, DIDx) + $DM1) % $D, recv=(my(m0, DIDx) + 1) % $D)\n  c2 = all_reduce(a -> s, team=slice(m0, DIDx), op=sum)\n  c3 = end_coalescing\n  wait c3\n  gelu(s -> s)\n}\n",
            &[("MESH", iota(d)), ("D", d.to_string()), ("DM1", dm1)],
        );
        let inputs = per_rank_inputs(&h, d, 13);
        cpu_vs_cuda("coalesced group", &h, d, inputs);
    }
}
