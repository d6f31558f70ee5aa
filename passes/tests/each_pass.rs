//! Every pass on its own: the IR before and after, as snapshots (plus a few assertions).

mod common;

use meshflow_ir::{DType, HostProgram, ParallelType::*, Program};
use meshflow_passes::passes::{
    AssignStreams, ChooseDecompositions, DecomposeReshardings, DeferWaits, InsertAllocations,
    LowerToHost, PropagateShardings, SimplifyIndices,
};
use meshflow_passes::{HostPass, LowerPass, PassContext, ProgramPass};

/// The ring all-gather feeding a column-parallel linear, with `y` unannotated.
fn ring(d: u64) -> Program {
    let (mut b, m) = common::builder("ring", d as usize);
    let x = b.input("x", DType::BF16, &[16 * d, 32], m).unwrap();
    let w = b.input("w", DType::BF16, &[12 * d, 32], m).unwrap();
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, d).parallelize(0, DIDx);
    let ag = b.set(x).unwrap();
    b.rename(ag, "ag").unwrap();
    b.schedule(ag)
        .outer_split(0, d)
        .swizzle1d(0, DIDx)
        .parallelize(0, Stream);
    let y = b.linear(ag, w).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    b.build().unwrap()
}

/// A sequence-parallel MLP block with nothing annotated but the inputs.
fn mlp(d: u64) -> Program {
    let (mut b, m) = common::builder("mlp", d as usize);
    let x = b.input("x", DType::F32, &[8 * d, 16], m).unwrap();
    let w1 = b.input("w1", DType::F32, &[8 * d, 16], m).unwrap();
    let w2 = b.input("w2", DType::F32, &[16, 8 * d], m).unwrap();
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w1).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w2).outer_split(1, d).parallelize(1, DIDx);
    let h = b.linear(x, w1).unwrap();
    b.rename(h, "h").unwrap();
    let a = b.gelu(h).unwrap();
    b.rename(a, "a").unwrap();
    let y = b.linear(a, w2).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    b.build().unwrap()
}

fn level1(p: &Program, pass: &dyn ProgramPass) -> (String, Program) {
    let mut out = p.clone();
    let options = meshflow_passes::PassOptions::default();
    let mut cx = PassContext::new(p, &options);
    pass.run(&mut out, &mut cx).expect("pass succeeds");
    (format!("{p}--- after {} ---\n{out}", pass.name()), out)
}

fn host_pass(h: &HostProgram, pass: &dyn HostPass, p: &Program) -> (String, HostProgram) {
    let mut out = h.clone();
    let options = meshflow_passes::PassOptions::default();
    let mut cx = PassContext::new(p, &options);
    pass.run(&mut out, &mut cx).expect("pass succeeds");
    (format!("{h}--- after {} ---\n{out}", pass.name()), out)
}

/// The program just before lowering, and the raw lowering.
fn lowered(p: &Program) -> (Program, HostProgram) {
    let mut p = p.clone();
    let options = meshflow_passes::PassOptions::default();
    let mut cx = PassContext::new(&p, &options);
    PropagateShardings.run(&mut p, &mut cx).unwrap();
    DecomposeReshardings.run(&mut p, &mut cx).unwrap();
    ChooseDecompositions.run(&mut p, &mut cx).unwrap();
    let h = LowerToHost.run(&p, &mut cx).unwrap();
    (p, h)
}

#[test]
fn propagate_shardings() {
    let (text, _) = level1(&mlp(2), &PropagateShardings);
    insta::assert_snapshot!(text);
}

#[test]
fn decompose_reshardings() {
    let mut p = mlp(2);
    let options = meshflow_passes::PassOptions::default();
    let mut cx = PassContext::new(&p, &options);
    PropagateShardings.run(&mut p, &mut cx).unwrap();
    let (text, out) = level1(&p, &DecomposeReshardings);
    // x is gathered before the first linear; y's partial sums are reduced into y.
    assert!(out.tensor_by_name("x_gathered").is_some(), "{text}");
    assert!(out.tensor_by_name("y_partial").is_some(), "{text}");
    insta::assert_snapshot!(text);
}

#[test]
fn choose_decompositions() {
    let mut p = mlp(2);
    let options = meshflow_passes::PassOptions::default();
    let mut cx = PassContext::new(&p, &options);
    PropagateShardings.run(&mut p, &mut cx).unwrap();
    DecomposeReshardings.run(&mut p, &mut cx).unwrap();
    let before = p.clone();
    ChooseDecompositions.run(&mut p, &mut cx).unwrap();
    let explain: String = cx.explain.iter().map(ToString::to_string).collect();
    insta::assert_snapshot!(format!(
        "{before}--- after choose_decompositions ---\n{p}--- explain ---\n{explain}"
    ));
}

#[test]
fn lower_to_host() {
    let (p, h) = lowered(&ring(4));
    insta::assert_snapshot!(format!("{p}--- after lower_to_host ---\n{h}"));
}

#[test]
fn simplify_indices() {
    let (p, h) = lowered(&ring(4));
    let (text, out) = host_pass(&h, &SimplifyIndices, &p);
    assert!(
        out.to_string().contains("send=(my(m0, DIDx) - i0) % 4"),
        "{text}"
    );
    insta::assert_snapshot!(text);
}

#[test]
fn assign_streams() {
    let (p, h) = lowered(&ring(4));
    let (text, out) = host_pass(&h, &AssignStreams, &p);
    let s = out.to_string();
    assert!(s.contains("set_current_stream worker(i0 % 2)"), "{text}");
    assert!(
        s.contains("for i1 in 0..2 {\n    synchronize worker(i1)"),
        "{text}"
    );
    insta::assert_snapshot!(text);
}

#[test]
fn insert_allocations() {
    let (p, h) = lowered(&ring(4));
    let options = meshflow_passes::PassOptions::default();
    let mut cx = PassContext::new(&p, &options);
    let mut h = h;
    AssignStreams.run(&mut h, &mut cx).unwrap();
    let (text, out) = host_pass(&h, &InsertAllocations, &p);
    let s = out.to_string();
    // Both buffers outside the loop, before the fork; the temporary freed after the join.
    assert!(
        s.contains("allocate ag\n  allocate y\n  s0 = get_current_stream"),
        "{text}"
    );
    assert!(s.trim_end().ends_with("deallocate ag\n}"), "{text}");
    insta::assert_snapshot!(text);
}

#[test]
fn defer_waits() {
    let (p, h) = lowered(&ring(4));
    let options = meshflow_passes::PassOptions::default();
    let mut cx = PassContext::new(&p, &options);
    let mut h = h;
    AssignStreams.run(&mut h, &mut cx).unwrap();
    InsertAllocations.run(&mut h, &mut cx).unwrap();
    let (text, out) = host_pass(&h, &DeferWaits, &p);
    let s = out.to_string();
    // The wait moved past the output view, to just before the GEMM reads the chunk.
    assert!(
        s.contains("    wait c0\n    linear(ag_chunk, w -> y_chunk)"),
        "{text}"
    );
    // ag only lives one iteration at a time: a ring of 2 slots replaces it.
    assert!(s.contains("tensor ag_ring: bf16[32, 32]"), "{text}");
    assert!(!s.contains("tensor ag:"), "{text}");
    insta::assert_snapshot!(text);
}

#[test]
fn per_iteration_temporaries_are_double_buffered() {
    // An all-gather of an inner axis per stream chunk: its permute temporaries live one
    // iteration and become rings.
    let (mut b, m) = common::builder("staged", 2);
    let x = b.input("x", DType::F32, &[8, 8], m).unwrap();
    b.schedule(x)
        .outer_split(0, 4)
        .parallelize(0, Stream)
        .outer_split(2, 2)
        .parallelize(2, DIDx);
    let y = b.set(x).unwrap();
    b.rename(y, "y").unwrap();
    b.schedule(y).outer_split(0, 4).parallelize(0, Stream);
    let z = b.gelu(y).unwrap();
    b.rename(z, "z").unwrap();
    b.output(z);
    let h = common::lower_full(&b.build().unwrap());
    let s = h.to_string();
    assert!(s.contains("x_chunk_perm_ring"), "{s}");
    assert!(s.contains("y_chunk_perm_ring"), "{s}");
    meshflow_ir::verify_host(&h).unwrap();
    insta::assert_snapshot!(s);
}

#[test]
fn defer_waits_moves_neighbouring_waits_once() {
    // Two waits side by side that nothing blocks up to the end of the block: each moves once
    // (a front-to-back pass used to swap them forever).
    let h = meshflow_ir::parse_host(
        "host adjacent {
  mesh m0 = [0, 1]
  in x: f32[4] on m0
  out y: f32[4] on m0
  out z: f32[4] on m0
  out u: f32[4] on m0
  c0 = collective_permute(x -> y, team=slice(m0, DIDx), send=(my(m0, DIDx) + 1) % 2, recv=(my(m0, DIDx) + 1) % 2)
  c1 = collective_permute(x -> z, team=slice(m0, DIDx), send=my(m0, DIDx), recv=my(m0, DIDx))
  wait c0
  wait c1
  gelu(x -> u)
}
",
    )
    .unwrap();
    let p = ring(2);
    let (text, out) = host_pass(&h, &DeferWaits, &p);
    let s = out.to_string();
    assert!(
        s.contains("  gelu(x -> u)\n  wait c1\n  wait c0\n}"),
        "{text}"
    );
}
