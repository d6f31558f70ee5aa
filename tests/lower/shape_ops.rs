//! Lowered host programs of the shape ops, partial placements, cross-mesh compute and the
//! row-wise ops (insta snapshots), with the structural facts each one shows: where a reshape
//! stays local and where it needs communication, compute before gathering, the inserted
//! cross-mesh transfer, the reduction kind of a partial result and the broadcast `expand`
//! of a batched matmul. Every program also runs on the CPU backend against the reference.

use meshflow::check::check_program;
use meshflow::ir::{parse_program, HostProgram, InstKind};
use meshflow::runtime::compare::run_and_compare;
use meshflow::runtime::ranks::CpuOptions;
use meshflow::{compile, Options};

fn lower(text: &str) -> HostProgram {
    let p = parse_program(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let c = compile(&p, &Options::new().check(false)).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let world = c.host().world_size();
    check_program(c.host(), world).unwrap_or_else(|e| panic!("{e}\n{}", c.host()));
    let cmp = run_and_compare(
        c.level1().expect("lowered"),
        c.host(),
        world,
        5,
        &CpuOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", c.host()));
    assert!(cmp.passed(), "{cmp}\n{}", c.host());
    c.host().clone()
}

/// `name(...)` of every communication and compute instruction, in order.
fn trace(host: &HostProgram) -> Vec<String> {
    let mut out = Vec::new();
    host.walk(&mut |i, _| match &i.kind {
        InstKind::Communication { kind, op, .. } => out.push(match op {
            Some(op) => format!("{}({})", kind.name(), op.name()),
            None => kind.name().to_string(),
        }),
        InstKind::Compute { op, .. } => out.push(op.name().to_string()),
        _ => {}
    });
    out
}

#[test]
fn head_split_stays_local_when_the_heads_divide() {
    let host = lower(
        "program heads {
  mesh m = [0, 1]
  input x: f32[2, 4, 24] on m {outer_split(2, 2), parallelize(2, DIDx)}
  tensor y: f32[2, 4, 6, 4] on m
  y = reshape(x)
  output y
}
",
    );
    assert_eq!(trace(&host), ["copy"]);
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn head_split_gathers_first_when_the_heads_do_not_divide() {
    let host = lower(
        "program heads_gather {
  mesh m = [0, 1, 2, 3]
  input x: f32[2, 4, 24] on m {outer_split(2, 4), parallelize(2, DIDx)}
  tensor y: f32[2, 4, 6, 4] on m
  y = reshape(x)
  output y
}
",
    );
    assert_eq!(trace(&host), ["permute", "all_gather", "permute", "copy"]);
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn add_of_two_shards_gathers_once_after_the_add() {
    let host = lower(
        "program add_then_gather {
  mesh m = [0, 1, 2]
  input a: f32[6, 4] on m {outer_split(0, 3), parallelize(0, DIDx)}
  input b: f32[6, 4] on m {outer_split(0, 3), parallelize(0, DIDx)}
  tensor c: f32[6, 4] on m {}
  c = add(a, b)
  output c
}
",
    );
    assert_eq!(trace(&host), ["add", "all_gather"]);
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn an_op_with_inputs_on_another_mesh_gets_its_transfer_inserted() {
    let host = lower(
        "program cross_mesh {
  mesh m0 = [0, 1]
  mesh m1 = [2, 3]
  input a: f32[4, 6] on m0 {outer_split(0, 2), parallelize(0, DIDx)}
  input b: f32[4, 6] on m1 {outer_split(0, 2), parallelize(0, DIDx)}
  tensor c: f32[4, 6] on m1
  c = mul(a, b)
  output c
}
",
    );
    assert_eq!(trace(&host), ["send_recv", "send_recv", "mul"]);
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn partial_results_reduce_with_their_own_kind() {
    let host = lower(
        "program kinds {
  mesh m = [0, 1]
  input x: f32[4, 6] on m {outer_split(1, 2), parallelize(1, DIDx)}
  tensor mx: f32[4, r6] on m {}
  tensor av: f32[4, r6] on m {}
  mx = max(x, axis=1)
  av = avg(x, axis=1)
  output mx, av
}
",
    );
    assert_eq!(
        trace(&host),
        ["max", "all_reduce(max)", "avg", "all_reduce(avg)"]
    );
}

#[test]
fn partial_input_moves_its_shard_axis_without_reducing() {
    let host = lower(
        "program partial_shard_change {
  mesh m = iota(2, 2)
  input x: f32[4, 4, r2] on m {outer_split(0, 2), parallelize(0, DIDx), outer_split(3, 2), parallelize(3, DIDy)}
  tensor p: f32[4, 4, r2] on m {outer_split(1, 2), parallelize(1, DIDx), outer_split(3, 2), parallelize(3, DIDy)}
  tensor y: f32[4, 4] on m {outer_split(1, 2), parallelize(1, DIDx)}
  p = set(x)
  y = set(p)
  output y
}
",
    );
    let t = trace(&host);
    assert_eq!(t.iter().filter(|s| s.starts_with("all_to_all")).count(), 1);
    assert!(t.contains(&"all_reduce(sum)".to_string()), "{t:?}");
    insta::assert_snapshot!(host.to_string());
}

#[test]
fn batched_matmul_expands_the_broadcast_operand_and_softmax_reshards_after() {
    let host = lower(
        "program attention_scores {
  mesh m = [0, 1]
  input q: f32[2, 4, 8, 6] on m {outer_split(1, 2), parallelize(1, DIDx)}
  input k: f32[2, 1, 6, 8] on m {}
  tensor s: f32[2, 4, 8, 8, r6] on m
  tensor p: f32[2, 4, 8, 8] on m {outer_split(3, 2), parallelize(3, DIDx)}
  s = matmul(q, k)
  p = softmax(s, axis=3)
  output p
}
",
    );
    let t = trace(&host);
    assert_eq!(t.first().map(String::as_str), Some("expand"), "{t:?}");
    assert!(t.contains(&"softmax".to_string()));
    insta::assert_snapshot!(host.to_string());
}
