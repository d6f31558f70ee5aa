//! The example programs of `examples/programs/*.mf`, built with `ProgramBuilder` (so the
//! lowering tests do not depend on the parser), parameterized like their `param`s.

use meshflow::ir::{
    DType, DeviceMesh, Fp8Scales, MoeWire, ParallelType::*, Program, ProgramBuilder,
};

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
    moe_layer_of("moe_layer", d, (6, 16, 8), DType::F32, MoeWire::Native)
}

/// `moe_layer_fp8` with `d` devices.
pub fn moe_layer_fp8(d: u64) -> Program {
    let wire = MoeWire::Fp8E4m3(Fp8Scales::Block128);
    moe_layer_of("moe_layer_fp8", d, (8, 256, 64), DType::BF16, wire)
}

/// The MoE layer examples: `(t, h, f)` tokens per device and widths, 2 experts per device,
/// top-2.
fn moe_layer_of(
    name: &str,
    d: u64,
    (t, h, f): (u64, u64, u64),
    dt: DType,
    wire: MoeWire,
) -> Program {
    let (e, k) = (2, 2);
    let mut b = ProgramBuilder::new(name);
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let x = b.input("x", dt, &[t * d, h], m).unwrap();
    let idx = b.input("topk_idx", DType::I32, &[t * d, k], m).unwrap();
    let tw = b.input("topk_weights", DType::F32, &[t * d, k], m).unwrap();
    let we = b.input("w_experts", dt, &[e * d, h, f], m).unwrap();
    for t in [x, idx, tw, we] {
        b.schedule(t).outer_split(0, d).parallelize(0, DIDx);
    }
    let (ex, counts, routing) = b.moe_dispatch_with(x, idx, e * d, t * d, wire).unwrap();
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

/// `transformer_block_2d` with `ranks` devices (`tp = 2`, `dp = ranks / 2`): a
/// sequence-parallel attention block and MLP on a `dp x tp` mesh.
pub fn transformer_block_2d(ranks: u64) -> Program {
    let tp = 2;
    let dp = ranks / tp;
    let (bb, s, nh, hd) = (2 * dp, 4 * tp, 2 * tp, 8);
    let (h, f) = (nh * hd, 2 * nh * hd);
    let f32 = DType::F32;
    let mut b = ProgramBuilder::new("transformer_block_2d");
    let m = b
        .mesh(
            "m",
            DeviceMesh::iota(vec![dp as usize, tp as usize], 0).unwrap(),
        )
        .unwrap();
    let seq_parallel = |b: &mut ProgramBuilder, t| {
        b.schedule(t)
            .outer_split(0, dp)
            .parallelize(0, DIDy)
            .outer_split(2, tp)
            .parallelize(2, DIDx);
    };
    let x = b.input("x", f32, &[bb, s, h], m).unwrap();
    seq_parallel(&mut b, x);
    let mask = b.input("mask", f32, &[s, s], m).unwrap();
    b.replicate(mask);
    let wn1 = b.input("wn1", f32, &[h], m).unwrap();
    b.replicate(wn1);
    let column = |b: &mut ProgramBuilder, name: &str, rows: u64, cols: u64, axis: usize| {
        let w = b.input(name, f32, &[rows, cols], m).unwrap();
        b.schedule(w).outer_split(axis, tp).parallelize(axis, DIDx);
        w
    };
    let wq = column(&mut b, "wq", h, h, 0);
    let wk = column(&mut b, "wk", h, h, 0);
    let wv = column(&mut b, "wv", h, h, 0);
    let wo = column(&mut b, "wo", h, h, 1);
    let wn2 = b.input("wn2", f32, &[h], m).unwrap();
    b.replicate(wn2);
    let w1 = column(&mut b, "w1", f, h, 0);
    let w2 = column(&mut b, "w2", h, f, 1);
    let name = |b: &mut ProgramBuilder, t, n: &str| {
        b.rename(t, n).unwrap();
        t
    };
    let xn = b.rms_norm(x, wn1, 2, 1e-6).unwrap();
    name(&mut b, xn, "xn");
    let xg = b.set(xn).unwrap();
    name(&mut b, xg, "xg");
    b.schedule(xg).outer_split(0, dp).parallelize(0, DIDy);
    let q = b.linear(xg, wq).unwrap();
    name(&mut b, q, "q");
    let k = b.linear(xg, wk).unwrap();
    name(&mut b, k, "k");
    let v = b.linear(xg, wv).unwrap();
    name(&mut b, v, "v");
    let heads = [bb, s, nh, hd];
    let q4 = b.reshape(q, &heads).unwrap();
    name(&mut b, q4, "q4");
    let k4 = b.reshape(k, &heads).unwrap();
    name(&mut b, k4, "k4");
    let v4 = b.reshape(v, &heads).unwrap();
    name(&mut b, v4, "v4");
    let qh = b.permute(q4, &[0, 2, 1, 3]).unwrap();
    name(&mut b, qh, "qh");
    let kt = b.permute(k4, &[0, 2, 3, 1]).unwrap();
    name(&mut b, kt, "kt");
    let vh = b.transpose(v4, 1, 2).unwrap();
    name(&mut b, vh, "vh");
    let sc = b.matmul(qh, kt).unwrap();
    name(&mut b, sc, "sc");
    let mk = b.expand(mask, &[bb, nh, s, s]).unwrap();
    name(&mut b, mk, "mk");
    let sm = b.add(sc, mk).unwrap();
    name(&mut b, sm, "sm");
    let p = b.softmax(sm, 3).unwrap();
    name(&mut b, p, "p");
    let o = b.matmul(p, vh).unwrap();
    name(&mut b, o, "o");
    let ot = b.transpose(o, 1, 2).unwrap();
    name(&mut b, ot, "ot");
    let o3 = b.reshape(ot, &[bb, s, h]).unwrap();
    name(&mut b, o3, "o3");
    let att = b.linear(o3, wo).unwrap();
    name(&mut b, att, "att");
    let a = b.set(att).unwrap();
    name(&mut b, a, "a");
    seq_parallel(&mut b, a);
    let h1 = b.add(x, a).unwrap();
    name(&mut b, h1, "h1");
    let hn = b.rms_norm(h1, wn2, 2, 1e-6).unwrap();
    name(&mut b, hn, "hn");
    let hg = b.set(hn).unwrap();
    name(&mut b, hg, "hg");
    b.schedule(hg).outer_split(0, dp).parallelize(0, DIDy);
    let u = b.linear(hg, w1).unwrap();
    name(&mut b, u, "u");
    let g = b.gelu(u).unwrap();
    name(&mut b, g, "g");
    let dn = b.linear(g, w2).unwrap();
    name(&mut b, dn, "dn");
    let mo = b.set(dn).unwrap();
    name(&mut b, mo, "mo");
    seq_parallel(&mut b, mo);
    let y = b.add(h1, mo).unwrap();
    name(&mut b, y, "y");
    b.output(y);
    b.build().unwrap()
}

/// `row_parallel_linear_ring` with `d` devices.
pub fn row_parallel_ring(d: u64) -> Program {
    let mut b = ProgramBuilder::new("row_parallel_linear_ring");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[8 * d, 16 * d], m).unwrap();
    let w = b.input("w", DType::F32, &[24, 16 * d], m).unwrap();
    b.schedule(x).outer_split(1, d).parallelize(1, DIDx);
    b.schedule(w).outer_split(1, d).parallelize(1, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    b.schedule(y)
        .outer_split(0, d)
        .swizzle1d(0, DIDx)
        .parallelize(0, Stream)
        .outer_split(3, d)
        .parallelize(3, DIDx);
    let z = b.set(y).unwrap();
    b.rename(z, "z").unwrap();
    b.schedule(z).outer_split(0, d).parallelize(0, DIDx);
    b.output(z);
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
        "moe_layer_fp8" => moe_layer_fp8(ranks),
        "pipeline_two_meshes" if ranks >= 2 => pipeline_two_meshes(ranks),
        "row_parallel_linear_chunked" => row_parallel(ranks),
        "row_parallel_linear_ring" => row_parallel_ring(ranks),
        "transformer_block_2d" if ranks >= 2 => transformer_block_2d(ranks),
        _ => return None,
    })
}

/// The stems of `examples/programs/*.mf`.
pub const EXAMPLES: [&str; 11] = [
    "column_parallel_linear_broadcast",
    "column_parallel_linear_collective",
    "column_parallel_linear_ring",
    "fsdp_tp_weight",
    "mlp_2d_mesh",
    "moe_layer",
    "moe_layer_fp8",
    "pipeline_two_meshes",
    "row_parallel_linear_chunked",
    "row_parallel_linear_ring",
    "transformer_block_2d",
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
