//! Unsupported input: an error that names the tensor (or op) and the reason, never a panic.

mod common;

use meshflow_ir::{DType, DeviceMesh, ParallelType::*, Program, ProgramBuilder};
use meshflow_passes::PassError;

fn lower_err(p: &Program) -> String {
    match common::run(p, common::all_passes()) {
        Ok(out) => panic!("expected an error, got:\n{}", out.host),
        Err(e) => e.to_string(),
    }
}

fn lower_ok(p: &Program) -> meshflow_ir::HostProgram {
    match common::run(p, common::all_passes()) {
        Ok(out) => out.host,
        Err(e) => panic!("expected a lowering, got: {e}"),
    }
}

fn comm_names(host: &meshflow_ir::HostProgram) -> Vec<String> {
    let mut out = Vec::new();
    host.walk(&mut |i, _| {
        if i.kind.is_communication() {
            out.push(i.kind.name().to_string());
        }
    });
    out
}

#[test]
fn a_stream_gather_with_fewer_chunks_than_members_gathers_first() {
    // Two stream chunks cannot each come from one of four members: the tensor is gathered
    // whole, then copied chunk by chunk.
    let (mut b, m) = common::builder("bad", 4);
    let x = b.input("x", DType::F32, &[16, 4], m).unwrap();
    b.schedule(x).outer_split(0, 4).parallelize(0, DIDx);
    let ag = b.set(x).unwrap();
    b.rename(ag, "ag").unwrap();
    b.schedule(ag).outer_split(0, 2).parallelize(0, Stream);
    b.output(ag);
    assert_eq!(
        comm_names(&lower_ok(&b.build().unwrap())),
        vec!["all_gather"]
    );
}

#[test]
fn a_swizzle_along_another_type_gathers_first() {
    let mut b = ProgramBuilder::new("bad");
    let m = b
        .mesh("m", DeviceMesh::iota(vec![2, 2], 0).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[8, 4], m).unwrap();
    b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
    let ag = b.set(x).unwrap();
    b.rename(ag, "ag").unwrap();
    b.schedule(ag)
        .outer_split(0, 2)
        .swizzle1d(0, DIDy)
        .parallelize(0, Stream);
    b.output(ag);
    assert_eq!(
        comm_names(&lower_ok(&b.build().unwrap())),
        vec!["all_gather"]
    );
}

#[test]
fn inner_device_splits_name_the_tensor() {
    let (mut b, m) = common::builder("bad", 2);
    // A split inside serial pieces of an axis they do not divide (strided and uneven).
    let x = b.input("x", DType::F32, &[7, 4], m).unwrap();
    b.schedule(x)
        .outer_split(0, 3)
        .outer_split(1, 2)
        .parallelize(1, DIDx);
    let y = b.gelu(x).unwrap();
    b.output(y);
    let e = lower_err(&b.build().unwrap());
    assert!(
        e.starts_with("tensor `x`") && e.contains("inside a serial piece"),
        "{e}"
    );
}

#[test]
fn moe_dispatch_needs_experts_split_over_the_team() {
    let (mut b, m) = common::builder("moe", 2);
    let x = b.input("x", DType::F32, &[4, 8], m).unwrap();
    let idx = b.input("topk_idx", DType::I32, &[4, 2], m).unwrap();
    b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
    b.schedule(idx).outer_split(0, 2).parallelize(0, DIDx);
    let (ex, counts, routing) = b.moe_dispatch(x, idx, 4, 8).unwrap();
    b.rename(ex, "expert_x").unwrap();
    b.replicate(ex);
    b.output(ex);
    b.output(counts);
    b.output(routing);
    let e = lower_err(&b.build().unwrap());
    assert!(
        e.contains("tensor `expert_x`") && e.contains("expert axis"),
        "{e}"
    );
}

#[test]
fn moe_tensors_cannot_be_streamed() {
    let (mut b, m) = common::builder("moe", 2);
    let x = b.input("x", DType::F32, &[4, 8], m).unwrap();
    let idx = b.input("topk_idx", DType::I32, &[4, 2], m).unwrap();
    b.schedule(x)
        .outer_split(0, 2)
        .parallelize(0, DIDx)
        .outer_split(1, 2)
        .parallelize(1, Stream);
    b.schedule(idx).outer_split(0, 2).parallelize(0, DIDx);
    let (ex, _, _) = b.moe_dispatch(x, idx, 4, 8).unwrap();
    b.schedule(ex).outer_split(0, 2).parallelize(0, DIDx);
    b.output(ex);
    let e = lower_err(&b.build().unwrap());
    assert!(e.contains("tensor `x`") && e.contains("Stream"), "{e}");
}

#[test]
fn overlapping_meshes_send_between_devices_and_copy_in_place() {
    // a = [0, 1] -> b = [0, 2]: device 0 keeps its shard (a local copy that only device 0
    // runs), device 1 sends its shard to device 2.
    let mut b = ProgramBuilder::new("overlap");
    let ma = b.mesh("a", DeviceMesh::iota(vec![2], 0).unwrap()).unwrap();
    let mb = b
        .mesh("b", DeviceMesh::new(vec![2], vec![0, 2]).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[4, 4], ma).unwrap();
    b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
    let y = b.set(x).unwrap();
    b.rename(y, "y").unwrap();
    b.place(y, mb);
    b.schedule(y).outer_split(0, 2).parallelize(0, DIDx);
    b.output(y);
    let host = lower_ok(&b.build().unwrap());
    assert_eq!(comm_names(&host), vec!["send_recv", "collective_permute"]);
    let text = host.to_string();
    assert!(text.contains("team=devices(1, 2)"), "{text}");
    assert!(text.contains("team=devices(0), send=0, recv=0"), "{text}");
}

#[test]
fn lowering_without_decomposition_reports_the_resharding_op() {
    let (mut b, m) = common::builder("cp", 2);
    let x = b.input("x", DType::F32, &[8, 4], m).unwrap();
    let w = b.input("w", DType::F32, &[6, 4], m).unwrap();
    b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, 2).parallelize(0, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    let p = b.build().unwrap();
    let options = meshflow_passes::PassOptions {
        disabled_passes: vec!["decompose_reshardings".into()],
        ..common::verifying()
    };
    let e = common::all_passes().run(p.clone(), &options).unwrap_err();
    assert!(matches!(e, PassError::UnsupportedOp { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("`y = linear(x, w)`") && text.contains("input `x`"),
        "{text}"
    );
}
