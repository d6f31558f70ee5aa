//! Regression tests of issue-level bugs in resharding: each program is lowered, checked
//! across ranks and run on the CPU backend against the reference, at several rank counts.
//!
//! 1. Leading axes of extent 1: a collective cuts a buffer into equal contiguous chunks of
//!    its elements, so gathering `x[1, S, H]` along `S` (no staging permute) runs.
//! 2. Overlapping meshes: transfers between meshes sharing devices pass the cross-rank check;
//!    a device that keeps its shard copies it locally; replicated to replicated broadcasts.
//! 3. Teams of one device never communicate, and errors print no Rust `Option`s.

use std::collections::BTreeMap;

use meshflow::check::check_program;
use meshflow::ir::parse::{parse_program_with, Params};
use meshflow::ir::HostProgram;
use meshflow::runtime::compare::run_and_compare;
use meshflow::runtime::ranks::CpuOptions;
use meshflow::{compile, Options};

/// Lowers `text` with `ranks`, checks it and runs it against the reference; returns the host
/// program.
pub(crate) fn run(text: &str, ranks: i64) -> HostProgram {
    run_with(text, ranks, &Options::new().check(false))
}

/// [`run`] with compile `options`.
pub(crate) fn run_with(text: &str, ranks: i64, options: &Options) -> HostProgram {
    let mut params = Params::new();
    params.insert("ranks".into(), ranks);
    let program = parse_program_with(text, &params).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let compiled =
        compile(&program, options).unwrap_or_else(|e| panic!("ranks={ranks}: {e}\n{text}"));
    let world = (ranks as usize).max(compiled.host().world_size());
    check_program(compiled.host(), world)
        .unwrap_or_else(|e| panic!("ranks={ranks}: check: {e}\n{}", compiled.host()));
    let cmp = run_and_compare(
        compiled.level1().expect("lowered"),
        compiled.host(),
        world,
        5,
        &CpuOptions::default(),
    )
    .unwrap_or_else(|e| panic!("ranks={ranks}: run: {e}\n{}", compiled.host()));
    assert!(cmp.passed(), "ranks={ranks}: {cmp}\n{}", compiled.host());
    compiled.host().clone()
}

/// Communication instructions by name.
pub(crate) fn comms(host: &HostProgram) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    host.walk(&mut |i, _| {
        if i.kind.is_communication() {
            *out.entry(i.kind.name().to_string()).or_insert(0) += 1;
        }
    });
    out
}

fn count(host: &HostProgram, name: &str) -> usize {
    let mut n = 0;
    host.walk(&mut |i, _| n += usize::from(i.kind.name() == name));
    n
}

#[test]
fn batch_one_sequence_gather_cuts_the_sequence_axis() {
    let text = "program p {
  param ranks = 4
  mesh m = iota(ranks)
  input x: f32[1, 4 * ranks, 8] on m {outer_split(1, ranks), parallelize(1, DIDx)}
  tensor y: f32[1, 4 * ranks, 8] on m {}
  y = set(x)
  output y
}";
    for r in [1, 2, 3, 4] {
        let host = run(text, r);
        assert_eq!(count(&host, "permute"), 0, "no staging: {host}");
        if r > 1 {
            assert_eq!(comms(&host).get("all_gather"), Some(&1), "{host}");
        }
    }
}

#[test]
fn device_axis_without_a_split_and_leading_ones() {
    // `[d, ...]` parallelized without a split, and a reduce-scatter / all-to-all whose
    // buffers start with an axis of extent 1.
    let gathered = "program p {
  param ranks = 4
  mesh m = iota(ranks)
  input x: f32[ranks, 8] on m {parallelize(0, DIDx)}
  tensor y: f32[ranks, 8] on m {}
  y = set(x)
  output y
}";
    let a2a = "program p {
  param ranks = 4
  mesh m = iota(ranks)
  input x: f16[ranks, ranks * 3] on m {outer_split(0, ranks), parallelize(0, DIDx)}
  tensor y: f16[ranks, ranks * 3] on m {outer_split(1, ranks), parallelize(1, DIDx)}
  y = set(x)
  output y
}";
    let rs = "program p {
  param ranks = 4
  mesh m = iota(ranks)
  input x: f32[ranks, 1, ranks * 4] on m {parallelize(0, DIDx)}
  tensor y: f32[r(ranks), 1, ranks * 4] on m {outer_split(2, ranks), parallelize(2, DIDx)}
  y = sum(x, axis=0)
  output y
}";
    for r in [2, 3, 4] {
        assert_eq!(comms(&run(gathered, r)).get("all_gather"), Some(&1));
        assert_eq!(comms(&run(a2a, r)).get("all_to_all"), Some(&1));
        assert_eq!(comms(&run(rs, r)).get("reduce_scatter"), Some(&1));
    }
}

#[test]
fn one_row_stream_chunks() {
    // Each device holds one row; the ring and the stream broadcast move one row per step.
    for swizzle in ["swizzle1d(1, DIDx), ", ""] {
        let text = format!(
            "program p {{
  param ranks = 4
  mesh m = iota(ranks)
  input x: f32[1, ranks, 8] on m {{outer_split(1, ranks), parallelize(1, DIDx)}}
  input w: f32[6, 8] on m {{}}
  tensor ag: f32[1, ranks, 8] on m {{outer_split(1, ranks), {swizzle}parallelize(1, Stream)}}
  tensor y: f32[1, ranks, 6, r8] on m
  ag = set(x)
  y = linear(ag, w)
  output y
}}"
        );
        for r in [2, 3, 4] {
            run(&text, r);
        }
    }
}

#[test]
fn cyclic_shift_between_overlapping_meshes() {
    // {0, 1, 2, 3} -> {1, 2, 3, 0}: the ring pairwise exchange, one coalesced group.
    let text = "program p {
  param ranks = 4
  mesh a = [0, 1, 2, 3]
  mesh b = [1, 2, 3, 0]
  input x: f32[8, 8] on a {outer_split(0, 4), parallelize(0, DIDx)}
  tensor y: f32[8, 8] on b {outer_split(0, 4), parallelize(0, DIDx)}
  y = set(x)
  output y
}";
    let host = run(text, 4);
    assert_eq!(comms(&host).get("send_recv"), Some(&4), "{host}");
    assert_eq!(count(&host, "start_coalescing"), 1, "{host}");
}

#[test]
fn a_device_that_keeps_its_shard_copies_it() {
    // {1, 2} -> {1, 0}: device 1 keeps its shard, device 2 sends to device 0.
    let text = "program p {
  param ranks = 3
  mesh a = [1, 2]
  mesh b = [1, 0]
  input x: f32[2, 4] on a {parallelize(0, DIDx)}
  tensor y: f32[2, 4] on b {parallelize(0, DIDx)}
  y = set(x)
  output y
}";
    for r in [3, 4] {
        let host = run(text, r);
        let c = comms(&host);
        assert_eq!(c.get("send_recv"), Some(&1), "{host}");
        assert_eq!(c.get("collective_permute"), Some(&1), "{host}");
        assert!(
            host.to_string().contains("team=devices(1), send=0, recv=0"),
            "{host}"
        );
    }
}

#[test]
fn sharded_pipeline_stages_on_overlapping_meshes() {
    // nvFuser's Bcast_sharded: {0, 2, 3} -> {1, 0, 2} and back, sharded on either axis.
    for (a, b) in [("[0, 2, 3]", "[1, 0, 2]"), ("[1, 0, 2]", "[0, 2, 3]")] {
        for dim in [0, 1] {
            let mut sizes = [3, 2, 3];
            sizes[dim] = 3;
            let dims = format!("{}, {}, {}", sizes[0], sizes[1], sizes[2]);
            let text = format!(
                "program p {{
  param ranks = 4
  mesh a = {a}
  mesh b = {b}
  input x: f32[{dims}] on a {{parallelize({dim}, DIDx)}}
  tensor y: f32[{dims}] on b {{parallelize({dim}, DIDx)}}
  tensor z: f32[{dims}] on b {{parallelize({dim}, DIDx)}}
  y = set(x)
  z = add(y, y)
  output z
}}"
            );
            let host = run(&text, 4);
            assert_eq!(comms(&host).get("send_recv"), Some(&3), "{host}");
        }
    }
}

#[test]
fn gather_and_reduce_between_overlapping_meshes() {
    // {1, 0, 2} -> {0, 2, 3}: device 3 is no sender, so gather (or reduce) on the sender mesh
    // and broadcast to the receivers.
    let gather = "program p {
  param ranks = 4
  mesh a = [1, 0, 2]
  mesh b = [0, 2, 3]
  input x: f32[3, 4] on a {parallelize(0, DIDx)}
  tensor y: f32[3, 4] on b {}
  y = set(x)
  output y
}";
    let host = run(gather, 4);
    let c = comms(&host);
    assert_eq!(
        (c.get("all_gather"), c.get("broadcast")),
        (Some(&1), Some(&1)),
        "{host}"
    );
    let reduce = "program p {
  param ranks = 4
  mesh a = [1, 0, 2]
  mesh b = [0, 2, 3]
  input x: f32[3, 4] on a {parallelize(0, DIDx)}
  tensor s: f32[r3, 4] on a {parallelize(0, DIDx)}
  tensor y: f32[4] on b {}
  s = sum(x, axis=0)
  y = set(s)
  output y
}";
    let host = run(reduce, 4);
    let c = comms(&host);
    assert_eq!(
        (c.get("all_reduce"), c.get("broadcast")),
        (Some(&1), Some(&1)),
        "{host}"
    );
}

#[test]
fn replicated_to_replicated_on_an_overlapping_mesh_broadcasts() {
    let text = "program p {
  param ranks = 3
  mesh a = [0, 1]
  mesh b = [0, 2]
  input x: f32[4, 8] on a {}
  tensor y: f32[4, 8] on b {}
  y = set(x)
  output y
}";
    let host = run(text, 3);
    assert_eq!(comms(&host).get("broadcast"), Some(&1), "{host}");
    // Every receiver already holds the data: local copies, no transfer.
    let inside = "program p {
  param ranks = 3
  mesh a = [0, 1, 2]
  mesh b = [2, 0]
  input x: f32[4, 8] on a {}
  tensor y: f32[4, 8] on b {}
  y = set(x)
  output y
}";
    let host = run(inside, 3);
    assert!(
        comms(&host).keys().all(|k| k == "collective_permute"),
        "{host}"
    );
    assert!(
        host.to_string()
            .contains("send=my(b, DIDx), recv=my(b, DIDx)"),
        "{host}"
    );
}

#[test]
fn teams_of_one_device_never_communicate() {
    // A mesh axis of extent 1 (DTensor's one-chunk mesh): splits and partial sums over it
    // change nothing.
    for src in ["outer_split(2, 1), parallelize(2, DIDx)", ""] {
        for dst in [
            "outer_split(2, 1), parallelize(2, DIDx)",
            "outer_split(1, 1), parallelize(1, DIDx)",
            "",
        ] {
            let text = format!(
                "program p {{
  param ranks = 4
  mesh m = iota(ranks, 1)
  input x: f32[16, 8] on m {{outer_split(0, ranks), parallelize(0, DIDy), {src}}}
  tensor y: f32[16, 8] on m {{outer_split(0, ranks), parallelize(0, DIDy), {dst}}}
  y = set(x)
  output y
}}"
            )
            .replace(", }", "}");
            for r in [2, 4] {
                let host = run(&text, r);
                assert!(comms(&host).is_empty(), "{host}");
            }
        }
    }
    let partial = "program p {
  param ranks = 4
  mesh m = iota(ranks, 1)
  input a: f32[16, 8, 1] on m {outer_split(0, ranks), parallelize(0, DIDy), parallelize(3, DIDx)}
  tensor x: f32[16, 8, r1] on m {outer_split(0, ranks), parallelize(0, DIDy), parallelize(3, DIDx)}
  tensor y: f32[16, 8] on m {outer_split(0, ranks), parallelize(0, DIDy)}
  x = sum(a, axis=2)
  y = set(x)
  output y
}";
    assert!(comms(&run(partial, 4)).is_empty());
}

#[test]
fn refusals_print_no_rust_options() {
    // A resharding inside a stream loop that changes the chunked axis on an uneven producer.
    let texts = [
        "program p {
  param ranks = 2
  mesh m0 = [0, 1]
  input x: f32[16, 4] on m0 {}
  tensor y: f32[16, 4, r2] on m0 {parallelize(2, DIDx)}
  y = set(x)
  output y
}",
        "program p {
  param ranks = 4
  mesh m = iota(ranks)
  input x: f32[16, 4] on m {outer_split(0, 3), outer_split(1, ranks), parallelize(1, DIDx)}
  tensor y: f32[16, 4] on m {}
  y = set(x)
  output y
}",
    ];
    for text in texts {
        let program = parse_program_with(text, &Params::new()).unwrap();
        let e = compile(&program, &Options::new().check(false))
            .map(|_| ())
            .expect_err("refused");
        let msg = e.to_string();
        assert!(!msg.contains("Some(") && !msg.contains("None"), "{msg}");
        assert!(msg.contains('`'), "names a tensor or op: {msg}");
    }
}
