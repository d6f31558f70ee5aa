use std::collections::BTreeSet;

use meshflow_ir::{parse_host, parse_program_with, HostProgram};

use super::walk_ranks;
use crate::check::CheckError;
use crate::pipeline::StreamSchedule;
use crate::{compile, Options};

/// The races found, as `(earlier instruction, later instruction)` texts.
fn races(host: &HostProgram, world: usize, fold: bool) -> (BTreeSet<(String, String)>, usize) {
    let (errors, steps) = walk_ranks(host, world, fold);
    let mut pairs = BTreeSet::new();
    for e in errors {
        match e {
            CheckError::Race { earlier, later, .. } => {
                pairs.insert((earlier.site.inst.text, later.site.inst.text));
            }
            other => panic!("unexpected error: {other}"),
        }
    }
    (pairs, steps)
}

/// A chunked all-reduce loop over `n` chunks on two ranks, with `$PRE` before the loop,
/// `$SYNC` at the top of each iteration, `$WAIT` after the all-reduce and `$POST` after it.
const CHUNKED: &str = r#"
host chunked {
  mesh m0 = [0, 1]
  in x: f32[$ROWS, 8] on m0
  in w: f32[6, 8] on m0
  out y: f32[$ROWS, 6] on m0
  tensor x_chunk: f32[2, 8] on m0
  tensor p_chunk: f32[2, 6] on m0
  tensor y_chunk: f32[2, 6] on m0
  tensor ring: f32[4, 6] on m0
  tensor probe: f32[2, 6] on m0
  allocate ring
  allocate probe
  s0 = get_current_stream
$PRE  for i0 in 0..$N {
    set_current_stream worker(i0 % 2)
$SYNC    x_chunk = shard_by_stream(x, axis=0, chunks=$N, index=i0)
    p_chunk = shard_by_stream(ring, axis=0, chunks=2, index=i0 % 2)
    linear(x_chunk, w -> p_chunk)
    y_chunk = shard_by_stream(y, axis=0, chunks=$N, index=i0)
    c0 = all_reduce(p_chunk -> y_chunk, team=slice(m0, DIDx), op=sum)
$WAIT  }
  set_current_stream s0
$POST  deallocate ring
}
"#;

fn chunked(n: usize, pre: &str, sync: bool, wait: bool, post: &str) -> HostProgram {
    let text = CHUNKED
        .replace("$ROWS", &(2 * n).to_string())
        .replace("$N", &n.to_string())
        .replace("$PRE", pre)
        .replace("$SYNC", if sync { "    synchronize s0\n" } else { "" })
        .replace("$WAIT", if wait { "    wait c0\n" } else { "" })
        .replace("$POST", post);
    parse_host(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

const SYNC_WORKERS: &str = "  for i1 in 0..2 {\n    synchronize worker(i1)\n  }\n";

/// Reads chunk `k` of `y` on the main stream (after the loop).
fn read_chunk(n: usize, k: usize) -> String {
    format!(
        "  y_chunk = shard_by_stream(y, axis=0, chunks={n}, index={k})\n  copy(y_chunk -> probe)\n"
    )
}

/// Writes chunk `k` of `y` on the main stream (before the loop).
fn write_chunk(n: usize, k: usize) -> String {
    format!(
        "  y_chunk = shard_by_stream(y, axis=0, chunks={n}, index={k})\n  copy(probe -> y_chunk)\n"
    )
}

#[test]
fn a_dropped_wait_is_a_race_naming_both_instructions() {
    let host = chunked(4, "", true, false, SYNC_WORKERS);
    let (errors, _) = walk_ranks(&host, 2, true);
    let text = errors.iter().map(|e| e.to_string()).collect::<Vec<_>>();
    assert_eq!(errors.len(), 1, "{text:?}");
    let msg = &text[0];
    assert!(msg.contains("race on buffer `ring`"), "{msg}");
    assert!(
        msg.contains("`c0 = all_reduce(p_chunk -> y_chunk, team=slice(m0, DIDx), op=sum)` (line 22) at i0=0 reads `p_chunk` as communication c0"),
        "{msg}"
    );
    assert!(
        msg.contains("`linear(x_chunk, w -> p_chunk)` (line 20) at i0=2 writes `p_chunk` on stream worker(0)"),
        "{msg}"
    );
    assert!(msg.contains("missing `wait c0`"), "{msg}");
    let good = chunked(4, "", true, true, SYNC_WORKERS);
    assert!(walk_ranks(&good, 2, true).0.is_empty());
}

#[test]
fn long_loops_fold_and_agree_with_the_unrolled_walk() {
    let n = 2000;
    let cases: Vec<(&str, HostProgram, bool)> = vec![
        ("good", chunked(n, "", true, true, SYNC_WORKERS), false),
        ("no wait", chunked(n, "", true, false, SYNC_WORKERS), true),
        // Not synchronizing the workers at the end is fine as long as main reads nothing.
        ("no final sync", chunked(n, "", true, true, ""), false),
        // Main reads a chunk written in the middle of the loop, which folding skips.
        (
            "read after, unsynchronized",
            chunked(n, "", true, true, &read_chunk(n, 1001)),
            true,
        ),
        (
            "read after, synchronized",
            chunked(
                n,
                "",
                true,
                true,
                &format!("{SYNC_WORKERS}{}", read_chunk(n, 1001)),
            ),
            false,
        ),
        // Main writes a middle chunk before the loop; the workers do not synchronize with it.
        (
            "write before, unsynchronized",
            chunked(n, &write_chunk(n, 999), false, true, SYNC_WORKERS),
            true,
        ),
        (
            "write before, synchronized",
            chunked(n, &write_chunk(n, 999), true, true, SYNC_WORKERS),
            false,
        ),
        // The last chunk is written in the back window.
        (
            "write last before, unsynchronized",
            chunked(n, &write_chunk(n, n - 1), false, true, SYNC_WORKERS),
            true,
        ),
    ];
    for (name, host, racy) in cases {
        let (folded, folded_steps) = races(&host, 2, true);
        let (unrolled, unrolled_steps) = races(&host, 2, false);
        assert_eq!(folded, unrolled, "{name}: folded and unrolled walks differ");
        assert_eq!(!folded.is_empty(), racy, "{name}: {folded:?}");
        assert!(
            folded_steps * 20 < unrolled_steps,
            "{name}: folding walked {folded_steps} instructions, unrolling {unrolled_steps}"
        );
    }
}

/// Every wait and synchronize of the lowered examples is needed or harmless: dropping any
/// one of them gives the same verdict folded and unrolled, on long stream loops.
#[test]
fn lowered_stream_loops_fold_exactly_with_any_wait_or_sync_dropped() {
    let text = include_str!("../../../examples/programs/row_parallel_linear_chunked.mf");
    let params = [("ranks".to_string(), 2), ("s".to_string(), 96)].into();
    let program = parse_program_with(text, &params).expect("example parses");
    let (mut checked, mut racy) = (0, 0);
    for schedule in [StreamSchedule::PerIteration, StreamSchedule::Prefetch] {
        for streams in [1, 2, 3] {
            let options = Options::new()
                .check(false)
                .streams(streams)
                .stream_schedule(schedule);
            let host = compile(&program, &options).expect("lowers").host().clone();
            let text = host.to_string();
            let (ok, steps) = races(&host, 2, true);
            assert!(ok.is_empty(), "{ok:?}\n{text}");
            assert!(steps < 2 * 96 * 6, "did not fold: {steps} steps");
            let lines: Vec<&str> = text.lines().collect();
            for (k, line) in lines.iter().enumerate() {
                let t = line.trim_start();
                if !(t.starts_with("wait ") || t.starts_with("synchronize ")) {
                    continue;
                }
                let mut cut = lines.clone();
                cut.remove(k);
                let mutated = parse_host(&cut.join("\n")).expect("still parses");
                let (folded, _) = races(&mutated, 2, true);
                let (unrolled, _) = races(&mutated, 2, false);
                assert_eq!(folded, unrolled, "dropping `{t}`:\n{}", cut.join("\n"));
                checked += 1;
                racy += usize::from(!folded.is_empty());
            }
        }
    }
    assert!(
        checked >= 12 && racy >= 6,
        "{checked} mutations, {racy} racy"
    );
}

/// Ranks are walked once per distinct view of the program; one that reads `rank` makes
/// every rank distinct (here only odd ranks skip the wait).
#[test]
fn a_race_on_some_ranks_only_is_found() {
    let text = r#"
host odd_ranks_skip_the_wait {
  mesh m0 = [0, 1, 2, 3]
  in x: f32[8] on m0
  out y: f32[8] on m0
  tensor r: f32[8] on m0
  allocate r
  c0 = all_reduce(x -> r, team=slice(m0, DIDx), op=sum)
  for i0 in 0..1 - rank % 2 {
    wait c0
  }
  gelu(r -> y)
  wait c0
  deallocate r
}
"#;
    let host = parse_host(text).expect("parses");
    let (errors, _) = walk_ranks(&host, 4, true);
    let text: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
    assert_eq!(errors.len(), 1, "{text:?}");
    assert!(
        text[0].starts_with("rank 1: race on buffer `r`"),
        "{}",
        text[0]
    );
}
