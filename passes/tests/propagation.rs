//! Sharding propagation: weights first, partial sums, Stream splits with swizzles, backward,
//! and never overwriting annotations.

mod common;

use meshflow_ir::{DType, ParallelType::*, Program, Transform};
use meshflow_passes::analysis::Sharding;
use meshflow_passes::passes::PropagateShardings;
use meshflow_passes::ProgramPass;

fn propagate(p: &Program) -> Program {
    let mut p = p.clone();
    let options = meshflow_passes::PassOptions::default();
    let mut cx = meshflow_passes::PassContext::new(&p, &options);
    PropagateShardings
        .run(&mut p, &mut cx)
        .expect("propagation succeeds");
    p
}

fn schedule(p: &Program, name: &str) -> String {
    let t = p.tensor_by_name(name).expect("tensor exists");
    match &p.tensors[t].schedule {
        None => "None".into(),
        Some(s) => s
            .iter()
            .map(Transform::to_string)
            .collect::<Vec<_>>()
            .join(", "),
    }
}

#[test]
fn linear_takes_the_weight_sharding_first() {
    // x split on M and w split on N, both along DIDx: y follows the weight (N), so the weight
    // is never redistributed and x must be gathered.
    let (mut b, m) = common::builder("p", 4);
    let x = b.input("x", DType::F32, &[16, 8], m).unwrap();
    let w = b.input("w", DType::F32, &[12, 8], m).unwrap();
    b.schedule(x).outer_split(0, 4).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, 4).parallelize(0, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    let p = propagate(&b.build().unwrap());
    assert_eq!(schedule(&p, "y"), "outer_split(1, 4), parallelize(1, DIDx)");
}

#[test]
fn contraction_split_gives_partial_sums() {
    let (mut b, m) = common::builder("p", 4);
    let x = b.input("x", DType::F32, &[16, 8], m).unwrap();
    let w = b.input("w", DType::F32, &[12, 8], m).unwrap();
    b.schedule(x).outer_split(1, 4).parallelize(1, DIDx);
    b.schedule(w).outer_split(1, 4).parallelize(1, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    let p = propagate(&b.build().unwrap());
    assert_eq!(schedule(&p, "y"), "outer_split(2, 4), parallelize(2, DIDx)");
    let y = p.tensor_by_name("y").unwrap();
    assert!(Sharding::of(&p, y).unwrap().is_partial_on(DIDx));
}

#[test]
fn annotations_are_never_overwritten() {
    let (mut b, m) = common::builder("p", 4);
    let x = b.input("x", DType::F32, &[16, 8], m).unwrap();
    b.schedule(x).outer_split(0, 4).parallelize(0, DIDx);
    let r = b.gelu(x).unwrap();
    b.rename(r, "replicated").unwrap();
    b.replicate(r); // explicitly replicated: `{}`
    let s = b.silu(r).unwrap();
    b.rename(s, "free").unwrap();
    let t = b.gelu(x).unwrap();
    b.rename(t, "annotated").unwrap();
    b.schedule(t).outer_split(1, 2).parallelize(1, Serial);
    b.output(s);
    b.output(t);
    let p = propagate(&b.build().unwrap());
    assert_eq!(schedule(&p, "replicated"), "");
    assert_eq!(
        p.tensors[p.tensor_by_name("replicated").unwrap()].schedule,
        Some(vec![])
    );
    assert_eq!(
        schedule(&p, "annotated"),
        "outer_split(1, 2), parallelize(1, Serial)"
    );
    assert_eq!(schedule(&p, "x"), "outer_split(0, 4), parallelize(0, DIDx)");
    // The unannotated silu follows its (replicated) input.
    assert_eq!(schedule(&p, "free"), "");
}

#[test]
fn stream_split_and_swizzle_propagate_with_device_splits_in_canonical_order() {
    let p = propagate(&meshflow_ir::Program::clone(&ring(4)));
    assert_eq!(
        schedule(&p, "y"),
        "outer_split(0, 4), swizzle1d(0, DIDx), parallelize(0, Stream), \
         outer_split(2, 4), parallelize(2, DIDx)"
    );
}

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

#[test]
fn backward_fills_unannotated_inputs() {
    // y is annotated with partial sums over K; the unannotated inputs get K split.
    let (mut b, m) = common::builder("p", 2);
    let x = b.input("x", DType::F32, &[4, 8], m).unwrap();
    let w = b.input("w", DType::F32, &[6, 8], m).unwrap();
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    b.schedule(y).outer_split(2, 2).parallelize(2, DIDx);
    b.output(y);
    let p = propagate(&b.build().unwrap());
    assert_eq!(schedule(&p, "x"), "outer_split(1, 2), parallelize(1, DIDx)");
    assert_eq!(schedule(&p, "w"), "outer_split(1, 2), parallelize(1, DIDx)");
}

#[test]
fn splits_that_do_not_fit_are_not_propagated() {
    // A DIDy split cannot land on a 1-D mesh, and a split must divide the axis.
    let mut b = meshflow_ir::ProgramBuilder::new("p");
    let m2 = b
        .mesh("m2", meshflow_ir::DeviceMesh::iota(vec![2, 2], 0).unwrap())
        .unwrap();
    let m1 = b
        .mesh("m1", meshflow_ir::DeviceMesh::iota(vec![3], 4).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[4, 6], m2).unwrap();
    b.schedule(x)
        .outer_split(0, 2)
        .parallelize(0, DIDy)
        .outer_split(2, 2)
        .parallelize(2, DIDx);
    let y = b.set(x).unwrap();
    b.rename(y, "y").unwrap();
    b.place(y, m1);
    b.output(y);
    let p = propagate(&b.build().unwrap());
    assert_eq!(schedule(&p, "y"), "");
}
