//! Cross-rank check errors that the text corpus does not cover: world size, instance cap,
//! coalescing structure, grouped semantics and the report format.

use crate::support::check as check_support;

use check_support::*;
use meshflow::check::{check_program, CheckError, MAX_INSTANCES};
use meshflow::ir::host::HostProgram;
use meshflow::ir::{CommKind, DType, Team};

fn errors(program: &HostProgram, world_size: usize) -> Vec<CheckError> {
    match check_program(program, world_size) {
        Ok(report) => panic!("{} passed: {report}", program.name),
        Err(e) => e.errors,
    }
}

fn all_reduce_program(d: usize, trips: i64) -> HostProgram {
    let mut b = Builder::new("ar");
    let m = b.mesh("m0", (0..d).collect());
    let x = b.tensor("x", DType::F32, vec![4], m);
    let y = b.tensor("y", DType::F32, vec![4], m);
    b.push(for_loop(
        0,
        c(0),
        c(trips),
        vec![comm(0, CommKind::AllReduce, slice(m), x, y, None)],
    ));
    b.finish()
}

#[test]
fn world_too_small_is_reported() {
    let errs = errors(&all_reduce_program(8, 1), 4);
    let msg = errs[0].to_string();
    assert!(
        msg.contains(
            "mesh `m0` = [0, 1, 2, 3, 4, 5, 6, 7] names device 7, but the world has only 4 ranks"
        ),
        "{msg}"
    );
}

#[test]
fn huge_loops_hit_the_instance_cap() {
    let errs = errors(&all_reduce_program(2, MAX_INSTANCES as i64), 2);
    assert!(
        matches!(errs.as_slice(), [CheckError::TooManyInstances { .. }]),
        "{errs:?}"
    );
}

#[test]
fn nested_coalescing_is_malformed() {
    let mut p = all_reduce_program(2, 1);
    p.body.insert(0, start_group());
    p.body.insert(0, start_group());
    p.body.push(end_group(9));
    let errs = errors(&p, 2);
    assert!(
        errs.iter().any(|e| e
            .to_string()
            .contains("start_coalescing inside an open coalescing group")),
        "{errs:?}"
    );
}

/// Rank 0 sends then receives; rank 1 sends then receives: a cycle with blocking sends,
/// resolved when the whole exchange is one coalescing group (NCCL grouped semantics).
fn send_send_cycle(grouped: bool) -> HostProgram {
    let mut b = Builder::new("exchange");
    let m = b.mesh("m0", vec![0, 1]);
    let x = b.tensor("x", DType::F32, vec![16], m);
    let y = b.tensor("y", DType::F32, vec![16], m);
    let pair = || Team::Devices(vec![0, 1]);
    let rank = meshflow::ir::host::Expr::Rank;
    if grouped {
        b.push(start_group());
    }
    b.push(for_loop(
        0,
        c(0),
        c(1).sub(rank.clone()),
        vec![comm(0, CommKind::SendRecv, pair(), x, y, Some(c(0)))],
    ));
    b.push(comm(1, CommKind::SendRecv, pair(), x, y, Some(c(1))));
    b.push(for_loop(
        1,
        c(0),
        rank,
        vec![comm(2, CommKind::SendRecv, pair(), x, y, Some(c(0)))],
    ));
    if grouped {
        b.push(end_group(3));
    }
    b.finish()
}

#[test]
fn coalescing_resolves_a_send_send_cycle() {
    let errs = errors(&send_send_cycle(false), 2);
    assert!(
        matches!(errs.as_slice(), [CheckError::Deadlock { .. }]),
        "{errs:?}"
    );
    let report = check_program(&send_send_cycle(true), 2).expect("grouped exchange passes");
    assert_eq!((report.point_to_point, report.groups), (2, 2));
}

#[test]
fn repeated_mistakes_are_counted_not_listed() {
    // Root 9 is out of range on every rank and iteration: one line plus a count.
    let mut b = Builder::new("bad_root");
    let m = b.mesh("m0", (0..4).collect());
    let x = b.tensor("x", DType::F32, vec![4], m);
    b.push(for_loop(
        0,
        c(0),
        c(3),
        vec![comm(0, CommKind::Broadcast, slice(m), x, x, Some(c(9)))],
    ));
    let err = check_program(&b.finish(), 4).expect_err("root out of range");
    assert_eq!(err.errors.len(), 2, "{err}");
    let text = err.to_string();
    assert!(text.contains("rank 0: root 9 of `c0 = broadcast(x -> x, team=slice(m0, DIDx), root=9)` at i0=0 is out of range"), "{text}");
    assert!(
        text.contains("... and 3 more error(s) of kind `out of range`"),
        "{text}"
    );
}

#[test]
fn the_report_stays_one_short_line_at_any_world_size() {
    use meshflow::check::CheckReport;
    let report = |counts: Vec<usize>| {
        CheckReport {
            world_size: counts.len(),
            events_per_rank: counts,
            teams: vec![vec![0, 1]],
            collectives_per_team: vec![1],
            point_to_point: 0,
            groups: 0,
        }
        .to_string()
    };
    let even = report(vec![4; 128]);
    assert!(
        even.starts_with("128 ranks, 512 communications (4 per rank), "),
        "{even}"
    );
    let halves = report([vec![4; 64], vec![5; 64]].concat());
    assert!(halves.contains("(4 to 5 per rank)"), "{halves}");
    let ragged = report((0..128).map(|r| r % 3).collect());
    assert!(ragged.contains("(0 to 2 per rank)"), "{ragged}");
    let small = report(vec![1, 2, 3]);
    assert!(small.contains("(per rank [1, 2, 3])"), "{small}");
    for text in [even, halves, ragged, small] {
        assert!(text.len() < 160, "{} characters: {text}", text.len());
    }
}

#[test]
fn per_rank_sizes_of_narrow_views_size_the_collectives() {
    // Each rank gathers the valid rows of its shard: the counts differ by rank, which is a
    // mismatch; and a narrow reaching past its tensor on some rank is reported.
    let text = "host uneven {
  mesh m0 = [0, 1]
  in x: f32[3, 4] on m0
  out y: f32[6, 4] on m0
  tensor v: f32[3, 4] on m0
  tensor w: f32[6, 4] on m0
  allocate y
  v = narrow(x, axis=0, start=0, length=3 - my(m0, DIDx))
  w = narrow(y, axis=0, start=0, length=6 - 2 * my(m0, DIDx))
  c0 = all_gather(v -> w, team=slice(m0, DIDx))
  wait c0
}";
    let host = meshflow::ir::parse_host(text).unwrap();
    let msg = check_program(&host, 2).unwrap_err().to_string();
    assert!(
        msg.contains("sequence mismatch") || msg.contains("disagree"),
        "{msg}"
    );
    let past = text.replace("length=3 - my(m0, DIDx))", "length=3 + my(m0, DIDx))");
    let host = meshflow::ir::parse_host(&past).unwrap();
    let msg = check_program(&host, 2).unwrap_err().to_string();
    assert!(msg.contains("do not fit this rank's extent 3"), "{msg}");
    let even = text
        .replace("length=3 - my(m0, DIDx))", "length=3)")
        .replace("length=6 - 2 * my(m0, DIDx))", "length=6)");
    let host = meshflow::ir::parse_host(&even).unwrap();
    check_program(&host, 2).expect("equal sizes pass");
}
