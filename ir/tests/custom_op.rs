//! The `custom` op: text round trip, parse errors, verifier errors and the builder.

mod common;

use common::{expect_diag, program_errors, program_text};
use meshflow_ir::{
    parse_program, parse_program_with, verify_program, CustomOp, DType, DeviceMesh, OpKind, Params,
    ProgramBuilder, TensorType,
};

const MESH: &str = "mesh m0 = [0, 1]";
const X: &str = "input x: f32[8, 6] on m0 {outer_split(1, 2), parallelize(1, DIDx)}";
const B: &str = "input b: f32[6] on m0";

fn custom(op: &meshflow_ir::Op) -> &CustomOp {
    match &op.kind {
        OpKind::Custom(c) => c,
        other => panic!("expected a custom op, got {other:?}"),
    }
}

#[test]
fn custom_parses_prints_and_verifies() {
    let text = program_text(&[
        "param k = 3",
        MESH,
        X,
        B,
        "tensor y: f32[8, 6] on m0",
        "tensor z: bf16[8, 6] on m0",
        "y, z = custom(x, b, kernel=\"bias_gelu\\n2\", args=[k, -1 - k, 0])",
        "output y, z",
    ]);
    let p = parse_program(&text).expect("parses");
    verify_program(&p).expect("verifies");
    let c = custom(&p.ops[0]);
    assert_eq!(c.kernel, "bias_gelu\n2");
    assert_eq!(c.args, vec![3, -4, 0]);
    assert_eq!((c.inputs, c.outputs), (2, 2));
    let printed = p.to_string();
    assert!(
        printed.contains("y, z = custom(x, b, kernel=\"bias_gelu\\n2\", args=[3, -4, 0])"),
        "{printed}"
    );
    assert_eq!(parse_program(&printed).expect("reparses"), p);
    // Parameters reach the args.
    let mut params = Params::new();
    params.insert("k".into(), 10);
    let p = parse_program_with(&text, &params).expect("parses");
    assert_eq!(custom(&p.ops[0]).args, vec![10, -11, 0]);
}

#[test]
fn custom_without_inputs_or_args_prints_minimally() {
    let text = program_text(&[
        MESH,
        "tensor y: i32[4] on m0",
        "y = custom(kernel=\"iota\")",
    ]);
    let p = parse_program(&text).expect("parses");
    verify_program(&p).expect("verifies");
    assert!(p.to_string().contains("y = custom(kernel=\"iota\")\n"));
}

#[test]
fn custom_parse_errors() {
    let cases = [
        ("y = custom(x)", "`custom` needs `kernel=\"NAME\"`"),
        ("y = custom(x, kernel=k)", "expected a kernel name string"),
        (
            "y = custom(x, kernel=\"k\", kernel=\"k\")",
            "`kernel` is given twice",
        ),
        (
            "y = custom(x, kernel=\"k\", axis=1)",
            "unknown attribute `axis` of `custom` (expected `kernel` or `args`)",
        ),
        ("y = custom(kernel=\"k\", x)", "attributes come last"),
        (
            "y = gelu(x, kernel=\"k\")",
            "`gelu` takes no attribute `kernel`",
        ),
    ];
    for (line, message) in cases {
        let text = program_text(&[MESH, X, "tensor y: f32[8, 6] on m0", line]);
        let e = parse_program(&text).expect_err(line);
        assert!(e.message.contains(message), "{line}: {}", e.message);
    }
}

#[test]
fn custom_verifier_errors() {
    let cases = [
        (
            "tensor y: f32[8, 5] on m0",
            "y = custom(x, kernel=\"k\")",
            "input #0 has shape [8, 6], which is not a suffix of the output shape [8, 5]",
        ),
        (
            "tensor y: f32[8, r6] on m0",
            "y = custom(x, kernel=\"k\")",
            "output #0 has a reduction axis",
        ),
        (
            "tensor y: f32[8, 6] on m0",
            "y = custom(x, kernel=\"\")",
            "the kernel name is empty",
        ),
    ];
    for (decl, op, message) in cases {
        let text = program_text(&[MESH, X, decl, op, "output y"]);
        expect_diag(&program_errors(&text), message, 5, 3);
    }
    let text = program_text(&[
        MESH,
        X,
        "tensor y: f32[8, 6] on m0",
        "tensor z: f32[6] on m0",
        "y, z = custom(x, kernel=\"k\")",
    ]);
    expect_diag(
        &program_errors(&text),
        "output #1 has shape [6] but output #0 has [8, 6]; every output has one shape",
        6,
        3,
    );
}

#[test]
fn builder_makes_custom_ops() {
    let mut b = ProgramBuilder::new("p");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![2], 0).expect("mesh"))
        .expect("mesh");
    let x = b.input("x", DType::F32, &[8, 6], m).expect("x");
    let bias = b.input("b", DType::F32, &[6], m).expect("b");
    let outs = b
        .custom(
            "bias_gelu",
            &[x, bias],
            &[TensorType::new(DType::F32, &[8, 6])],
            &[7],
        )
        .expect("custom");
    b.output(outs[0]);
    let p = b.build().expect("verifies");
    let c = custom(&p.ops[0]);
    assert_eq!(
        (c.kernel.as_str(), c.args.as_slice(), c.inputs, c.outputs),
        ("bias_gelu", &[7][..], 2, 1)
    );
    // An input that does not align with the output is refused at once.
    let mut b = ProgramBuilder::new("p");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![2], 0).expect("mesh"))
        .expect("mesh");
    let x = b.input("x", DType::F32, &[8, 6], m).expect("x");
    let e = b
        .custom("k", &[x], &[TensorType::new(DType::F32, &[6, 8])], &[])
        .expect_err("misaligned");
    assert!(e.to_string().contains("not a suffix"), "{e}");
    // Output types must be declared.
    let e = b.custom("k", &[x], &[], &[]).expect_err("no outputs");
    assert!(e.to_string().contains("at least one output"), "{e}");
}
