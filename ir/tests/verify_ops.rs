//! Verifier and parser tests of the shape ops, `max`/`min`/`avg`, `softmax`, `rms_norm`,
//! broadcasting `matmul` and partial placements, at both levels: each error names the op
//! (with its tensors) or the tensor, and its location.

mod common;

use common::{expect_diag, host_errors, host_text, program_errors, program_text};
use meshflow_ir::{parse_host, parse_program, verify_host, verify_program};

const MESH: &str = "mesh m0 = [0, 1]";

fn verifies(lines: &[&str]) {
    let text = program_text(lines);
    let p = parse_program(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    verify_program(&p).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(p.to_string(), text, "canonical text round-trips");
}

#[test]
fn every_new_op_verifies_and_prints_back() {
    verifies(&[
        MESH,
        "input x: f32[2, 8, 24] on m0",
        "input w: f32[24] on m0",
        "input p: f32[2, 8, r4] on m0 {outer_split(2, 2), parallelize(2, DIDx)}",
        "input b: f32[1, 24, 6] on m0",
        "tensor q: f32[2, 8, 6, 4] on m0",
        "tensor v: f32[2, 192] on m0",
        "tensor t: f32[2, 6, 8, 4] on m0",
        "tensor e: f32[3, 2, 8, 24] on m0",
        "tensor u: f32[2, 1, 8, 24] on m0",
        "tensor s: f32[2, 8, 24] on m0",
        "tensor sl: f32[2, 3, 24] on m0",
        "tensor se: f32[2, 24] on m0",
        "tensor c: f32[2, 11, 24] on m0",
        "tensor mx: f32[2, r8, 24] on m0",
        "tensor mn: f32[r2, 8, 24] on m0",
        "tensor av: f32[2, 8, r24] on m0",
        "tensor sm: f32[2, 8, 24] on m0",
        "tensor n: f32[2, 8, 24] on m0",
        "tensor mm: f32[2, 8, 6, r24] on m0",
        "tensor pp: f32[2, 8, r4] on m0 {outer_split(2, 2), parallelize(2, DIDx)}",
        "q = reshape(x)",
        "v = view(x)",
        "t = permute(q, perm=[0, 2, 1, 3])",
        "e = expand(x)",
        "u = unsqueeze(x, axis=1)",
        "s = squeeze(u, axis=1)",
        "sl = slice(s, axis=1, start=2, end=5)",
        "se = select(s, axis=1, index=7)",
        "c = cat(s, sl, axis=1)",
        "mx = max(x, axis=1)",
        "mn = min(x, axis=0)",
        "av = avg(x, axis=2)",
        "sm = softmax(x, axis=2)",
        "n = rms_norm(x, w, axis=2, eps=1e-5)",
        "mm = matmul(x, b)",
        "pp = set(p)",
        "output t, v, e, c, se, mx, mn, av, sm, n, mm, pp",
    ]);
}

#[test]
fn shape_op_errors_name_the_op() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "tensor y: f32[5, 5] on m0",
            "y = reshape(x)",
            "`y = reshape(x)`: reshape: cannot reshape [4, 6] into [5, 5]: the element counts differ",
        ),
        (
            "tensor y: f32[6, 4] on m0",
            "y = permute(x, perm=[0, 0])",
            "`y = permute(x)`: permute: perm [0, 0] is not a permutation of the 2 axes of [4, 6]",
        ),
        (
            "tensor y: f32[4, 12] on m0",
            "y = expand(x)",
            "cannot expand [4, 6] to [4, 12]",
        ),
        (
            "tensor y: f32[6] on m0",
            "y = squeeze(x, axis=0)",
            "axis 0 of [4, 6] has extent 4; only an axis of extent 1 can be squeezed",
        ),
        (
            "tensor y: f32[4, 6] on m0",
            "y = slice(x, axis=1, start=4, end=8)",
            "slice 4..8 of axis 1 (extent 6) is empty or out of range",
        ),
        (
            "tensor y: f32[4] on m0",
            "y = select(x, axis=1, index=6)",
            "index 6 is out of range for axis 1 of extent 6",
        ),
        (
            "tensor y: f32[4, 6] on m0",
            "y = softmax(x, axis=2)",
            "axis 2 is out of range for shape [4, 6]",
        ),
    ];
    for (decl, op, message) in cases {
        let text = program_text(&[MESH, "input x: f32[4, 6] on m0", decl, op]);
        expect_diag(&program_errors(&text), message, 5, 3);
    }
}

#[test]
fn cat_rms_norm_and_matmul_check_their_operands() {
    let text = program_text(&[
        MESH,
        "input a: f32[4, 6] on m0",
        "input b: f32[5, 6] on m0",
        "input w: f32[4] on m0",
        "input c: f32[3, 6, 2] on m0",
        "tensor y: f32[9, 6] on m0",
        "tensor z: f32[4, 6] on m0",
        "tensor m: f32[3, 4, 2, r6] on m0",
        "y = cat(a, b, axis=1)",
        "z = rms_norm(a, w, axis=1)",
        "m = matmul(a, c)",
    ]);
    let diags = program_errors(&text);
    expect_diag(
        &diags,
        "`y = cat(a, b)`: cat: input #1 has shape [5, 6] but input #0 has [4, 6]; they may differ only along axis 1",
        10,
        3,
    );
    expect_diag(
        &diags,
        "`z = rms_norm(a, w)`: rms_norm: the weight must have shape [6] (the extent of axis 1), has [4]",
        11,
        3,
    );
    let text = program_text(&[
        MESH,
        "input a: f32[2, 4, 6] on m0",
        "input c: f32[3, 6, 2] on m0",
        "tensor m: f32[3, 4, 2, r6] on m0",
        "m = matmul(a, c)",
    ]);
    expect_diag(
        &program_errors(&text),
        "batch axes [2] and [3] do not broadcast",
        6,
        3,
    );
}

#[test]
fn a_set_cannot_create_partial_results() {
    let text = program_text(&[
        MESH,
        "input x: f32[4, 6] on m0",
        "tensor y: f32[4, 6, r2] on m0 {outer_split(2, 2), parallelize(2, DIDx)}",
        "y = set(x)",
    ]);
    expect_diag(
        &program_errors(&text),
        "a set keeps partial results (same reduction axes) or reduces them (none), it cannot create them (Replicate -> Partial is refused, as in DTensor)",
        5,
        3,
    );
}

#[test]
fn bad_attributes_are_parse_errors() {
    for (op, message) in [
        ("y = softmax(x)", "`softmax` needs `axis=`"),
        ("y = slice(x, axis=0, start=1)", "`slice` needs `end=`"),
        (
            "y = rms_norm(x, w, axis=0, eps=0.0)",
            "`eps` must be a positive, finite float",
        ),
        (
            "y = rms_norm(x, w, axis=0, eps=x)",
            "expected a float literal such as `1e-6`",
        ),
        ("y = permute(x)", "`permute` needs `perm=[..]`"),
        (
            "y = reshape(x, axis=1)",
            "`reshape` takes no attribute `axis`",
        ),
        (
            "y = cat(x, axis=0, kernel=\"k\")",
            "unknown attribute `kernel` of `cat` (expected `axis`)",
        ),
    ] {
        let text = program_text(&[
            MESH,
            "input x: f32[4] on m0",
            "input w: f32[4] on m0",
            "tensor y: f32[4] on m0",
            op,
        ]);
        let e = parse_program(&text).expect_err(op);
        assert!(e.message.contains(message), "{op}: {}", e.message);
    }
}

#[test]
fn host_compute_ops_check_shapes() {
    let base = [
        MESH,
        "in x: f32[4, 6] on m0",
        "in w: f32[6] on m0",
        "out y: f32[4, 6] on m0",
        "out r: f32[4] on m0",
        "out z: f32[8, 6] on m0",
    ];
    let ok = |body: &str| {
        let mut lines = base.to_vec();
        lines.push(body);
        let text = host_text(&lines);
        let p = parse_host(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        verify_host(&p).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(p.to_string(), text);
    };
    ok("max(x -> r, axis=1)");
    ok("avg(x -> r, axis=1)");
    ok("softmax(x -> y, axis=0)");
    ok("rms_norm(x, w -> y, axis=1, eps=1e-6)");
    ok("cat(x, x -> z, axis=0)");
    ok("slice(z -> y, axis=0, start=4)");
    ok("expand(w -> y)");
    for (body, message) in [
        (
            "max(x -> y, axis=1)",
            "output `y` must have shape [4], has [4, 6]",
        ),
        (
            "softmax(x -> r, axis=0)",
            "output `r` must have shape [4, 6], has [4]",
        ),
        (
            "rms_norm(x, w -> y, axis=0, eps=1e-6)",
            "the weight `w` must have shape [4] (axis 0 of `x`), has [6]",
        ),
        (
            "slice(z -> y, axis=0, start=5)",
            "slice 5..5+4 is out of range for axis 0 of `z` (extent 8)",
        ),
        (
            "cat(x, w -> z, axis=0)",
            "`w` of shape [6] and `x` of shape [4, 6] differ along an axis other than 0",
        ),
        (
            "expand(x -> z)",
            "`x` of shape [4, 6] does not expand to `z` of shape [8, 6]",
        ),
    ] {
        let mut lines = base.to_vec();
        lines.push(body);
        expect_diag(&host_errors(&host_text(&lines)), message, 8, 3);
    }
}

#[test]
fn pointwise_ops_may_keep_partial_sums() {
    verifies(&[
        MESH,
        "input a: f32[4, r2] on m0 {outer_split(1, 2), parallelize(1, DIDx)}",
        "input b: f32[4, r2] on m0 {outer_split(1, 2), parallelize(1, DIDx)}",
        "input w: f32[4] on m0",
        "tensor s: f32[4, r2] on m0 {outer_split(1, 2), parallelize(1, DIDx)}",
        "tensor p: f32[4, r2] on m0 {outer_split(1, 2), parallelize(1, DIDx)}",
        "s = add(a, b)",
        "p = mul(w, s)",
        "output p",
    ]);
    let text = program_text(&[
        MESH,
        "input a: f32[4, r2] on m0",
        "input b: f32[4, r2] on m0",
        "tensor p: f32[4, r2] on m0",
        "p = mul(a, b)",
    ]);
    expect_diag(
        &program_errors(&text),
        "`mul` keeps partial sums only for one input with exactly those reduction axes and one with none",
        6,
        3,
    );
}
