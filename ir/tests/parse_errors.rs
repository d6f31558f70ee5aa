//! Specific parse errors (message and line:col) and level-1 parameters.

mod common;

use common::{host_text, program_text};
use meshflow_ir::{parse_host, parse_program, parse_program_with, Params};

fn program_error(text: &str) -> (u32, u32, String) {
    let e = parse_program(text).expect_err("the text must not parse");
    (e.line, e.col, e.message)
}

fn host_error(text: &str) -> (u32, u32, String) {
    let e = parse_host(text).expect_err("the text must not parse");
    (e.line, e.col, e.message)
}

fn assert_error(got: (u32, u32, String), line: u32, col: u32, message: &str) {
    assert_eq!((got.0, got.1), (line, col), "{}", got.2);
    assert!(
        got.2.contains(message),
        "message {:?} lacks {message:?}",
        got.2
    );
}

const MESH: &str = "mesh m0 = [0, 1, 2, 3]";
const X: &str = "input x: f32[64, 32] on m0";

#[test]
fn missing_closing_paren() {
    let text = program_text(&[
        MESH,
        X,
        "tensor y: f32[64] on m0",
        "y = sum(x, axis=1",
        "output y",
    ]);
    assert_error(program_error(&text), 6, 3, "expected `)`, found `output`");
}

#[test]
fn double_comma_in_schedule() {
    let text = program_text(&[
        MESH,
        "input x: f32[64] on m0 {outer_split(0, 4),, merge(0)}",
    ]);
    assert_error(
        program_error(&text),
        3,
        45,
        "expected a transform, found `,`",
    );
}

#[test]
fn unknown_tensor() {
    let text = program_text(&[MESH, X, "tensor y: f32[64, 32] on m0", "y = gelu(q)"]);
    assert_error(program_error(&text), 5, 12, "unknown tensor `q`");
}

#[test]
fn duplicate_tensor() {
    let text = program_text(&[MESH, X, "tensor x: f32[4] on m0"]);
    assert_error(
        program_error(&text),
        4,
        10,
        "duplicate tensor `x` (first declared at 3:9)",
    );
}

#[test]
fn unknown_mesh_dtype_op_and_parallel_type() {
    let unknown_mesh = program_text(&["input x: f32[4] on m9"]);
    assert_error(program_error(&unknown_mesh), 2, 22, "unknown mesh `m9`");
    let unknown_dtype = program_text(&[MESH, "input x: f8[4] on m0"]);
    assert_error(
        program_error(&unknown_dtype),
        3,
        12,
        "unknown dtype `f8` (expected one of f32, bf16, f16, i32, i64)",
    );
    let unknown_op = program_text(&[MESH, X, "tensor y: f32[64, 32] on m0", "y = relu(x)"]);
    assert_error(program_error(&unknown_op), 5, 7, "unknown op `relu`");
    let unknown_pt = program_text(&[MESH, "input x: f32[64] on m0 {parallelize(0, DIDw)}"]);
    assert_error(
        program_error(&unknown_pt),
        3,
        42,
        "unknown parallel type `DIDw`",
    );
}

#[test]
fn sum_needs_its_axis() {
    let text = program_text(&[MESH, X, "tensor y: f32[64, r32] on m0", "y = sum(x)"]);
    assert_error(program_error(&text), 5, 12, "`sum` needs `axis=`");
}

#[test]
fn unknown_parameter() {
    let text = program_text(&["param d = 4", "mesh m0 = iota(q)"]);
    assert_error(
        program_error(&text),
        3,
        18,
        "unknown parameter `q` (declared: d)",
    );
}

#[test]
fn division_by_zero_names_the_parameter() {
    let text = program_text(&["param z = 0", MESH, "input x: f32[4 / z] on m0"]);
    assert_error(program_error(&text), 4, 18, "division by zero (z = 0)");
}

#[test]
fn extent_must_be_positive() {
    let text = program_text(&["param d = 4", MESH, "input x: f32[d - 4, 4] on m0"]);
    assert_error(
        program_error(&text),
        4,
        16,
        "the extent of axis 0 of `x` must be positive, got 0 (d = 4)",
    );
    let reduction = program_text(&[MESH, "tensor x: f32[4, r0] on m0"]);
    assert_error(
        program_error(&reduction),
        3,
        20,
        "the extent of axis 1 of `x` must be positive, got 0",
    );
}

#[test]
fn mesh_errors() {
    let ragged = program_text(&["mesh m = [[0, 1], [2]]"]);
    assert_error(
        program_error(&ragged),
        2,
        21,
        "mesh `m` is not rectangular: this row has shape [1], the first has [2]",
    );
    let duplicate = program_text(&["mesh m = [0, 1, 1]"]);
    assert_error(
        program_error(&duplicate),
        2,
        19,
        "device 1 appears more than once in mesh `m` (first at 2:16)",
    );
    let empty = program_text(&["mesh m = []"]);
    assert_error(program_error(&empty), 2, 12, "mesh `m` has no devices");
    let iota = program_text(&["param d = 2", "mesh m = iota(d, d - 2, start=1)"]);
    assert_error(
        program_error(&iota),
        3,
        20,
        "mesh `m`: iota(2, 0) has no devices (d = 2)",
    );
}

#[test]
fn expressions_nested_too_deeply() {
    let deep = format!("mesh m = [{}0{}]", "(".repeat(200), ")".repeat(200));
    let text = program_text(&[&deep]);
    let (line, _, message) = program_error(&text);
    assert_eq!(line, 2);
    assert!(message.contains("nested too deeply"), "{message}");
    let long = format!("mesh m = [{}]", vec!["1"; 1100].join(" + "));
    let (_, _, message) = program_error(&program_text(&[&long]));
    assert!(message.contains("expression is too long"), "{message}");
}

/// Regression: the nesting limit counted the terms of a flat sum (its left-deep tree), so a
/// 65-term sum was "nested too deeply". Nesting counts parentheses and negations; a flat sum
/// may have hundreds of terms.
#[test]
fn flat_sums_are_not_nesting() {
    for terms in [65, 500] {
        let sum = vec!["1"; terms].join(" + ");
        let text = program_text(&["param d = 4", &format!("param n = {sum} - d")]);
        parse_program(&text).unwrap_or_else(|e| panic!("{terms} terms: {e}"));
        let host = host_text(&[&format!("for i0 in 0..{sum} {{"), "}"]);
        parse_host(&host).unwrap_or_else(|e| panic!("{terms} terms: {e}"));
    }
    let deep = format!("param n = {}1{}", "(".repeat(65), ")".repeat(65));
    let (_, _, message) = program_error(&program_text(&[&deep]));
    assert!(message.contains("nested too deeply"), "{message}");
}

/// Regression: a 10 MB identifier was echoed whole in the error message.
#[test]
fn long_tokens_are_not_echoed_whole() {
    let name = "x".repeat(10 << 20);
    let text = program_text(&[&format!("input {name}: f32[4] on m0")]);
    let e = parse_program(&text).expect_err("too long");
    let shown = e.to_string();
    assert!(
        shown.len() < 300,
        "{} bytes: {}",
        shown.len(),
        &shown[..300]
    );
    assert!(shown.contains("10485760 characters"), "{shown}");
    assert!(shown.contains("at most 256"), "{shown}");
    let host = format!(
        "host {name} {{
}}
"
    );
    let shown = parse_host(&host).expect_err("too long").to_string();
    assert!(shown.len() < 300, "{}", shown.len());
    let kernel = host_text(&[&format!(
        "call_kernel(x -> y, kernel=\"{}\", args=[])",
        "k".repeat(1 << 20)
    )]);
    let shown = parse_host(&kernel).expect_err("too long").to_string();
    assert!(shown.len() < 300, "{}", shown.len());
    // A parameter override named on the command line is shortened too.
    let params: Params = [(name.clone(), 1)].into();
    let shown = parse_program_with(&program_text(&[]), &params)
        .expect_err("undeclared")
        .to_string();
    assert!(shown.len() < 300, "{}", shown.len());
}

#[test]
fn trailing_text_and_bad_characters() {
    assert_error(
        program_error("program p {\n}\nextra"),
        3,
        1,
        "expected end of input, found `extra`",
    );
    assert_error(
        program_error("program p {\n  mesh m = [0 @ 1]\n}\n"),
        2,
        15,
        "unexpected character `@`",
    );
    assert_error(
        program_error("program p {\n  mesh m = [0, 1]\n"),
        3,
        1,
        "found end of input",
    );
}

const HOST_DECLS: [&str; 3] = [
    "mesh m0 = [0, 1, 2, 3]",
    "in x: f32[8] on m0",
    "out y: f32[8] on m0",
];

fn host(body: &[&str]) -> String {
    let mut lines = HOST_DECLS.to_vec();
    lines.extend_from_slice(body);
    host_text(&lines)
}

#[test]
fn host_unknown_instruction_and_tensor() {
    assert_error(
        host_error(&host(&["c0 = all_gatherr(x -> y, team=mesh(m0))"])),
        5,
        8,
        "unknown instruction `all_gatherr`",
    );
    assert_error(
        host_error(&host(&["relu(x -> y)"])),
        5,
        3,
        "unknown instruction `relu`",
    );
    assert_error(
        host_error(&host(&["copy(x -> z)"])),
        5,
        13,
        "unknown tensor `z`",
    );
}

#[test]
fn host_missing_attribute() {
    let text = host(&["c0 = collective_permute(x -> y, team=slice(m0, DIDx), send=0)"]);
    assert_error(
        host_error(&text),
        5,
        63,
        "`collective_permute` needs `recv=`",
    );
    let text = host(&["c0 = all_reduce(x -> y, team=mesh(m0), op=prod)"]);
    assert_error(
        host_error(&text),
        5,
        45,
        "unknown reduction `prod` (expected sum, max, min or avg)",
    );
}

#[test]
fn host_expressions() {
    let text = host(&["set_current_stream worker(-(1))"]);
    assert_error(
        host_error(&text),
        5,
        29,
        "unary minus applies only to integer literals in host expressions",
    );
    let text = host(&["set_current_stream worker(foo + 1)"]);
    assert_error(
        host_error(&text),
        5,
        29,
        "unknown name `foo` in an expression",
    );
    let text = host(&["set_current_stream worker(my(m7, DIDx))"]);
    assert_error(host_error(&text), 5, 32, "unknown mesh `m7`");
}

#[test]
fn host_variables_of_the_wrong_form() {
    let text = host(&["x = get_current_stream"]);
    assert_error(
        host_error(&text),
        5,
        3,
        "`get_current_stream` defines a stream variable such as `s0`, not `x`",
    );
    let text = host(&["s0 = all_reduce(x -> y, team=mesh(m0), op=sum)"]);
    assert_error(
        host_error(&text),
        5,
        3,
        "`all_reduce` defines a communication label such as `c0`, not `s0`",
    );
    let text = host(&["wait x"]);
    assert_error(
        host_error(&text),
        5,
        8,
        "expected a communication label such as `c0`, found `x`",
    );
}

#[test]
fn host_strings_and_structure() {
    let text = host(&["call_kernel(x -> y, kernel=\"abc)"]);
    assert_error(host_error(&text), 5, 30, "unterminated string literal");
    let text = host(&["call_kernel(x -> y, kernel=\"a\\qb\")"]);
    assert_error(
        host_error(&text),
        5,
        32,
        "unknown escape `\\q` in string literal",
    );
    let text = host(&["for i0 in 0..2 {", "  tensor t: f32[4] on m0", "}"]);
    assert_error(
        host_error(&text),
        6,
        5,
        "declarations are only allowed at the top level",
    );
    let deep: Vec<String> = (0..100).map(|i| format!("for i{i} in 0..1 {{")).collect();
    let deep_refs: Vec<&str> = deep.iter().map(String::as_str).collect();
    let (_, _, message) = host_error(&host(&deep_refs));
    assert!(message.contains("loops are nested too deeply"), "{message}");
}

// ---- parameters ----

fn params(pairs: &[(&str, i64)]) -> Params {
    pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect()
}

#[test]
fn later_parameters_follow_overridden_ones() {
    let text = program_text(&[
        "param ranks = 4",
        "param d = ranks / 2",
        "mesh a = iota(d)",
        "mesh b = iota(d, start=d)",
        "mesh c = iota(2, d)",
    ]);
    let p = parse_program_with(&text, &params(&[("ranks", 8)])).expect("parses");
    let meshes: Vec<String> = p.meshes.values().map(|m| m.mesh.to_string()).collect();
    assert_eq!(
        meshes,
        [
            "[0, 1, 2, 3]",
            "[4, 5, 6, 7]",
            "[[0, 1, 2, 3], [4, 5, 6, 7]]"
        ]
    );
    // Overriding the derived parameter directly ignores its default expression.
    let p = parse_program_with(&text, &params(&[("ranks", 0), ("d", 1)])).expect("parses");
    assert_eq!(p.meshes.values().next().map(|m| m.mesh.size()), Some(1));
}

#[test]
fn expressions_use_euclidean_division() {
    let text = program_text(&[
        "param a = 0 - 7",
        "mesh m = iota(a % 4, -a / 2 - 1, (a + 10) * 1)",
    ]);
    let p = parse_program(&text).expect("parses");
    assert_eq!(
        p.meshes.values().next().map(|m| m.mesh.shape().to_vec()),
        Some(vec![1, 2, 3])
    );
}

#[test]
fn overriding_an_undeclared_parameter() {
    let text = program_text(&["param ranks = 4", "param d = ranks"]);
    let e = parse_program_with(&text, &params(&[("tp", 2)])).expect_err("tp is not declared");
    assert_eq!((e.line, e.col), (1, 1));
    assert_eq!(
        e.message,
        "parameter `tp` is not declared in program `t` (declared: ranks, d)"
    );
}

#[test]
fn moe_dispatch_wire_attributes() {
    let moe = |call: &str| {
        program_text(&[
            "mesh m0 = [0, 1]",
            "input x: bf16[8, 128] on m0",
            "input idx: i32[8, 2] on m0",
            "tensor ex: bf16[4, 8, 128] on m0",
            "tensor c: i32[4] on m0",
            "tensor r: i32[4, 8, 2] on m0",
            call,
            "output ex",
        ])
    };
    let ok = moe("ex, c, r = moe_dispatch(x, idx, wire=f8e4m3, scale=block128)");
    let p = parse_program(&ok).unwrap();
    assert_eq!(
        p.ops[0].kind,
        meshflow_ir::OpKind::MoeDispatch {
            wire: meshflow_ir::MoeWire::Fp8E4m3(meshflow_ir::Fp8Scales::Block128)
        }
    );
    assert_eq!(parse_program(&p.to_string()).unwrap(), p);
    let native = moe("ex, c, r = moe_dispatch(x, idx, wire=native)");
    assert!(!parse_program(&native).unwrap().to_string().contains("wire"));
    assert_error(
        program_error(&moe("ex, c, r = moe_dispatch(x, idx, wire=f8e4m3)")),
        8,
        46,
        "`wire=f8e4m3` needs `scale=token` or `scale=block128`",
    );
    assert_error(
        program_error(&moe("ex, c, r = moe_dispatch(x, idx, scale=token)")),
        8,
        46,
        "`scale` is only for `wire=f8e4m3`",
    );
    assert_error(
        program_error(&moe("ex, c, r = moe_dispatch(x, idx, wire=fp4)")),
        8,
        40,
        "unknown wire format `fp4` (expected native or f8e4m3)",
    );
    assert_error(
        program_error(&moe(
            "ex, c, r = moe_dispatch(x, idx, wire=f8e4m3, scale=tile)",
        )),
        8,
        54,
        "unknown FP8 scale granularity `tile` (expected token or block128)",
    );
    assert_error(
        program_error(&moe("ex, c, r = moe_dispatch(x, idx, axis=1)")),
        8,
        35,
        "unknown attribute `axis` of `moe_dispatch` (expected `wire` or `scale`)",
    );
    // The verifier checks the token width against the scales.
    let narrow = ok.replace(", 128]", ", 48]");
    let e = meshflow_ir::verify_program(&parse_program(&narrow).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs a token width divisible by 128"), "{e}");
    // The host form takes the same attributes.
    let host = host_text(&[
        "mesh m0 = [0, 1]",
        "in x: bf16[8, 128] on m0",
        "in idx: i32[8, 2] on m0",
        "out ex: bf16[2, 16, 128] on m0",
        "out c: i32[2] on m0",
        "out r: i32[2, 16, 2] on m0",
        "c0 = moe_dispatch(x, idx -> ex, c, r, team=slice(m0, DIDx), wire=f8e4m3)",
    ]);
    assert_error(
        host_error(&host),
        8,
        74,
        "`wire=f8e4m3` needs `scale=token` or `scale=block128`",
    );
}
