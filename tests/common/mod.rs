//! The example programs of `examples/programs/*.mf`, built with `ProgramBuilder` (so the
//! lowering tests do not depend on the parser), parameterized like their `param`s.
#![allow(dead_code)]

use meshflow::ir::{DType, DeviceMesh, ParallelType::*, Program, ProgramBuilder};

/// `column_parallel_linear_{collective,broadcast,ring}`.
pub fn column_parallel(variant: &str, d: u64) -> Program {
    let dtype = if variant == "ring" {
        DType::BF16
    } else {
        DType::F32
    };
    let mut b = ProgramBuilder::new(format!("column_parallel_linear_{variant}"));
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let x = b.input("x", dtype, &[16 * d, 32], m).unwrap();
    let w = b.input("w", dtype, &[12 * d, 32], m).unwrap();
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, d).parallelize(0, DIDx);
    let ag = b.set(x).unwrap();
    b.rename(ag, "ag").unwrap();
    match variant {
        "collective" => b.replicate(ag),
        "broadcast" => {
            b.schedule(ag).outer_split(0, d).parallelize(0, Stream);
        }
        _ => {
            b.schedule(ag)
                .outer_split(0, d)
                .swizzle1d(0, DIDx)
                .parallelize(0, Stream);
        }
    }
    let y = b.linear(ag, w).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    b.build().unwrap()
}

/// `mlp_2d_mesh` with `ranks` devices and `tp = 2`.
pub fn mlp_2d_mesh(ranks: u64) -> Program {
    let tp = 2;
    let dp = ranks / tp;
    let mut b = ProgramBuilder::new("mlp_2d_mesh");
    let m = b
        .mesh(
            "m",
            DeviceMesh::iota(vec![dp as usize, tp as usize], 0).unwrap(),
        )
        .unwrap();
    let x = b.input("x", DType::F32, &[4 * dp, 16], m).unwrap();
    let w1 = b.input("w1", DType::F32, &[8 * tp, 16], m).unwrap();
    let w2 = b.input("w2", DType::F32, &[16, 8 * tp], m).unwrap();
    b.schedule(x).outer_split(0, dp).parallelize(0, DIDy);
    b.schedule(w1).outer_split(0, tp).parallelize(0, DIDx);
    b.schedule(w2).outer_split(1, tp).parallelize(1, DIDx);
    let h = b.linear(x, w1).unwrap();
    b.rename(h, "h").unwrap();
    let a = b.gelu(h).unwrap();
    b.rename(a, "a").unwrap();
    let y = b.linear(a, w2).unwrap();
    b.rename(y, "y").unwrap();
    b.schedule(y)
        .outer_split(0, dp)
        .parallelize(0, DIDy)
        .outer_split(3, tp)
        .parallelize(3, DIDx);
    b.output(y);
    b.build().unwrap()
}

/// `moe_layer` with `d` devices.
pub fn moe_layer(d: u64) -> Program {
    let (t, e, k, h, f) = (6, 2, 2, 16, 8);
    let mut b = ProgramBuilder::new("moe_layer");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[t * d, h], m).unwrap();
    let idx = b.input("topk_idx", DType::I32, &[t * d, k], m).unwrap();
    let tw = b.input("topk_weights", DType::F32, &[t * d, k], m).unwrap();
    let we = b.input("w_experts", DType::F32, &[e * d, h, f], m).unwrap();
    for t in [x, idx, tw, we] {
        b.schedule(t).outer_split(0, d).parallelize(0, DIDx);
    }
    let (ex, counts, routing) = b.moe_dispatch(x, idx, e * d, t * d).unwrap();
    for (t, name) in [
        (ex, "expert_x"),
        (counts, "expert_counts"),
        (routing, "routing"),
    ] {
        b.rename(t, name).unwrap();
        b.schedule(t).outer_split(0, d).parallelize(0, DIDx);
    }
    let ey = b.grouped_matmul(ex, counts, we).unwrap();
    b.rename(ey, "expert_y").unwrap();
    let y = b.moe_combine(ey, counts, routing, tw).unwrap();
    b.rename(y, "y").unwrap();
    b.schedule(y).outer_split(0, d).parallelize(0, DIDx);
    b.output(y);
    b.build().unwrap()
}

/// `pipeline_two_meshes` with `ranks` devices (two stages of `ranks / 2`).
pub fn pipeline_two_meshes(ranks: u64) -> Program {
    let d = ranks / 2;
    let mut b = ProgramBuilder::new("pipeline_two_meshes");
    let s0 = b
        .mesh("stage0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let s1 = b
        .mesh(
            "stage1",
            DeviceMesh::iota(vec![d as usize], d as usize).unwrap(),
        )
        .unwrap();
    let x = b.input("x", DType::F32, &[8 * d, 16], s0).unwrap();
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    let a = b.gelu(x).unwrap();
    b.rename(a, "a").unwrap();
    let bb = b.set(a).unwrap();
    b.rename(bb, "b").unwrap();
    b.place(bb, s1);
    b.schedule(bb).outer_split(0, d).parallelize(0, DIDx);
    let y = b.silu(bb).unwrap();
    b.rename(y, "y").unwrap();
    b.place(y, s1);
    b.output(y);
    b.build().unwrap()
}

/// `row_parallel_linear_chunked` with `d` devices and `s = 3` chunks.
pub fn row_parallel(d: u64) -> Program {
    let s = 3;
    let mut b = ProgramBuilder::new("row_parallel_linear_chunked");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[8 * s, 16 * d], m).unwrap();
    let w = b.input("w", DType::F32, &[24, 16 * d], m).unwrap();
    b.schedule(x)
        .outer_split(1, d)
        .parallelize(1, DIDx)
        .outer_split(0, s)
        .parallelize(0, Stream);
    b.schedule(w).outer_split(1, d).parallelize(1, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    b.schedule(y)
        .outer_split(0, s)
        .parallelize(0, Stream)
        .outer_split(3, d)
        .parallelize(3, DIDx);
    b.output(y);
    b.build().unwrap()
}

/// `fsdp_tp_weight` with `ranks` devices on a `(ranks / 2, 2)` mesh.
pub fn fsdp_tp_weight(ranks: u64) -> Program {
    let (tp, dp) = (2, ranks / 2);
    let n = 6 * ranks + 1;
    let mut b = ProgramBuilder::new("fsdp_tp_weight");
    let m = b
        .mesh(
            "m",
            DeviceMesh::iota(vec![dp as usize, tp as usize], 0).unwrap(),
        )
        .unwrap();
    let x = b.input("x", DType::F32, &[4 * dp, 24], m).unwrap();
    let w1 = b.input("w1", DType::F32, &[n, 24], m).unwrap();
    let w2 = b.input("w2", DType::F32, &[n, 24], m).unwrap();
    b.schedule(x).outer_split(0, dp).parallelize(0, DIDy);
    b.schedule(w1)
        .outer_split(0, tp)
        .parallelize(0, DIDx)
        .outer_split(1, dp)
        .parallelize(1, DIDy);
    b.schedule(w2)
        .outer_split(0, dp)
        .parallelize(0, DIDy)
        .outer_split(1, tp)
        .parallelize(1, DIDx);
    let tp_copy = |b: &mut ProgramBuilder, w, name: &str| {
        let t = b.set(w).unwrap();
        b.rename(t, name).unwrap();
        b.schedule(t).outer_split(0, tp).parallelize(0, DIDx);
        t
    };
    let w1_tp = tp_copy(&mut b, w1, "w1_tp");
    let w2_tp = tp_copy(&mut b, w2, "w2_tp");
    let h1 = b.linear(x, w1_tp).unwrap();
    b.rename(h1, "h1").unwrap();
    let a1 = b.gelu(h1).unwrap();
    b.rename(a1, "a1").unwrap();
    let h2 = b.linear(x, w2_tp).unwrap();
    b.rename(h2, "h2").unwrap();
    let y = b.add(a1, h2).unwrap();
    b.rename(y, "y").unwrap();
    b.schedule(y)
        .outer_split(0, dp)
        .parallelize(0, DIDy)
        .outer_split(2, tp)
        .parallelize(2, DIDx);
    b.output(y);
    b.build().unwrap()
}

/// Every example by file stem, for `ranks` devices (`None` where the example does not fit).
pub fn example(name: &str, ranks: u64) -> Option<Program> {
    Some(match name {
        "column_parallel_linear_collective" => column_parallel("collective", ranks),
        "column_parallel_linear_broadcast" => column_parallel("broadcast", ranks),
        "column_parallel_linear_ring" => column_parallel("ring", ranks),
        "fsdp_tp_weight" if ranks >= 2 => fsdp_tp_weight(ranks),
        "mlp_2d_mesh" if ranks >= 2 => mlp_2d_mesh(ranks),
        "moe_layer" => moe_layer(ranks),
        "pipeline_two_meshes" if ranks >= 2 => pipeline_two_meshes(ranks),
        "row_parallel_linear_chunked" => row_parallel(ranks),
        _ => return None,
    })
}

/// The stems of `examples/programs/*.mf`.
pub const EXAMPLES: [&str; 8] = [
    "column_parallel_linear_broadcast",
    "column_parallel_linear_collective",
    "column_parallel_linear_ring",
    "fsdp_tp_weight",
    "mlp_2d_mesh",
    "moe_layer",
    "pipeline_two_meshes",
    "row_parallel_linear_chunked",
];

/// A transformer-like stack of `layers` MLP blocks on a `dp x tp` mesh: per layer a
/// column-parallel linear (weights split on N along DIDx), gelu, a row-parallel linear
/// (weights split on K along DIDx: partial sums) and a residual add. Activations are data
/// parallel (rows split along DIDy); everything else is left to propagation.
pub fn transformer(layers: usize, dp: u64, tp: u64) -> Program {
    let (tokens, hidden, ffn) = (64 * dp, 256, 1024);
    let mut b = ProgramBuilder::new("transformer");
    let m = b
        .mesh(
            "m",
            DeviceMesh::iota(vec![dp as usize, tp as usize], 0).unwrap(),
        )
        .unwrap();
    let mut x = b.input("x", DType::BF16, &[tokens, hidden], m).unwrap();
    b.schedule(x).outer_split(0, dp).parallelize(0, DIDy);
    for l in 0..layers {
        let w1 = b
            .input(&format!("w1_{l}"), DType::BF16, &[ffn, hidden], m)
            .unwrap();
        let w2 = b
            .input(&format!("w2_{l}"), DType::BF16, &[hidden, ffn], m)
            .unwrap();
        b.schedule(w1).outer_split(0, tp).parallelize(0, DIDx);
        b.schedule(w2).outer_split(1, tp).parallelize(1, DIDx);
        let h = b.linear(x, w1).unwrap();
        let a = b.gelu(h).unwrap();
        let y = b.linear(a, w2).unwrap();
        x = b.add(y, x).unwrap();
    }
    b.rename(x, "result").unwrap();
    b.output(x);
    b.build().unwrap()
}
