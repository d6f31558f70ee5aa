//! Level-1 verifier negative tests: each program comes from text and each test asserts the
//! message and the location of the reported error.

mod common;

use common::{expect_diag, program_errors, program_text};
use meshflow_ir::{parse_program, verify_program};

const MESH: &str = "mesh m0 = [0, 1, 2, 3]";
const X: &str = "input x: f32[64, 32] on m0 {outer_split(0, 4), parallelize(0, DIDx)}";
const W: &str = "input w: f32[48, 32] on m0 {outer_split(0, 4), parallelize(0, DIDx)}";

#[test]
fn a_valid_program_verifies() {
    let text = program_text(&[
        MESH,
        X,
        W,
        "tensor ag: f32[64, 32] on m0 {}",
        "tensor y: f32[64, 48, r32] on m0",
        "ag = set(x)",
        "y = linear(ag, w)",
        "output y",
    ]);
    let p = parse_program(&text).expect("parses");
    verify_program(&p).expect("verifies");
}

#[test]
fn keyword_as_tensor_name() {
    let text = program_text(&[
        MESH,
        X,
        "tensor output: f32[64, 32] on m0",
        "output = set(x)",
    ]);
    expect_diag(
        &program_errors(&text),
        "`output` is a keyword and cannot name a tensor",
        4,
        3,
    );
}

#[test]
fn name_shared_by_a_mesh_and_a_tensor() {
    let text = program_text(&[MESH, X, "tensor m0: f32[64, 32] on m0", "m0 = set(x)"]);
    expect_diag(
        &program_errors(&text),
        "name `m0` is already used by mesh `m0` (declared at 2:3)",
        4,
        3,
    );
}

#[test]
fn read_before_definition() {
    let text = program_text(&[
        MESH,
        X,
        "tensor a: f32[64, 32] on m0",
        "tensor b: f32[64, 32] on m0",
        "b = gelu(a)",
        "a = gelu(x)",
        "output b",
    ]);
    expect_diag(
        &program_errors(&text),
        "`b = gelu(a)` reads `a` before it is defined (by op #1)",
        6,
        3,
    );
}

#[test]
fn tensor_defined_twice() {
    let text = program_text(&[
        MESH,
        X,
        "tensor a: f32[64, 32] on m0",
        "a = gelu(x)",
        "a = silu(x)",
    ]);
    expect_diag(
        &program_errors(&text),
        "`a` is already defined by op #0",
        6,
        3,
    );
}

#[test]
fn input_defined_by_an_op() {
    let text = program_text(&[MESH, X, "input z: f32[64, 32] on m0", "z = gelu(x)"]);
    expect_diag(
        &program_errors(&text),
        "`z` is a program input and cannot be defined by an op",
        5,
        3,
    );
}

#[test]
fn tensor_neither_input_nor_defined() {
    let text = program_text(&[MESH, X, "tensor t: f32[64, 32] on m0", "output t"]);
    expect_diag(
        &program_errors(&text),
        "tensor `t` is neither a program input nor defined by an op",
        4,
        3,
    );
}

#[test]
fn wrong_arity() {
    let text = program_text(&[MESH, X, "tensor y: f32[64, 32] on m0", "y = add(x)"]);
    expect_diag(
        &program_errors(&text),
        "`add` takes 2 inputs and produces 1 output, but `y = add(x)` has 1 input and 1 output",
        5,
        3,
    );
}

#[test]
fn declared_type_differs_from_inferred() {
    let text = program_text(&[
        MESH,
        X,
        W,
        "tensor y: f32[64, 48] on m0",
        "y = linear(x, w)",
    ]);
    expect_diag(
        &program_errors(&text),
        "output `y` is declared f32[64, 48] but `linear` produces f32[64, 48, r32]",
        6,
        3,
    );
}

#[test]
fn inputs_that_do_not_fit() {
    let text = program_text(&[
        MESH,
        X,
        "input w: f32[48, 16] on m0",
        "tensor y: f32[64, 48, r32] on m0",
        "y = linear(x, w)",
    ]);
    expect_diag(
        &program_errors(&text),
        "`y = linear(x, w)`: linear: contraction extents differ: [64, 32] has K=32, [48, 16] has K=16",
        6,
        3,
    );
}

#[test]
fn an_input_may_hold_partial_sums() {
    let text = program_text(&[
        MESH,
        "input x: f32[64, r4] on m0 {outer_split(1, 4), parallelize(1, DIDx)}",
        "tensor y: f32[64] on m0",
        "y = set(x)",
        "output y",
    ]);
    verify_program(&parse_program(&text).expect("parses")).expect("verifies");
}

#[test]
fn schedule_does_not_replay() {
    // An outer split cuts unevenly by the chunk rule; an inner split must divide.
    let text = program_text(&[MESH, "input x: f32[64, 32] on m0 {inner_split(0, 3)}"]);
    expect_diag(
        &program_errors(&text),
        "schedule of `x`: transform #0 `inner_split(0, 3)`: extent 64 is not divisible by 3",
        3,
        3,
    );
}

#[test]
fn device_type_missing_from_the_mesh() {
    let text = program_text(&[
        MESH,
        "input x: f32[64, 32] on m0 {outer_split(0, 4), parallelize(0, DIDy)}",
    ]);
    expect_diag(
        &program_errors(&text),
        "DIDy used on `x` but mesh `m0` has 1 axis",
        3,
        3,
    );
}

#[test]
fn device_split_extent_differs_from_the_mesh() {
    let text = program_text(&[
        MESH,
        "input x: f32[64, 32] on m0 {outer_split(0, 2), parallelize(0, DIDx)}",
    ]);
    expect_diag(
        &program_errors(&text),
        "loop axis 0 of `x` is parallelized DIDx with extent 2, but mesh `m0` has 4 devices along DIDx",
        3,
        3,
    );
}

#[test]
fn mesh_axis_used_twice() {
    let text = program_text(&[
        MESH,
        "input x: f32[64, 32] on m0 {outer_split(0, 4), parallelize(0, DIDx), outer_split(2, 4), parallelize(2, DIDx)}",
    ]);
    expect_diag(
        &program_errors(&text),
        "parallel type DIDx is used on loop axes 0 and 2 of `x` (mesh axis 0 used twice)",
        3,
        3,
    );
}

#[test]
fn swizzle_on_a_serial_axis() {
    let text = program_text(&[
        MESH,
        "input x: f32[64, 32] on m0 {outer_split(0, 4), swizzle1d(0, DIDx)}",
    ]);
    expect_diag(
        &program_errors(&text),
        "loop axis 0 of `x` is swizzled along DIDx but is parallelized Serial; swizzle1d needs a Stream-parallel axis",
        3,
        3,
    );
}

#[test]
fn swizzle_extent_differs_from_the_team() {
    let text = program_text(&[
        MESH,
        X,
        "tensor ag: f32[64, 32] on m0 {outer_split(0, 2), swizzle1d(0, DIDx), parallelize(0, Stream)}",
        "ag = set(x)",
    ]);
    expect_diag(
        &program_errors(&text),
        "swizzled loop axis 0 of `ag` has extent 2, but the team along DIDx has 4 devices",
        4,
        3,
    );
}

#[test]
fn swizzle_type_missing_from_the_mesh() {
    let text = program_text(&[
        MESH,
        X,
        "tensor ag: f32[64, 32] on m0 {outer_split(0, 4), swizzle1d(0, DIDy), parallelize(0, Stream)}",
        "ag = set(x)",
    ]);
    expect_diag(
        &program_errors(&text),
        "swizzle1d along DIDy on `ag` but mesh `m0` has 1 axis",
        4,
        3,
    );
}

#[test]
fn parallel_merged_axis_has_no_layout() {
    let text = program_text(&[
        MESH,
        "input x: f32[64, 32] on m0 {merge(0), parallelize(0, Stream)}",
    ]);
    expect_diag(
        &program_errors(&text),
        "layout of `x`: loop axis 0 is parallelized Stream but is derived from a merge",
        3,
        3,
    );
}

#[test]
fn op_inputs_may_live_on_other_meshes() {
    let text = program_text(&[
        MESH,
        "mesh m1 = [4, 5]",
        "input a: f32[8] on m0",
        "input b: f32[8] on m1",
        "tensor c: f32[8] on m0",
        "c = add(a, b)",
        "output c",
    ]);
    verify_program(&parse_program(&text).expect("parses")).expect("verifies");
}

#[test]
fn op_outputs_on_two_meshes() {
    let text = program_text(&[
        MESH,
        "mesh m1 = [4, 5]",
        "input x: f32[6, 16] on m0",
        "input idx: i32[6, 2] on m0",
        "tensor ex: f32[2, 6, 16] on m0",
        "tensor counts: i32[2] on m1",
        "tensor routing: i32[2, 6, 2] on m0",
        "ex, counts, routing = moe_dispatch(x, idx)",
    ]);
    expect_diag(
        &program_errors(&text),
        "`moe_dispatch` mixes meshes among its outputs: `ex` is on `m0` but `counts` is on `m1`",
        9,
        3,
    );
}

#[test]
fn set_may_move_between_meshes() {
    let text = program_text(&[
        MESH,
        "mesh m1 = [4, 5]",
        "input a: f32[8] on m0",
        "tensor b: f32[8] on m1",
        "b = set(a)",
        "output b",
    ]);
    verify_program(&parse_program(&text).expect("parses")).expect("verifies");
}

#[test]
fn output_listed_twice() {
    let text = program_text(&[
        MESH,
        X,
        "tensor y: f32[64, 32] on m0",
        "y = gelu(x)",
        "output y, y",
    ]);
    expect_diag(&program_errors(&text), "output `y` is listed twice", 4, 3);
}

#[test]
fn every_error_is_reported() {
    let text = program_text(&[
        MESH,
        "input x: f32[64, r32] on m0 {inner_split(0, 3)}",
        "tensor a: f32[64, 32] on m0",
        "tensor unused: f32[4] on m0",
        "a = gelu(x)",
        "a = add(x)",
        "output a, a",
    ]);
    let diags = program_errors(&text);
    expect_diag(&diags, "schedule of `x`", 3, 3);
    expect_diag(&diags, "tensor `unused` is neither", 5, 3);
    expect_diag(
        &diags,
        "output `a` is declared f32[64, 32] but `gelu` produces f32[64]",
        6,
        3,
    );
    expect_diag(&diags, "`a` is already defined by op #0", 7, 3);
    expect_diag(&diags, "`add` takes 2 inputs", 7, 3);
    expect_diag(&diags, "output `a` is listed twice", 4, 3);
    assert!(diags.len() >= 6, "{diags:#?}");
}

/// Regression: a long name given through the API was echoed whole by every diagnostic that
/// names the tensor. Names are limited to 256 characters and messages show long tokens cut.
#[test]
fn long_names_are_rejected_and_not_echoed_whole() {
    let text = program_text(&[
        MESH,
        X,
        "tensor y: f32[64, 32] on m0",
        "y = gelu(x)",
        "output y",
    ]);
    let mut p = parse_program(&text).expect("parses");
    let long = "y".repeat(1 << 20);
    for (_, t) in p.tensors.iter_mut() {
        if t.name == "y" {
            t.name = long.clone();
        }
    }
    let errors = verify_program(&p).expect_err("the name is too long");
    let shown = errors.to_string();
    assert!(
        shown.contains("1048576 characters, longer than 256"),
        "{}",
        &shown[..200]
    );
    for line in shown.lines() {
        assert!(line.len() < 400, "{} bytes: {}", line.len(), &line[..200]);
    }
}

/// Regression: MoE argument errors (top-k beyond the experts, weights that do not match the
/// routing) were caught only when the program ran, not by `parse`, `lower` or `check`.
#[test]
fn moe_arguments() {
    let moe = |k: u64, wk: u64| {
        program_text(&[
            "mesh m0 = [0, 1]",
            "input x: f32[8, 16] on m0",
            &format!("input idx: i32[8, {k}] on m0"),
            &format!("input w: f32[8, {wk}] on m0"),
            "input we: f32[4, 16, 8] on m0",
            "tensor ex: f32[4, 8, 16] on m0",
            "tensor counts: i32[4] on m0",
            "tensor routing: i32[4, 8, 2] on m0",
            "tensor ey: f32[4, 8, 8, r16] on m0",
            "tensor y: f32[8, 8] on m0",
            "ex, counts, routing = moe_dispatch(x, idx)",
            "ey = grouped_matmul(ex, counts, we)",
            "y = moe_combine(ey, counts, routing, w)",
            "output y",
        ])
    };
    let ok = parse_program(&moe(2, 2)).expect("parses");
    verify_program(&ok).expect("verifies");
    expect_diag(
        &program_errors(&moe(5, 5)),
        "top-5 routing needs at least 5 experts, but expert_x declares E = 4",
        12,
        3,
    );
    expect_diag(
        &program_errors(&moe(2, 3)),
        "`moe_combine`: `w` must have the shape of `idx` ([8, 2]: one weight per token and \
         routed expert), has [8, 3]",
        14,
        3,
    );
}
