//! Correct host programs pass the cross-rank check on every world size their meshes allow.

use crate::support::check as check_support;

use std::time::Instant;

use check_support::*;
use meshflow::check::{check_program, instantiate, CheckReport};
use meshflow::ir::host::{CommId, ComputeOp, HostProgram, Inst, InstKind, Team};
use meshflow::ir::{CommKind, DType, ParallelType};

const WORLD_SIZES: [usize; 5] = [1, 2, 3, 4, 8];

fn passes(program: &HostProgram, world_size: usize) -> CheckReport {
    match check_program(program, world_size) {
        Ok(report) => report,
        Err(e) => panic!("{} on {world_size} ranks:\n{e}\n{program}", program.name),
    }
}

/// Column-parallel all-gather as a ring of collective permutes (swizzle1d).
fn ring_all_gather(d: usize) -> HostProgram {
    let dd = d as i64;
    let mut b = Builder::new("ring");
    let m = b.mesh("m0", (0..d).collect());
    let x = b.tensor("x", DType::BF16, vec![16, 32], m);
    let ag = b.tensor("ag", DType::BF16, vec![16 * d as u64, 32], m);
    let chunk = b.tensor("ag_chunk", DType::BF16, vec![16, 32], m);
    b.push(for_loop(
        0,
        c(0),
        c(dd),
        vec![
            shard(chunk, ag, d as u64, i(0).add(my(m)).rem(c(dd))),
            permute(
                0,
                slice(m),
                c(dd).add(my(m)).sub(i(0)).rem(c(dd)),
                i(0).add(my(m)).rem(c(dd)),
                x,
                chunk,
            ),
            wait(0),
        ],
    ));
    b.finish()
}

#[test]
fn ring_all_gather_passes() {
    for d in WORLD_SIZES {
        let report = passes(&ring_all_gather(d), d);
        assert_eq!(report.events_per_rank, vec![d; d]);
        assert_eq!(report.teams, vec![(0..d).collect::<Vec<_>>()]);
        assert_eq!(report.collectives_per_team, vec![d]);
    }
}

#[test]
fn stream_broadcast_with_loop_root_passes() {
    for d in WORLD_SIZES {
        let mut b = Builder::new("stream_broadcast");
        let m = b.mesh("m0", (0..d).collect());
        let x = b.tensor("x", DType::F32, vec![8, 4], m);
        let chunk = b.tensor("chunk", DType::F32, vec![8, 4], m);
        b.push(for_loop(
            0,
            c(0),
            c(d as i64),
            vec![
                comm(0, CommKind::Broadcast, slice(m), x, chunk, Some(i(0))),
                wait(0),
            ],
        ));
        let report = passes(&b.finish(), d);
        assert_eq!(report.collectives_per_team, vec![d]);
    }
}

#[test]
fn chunked_all_reduce_all_gather_reduce_scatter_all_to_all_pass() {
    for d in WORLD_SIZES {
        let n = d as u64;
        let mut b = Builder::new("collectives");
        let m = b.mesh("m0", (0..d).collect());
        let partial = b.tensor("partial", DType::F32, vec![4 * n, 8], m);
        let p_chunk = b.tensor("p_chunk", DType::F32, vec![n, 8], m);
        let out = b.tensor("out", DType::F32, vec![4 * n, 8], m);
        let o_chunk = b.tensor("o_chunk", DType::F32, vec![n, 8], m);
        let small = b.tensor("small", DType::F32, vec![2, 8], m);
        let big = b.tensor("big", DType::F32, vec![2 * n, 8], m);
        b.push(for_loop(
            0,
            c(0),
            c(4),
            vec![
                shard(p_chunk, partial, 4, i(0)),
                shard(o_chunk, out, 4, i(0)),
                comm(0, CommKind::AllReduce, slice(m), p_chunk, o_chunk, None),
                wait(0),
            ],
        ));
        b.push(comm(1, CommKind::AllGather, slice(m), small, big, None));
        b.push(comm(2, CommKind::ReduceScatter, slice(m), big, small, None));
        b.push(comm(3, CommKind::AllToAll, Team::Mesh(m), big, big, None));
        b.push(comm(
            4,
            CommKind::Reduce,
            slice(m),
            small,
            small,
            Some(c(0)),
        ));
        b.push(comm(
            5,
            CommKind::Gather,
            slice(m),
            small,
            big,
            Some(c(d as i64 - 1)),
        ));
        b.push(comm(6, CommKind::Scatter, slice(m), big, small, Some(c(0))));
        let report = passes(&b.finish(), d);
        assert_eq!(report.collectives_per_team, vec![4 + 6]);
    }
}

#[test]
fn coalesced_groups_pass() {
    // Two collective permutes in one group (a bidirectional ring), in a loop.
    for d in WORLD_SIZES {
        let dd = d as i64;
        let mut b = Builder::new("coalesced");
        let m = b.mesh("m0", (0..d).collect());
        let x = b.tensor("x", DType::BF16, vec![4], m);
        let left = b.tensor("left", DType::BF16, vec![4], m);
        let right = b.tensor("right", DType::BF16, vec![4], m);
        let up = my(m).add(c(1)).rem(c(dd));
        let down = my(m).add(c(dd - 1)).rem(c(dd));
        b.push(for_loop(
            0,
            c(0),
            c(3),
            vec![
                start_group(),
                permute(0, slice(m), up.clone(), down.clone(), x, left),
                permute(1, slice(m), down, up, x, right),
                end_group(2),
                wait(2),
            ],
        ));
        let report = passes(&b.finish(), d);
        assert_eq!(report.groups, 3 * d);
    }
}

#[test]
fn send_recv_between_two_meshes_passes() {
    // Pipeline transfer: stage 0 = devices 0..h, stage 1 = h..2h, device j sends to j + h;
    // then the reverse exchange in one coalescing group.
    for d in [2, 4, 8] {
        let h = d / 2;
        let mut b = Builder::new("pipeline");
        let m0 = b.mesh("m0", (0..h).collect());
        let m1 = b.mesh("m1", (h..d).collect());
        let x = b.tensor("x", DType::F16, vec![8, 8], m0);
        let y = b.tensor("y", DType::F16, vec![8, 8], m1);
        let back = b.tensor("back", DType::F16, vec![8, 8], m0);
        for j in 0..h {
            b.push(comm(
                j as u32,
                CommKind::SendRecv,
                Team::Devices(vec![j, j + h]),
                x,
                y,
                Some(c(0)),
            ));
        }
        b.push(start_group());
        for j in 0..h {
            b.push(comm(
                (h + j) as u32,
                CommKind::SendRecv,
                Team::Devices(vec![j + h, j]),
                y,
                back,
                Some(c(0)),
            ));
        }
        b.push(end_group(2 * h as u32));
        let report = passes(&b.finish(), d);
        assert_eq!(report.point_to_point, 2 * h);
    }
}

#[test]
fn broadcast_across_meshes_passes() {
    for d in [2, 3, 4, 8] {
        let mut b = Builder::new("bcast_meshes");
        let m0 = b.mesh("m0", vec![0]);
        let m1 = b.mesh("m1", (1..d).collect());
        let x = b.tensor("x", DType::F32, vec![16], m0);
        let y = b.tensor("y", DType::F32, vec![16], m1);
        b.push(comm(
            0,
            CommKind::Broadcast,
            Team::Devices((0..d).collect()),
            x,
            y,
            Some(c(0)),
        ));
        passes(&b.finish(), d);
    }
}

#[test]
fn moe_dispatch_and_combine_pass() {
    for d in WORLD_SIZES {
        let mut b = Builder::new("moe");
        let m = b.mesh("m0", (0..d).collect());
        let x = b.tensor("x", DType::BF16, vec![16, 32], m);
        let idx = b.tensor("topk_idx", DType::I32, vec![16, 2], m);
        let w = b.tensor("topk_w", DType::F32, vec![16, 2], m);
        let ex = b.tensor("expert_x", DType::BF16, vec![2, 64, 32], m);
        let ey = b.tensor("expert_y", DType::BF16, vec![2, 64, 32], m);
        let counts = b.tensor("counts", DType::I32, vec![2], m);
        let routing = b.tensor("routing", DType::I32, vec![2, 64, 2], m);
        let out = b.tensor("out", DType::BF16, vec![16, 32], m);
        let team = slice(m);
        b.push(Inst::new(InstKind::MoeDispatch {
            id: CommId(0),
            team: team.clone(),
            x,
            topk_idx: idx,
            expert_x: ex,
            expert_counts: counts,
            routing,
            wire: meshflow::ir::MoeWire::Native,
        }));
        b.push(wait(0));
        b.push(compute(ComputeOp::Copy, vec![ex], vec![ey]));
        b.push(Inst::new(InstKind::MoeCombine {
            id: CommId(1),
            team,
            expert_y: ey,
            expert_counts: counts,
            routing,
            topk_weights: w,
            out,
        }));
        b.push(wait(1));
        let report = passes(&b.finish(), d);
        assert_eq!(report.events_per_rank, vec![2; d]);
    }
}

/// A 2-D mesh `[rows, cols]`: an all-reduce on every row (DIDx), a ring on every row, and an
/// all-gather on every column (DIDy).
fn mesh_2d(rows: usize, cols: usize) -> HostProgram {
    let cc = cols as i64;
    let mut b = Builder::new("mesh2d");
    let m = b.mesh_nd("m0", vec![rows, cols]);
    let a = b.tensor("a", DType::BF16, vec![8, 8], m);
    let r = b.tensor("r", DType::BF16, vec![8, 8], m);
    let col = b.tensor("col", DType::BF16, vec![8 * rows as u64, 8], m);
    let ring = b.tensor("ring", DType::BF16, vec![8 * cols as u64, 8], m);
    let chunk = b.tensor("ring_chunk", DType::BF16, vec![8, 8], m);
    let x = my_pt(m, ParallelType::DIDx);
    b.push(comm(0, CommKind::AllReduce, slice(m), a, r, None));
    b.push(for_loop(
        0,
        c(0),
        c(cc),
        vec![
            shard(chunk, ring, cols as u64, i(0).add(x.clone()).rem(c(cc))),
            permute(
                1,
                slice(m),
                c(cc).add(x.clone()).sub(i(0)).rem(c(cc)),
                i(0).add(x).rem(c(cc)),
                r,
                chunk,
            ),
            wait(1),
        ],
    ));
    b.push(comm(
        2,
        CommKind::AllGather,
        Team::Slice {
            mesh: m,
            pt: ParallelType::DIDy,
        },
        r,
        col,
        None,
    ));
    b.finish()
}

#[test]
fn two_d_mesh_with_slice_teams_passes() {
    for (rows, cols) in [(1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2)] {
        let d = rows * cols;
        let report = passes(&mesh_2d(rows, cols), d);
        let expected = if d == 1 { 1 } else { rows + cols };
        assert_eq!(
            report.teams.len(),
            expected,
            "{rows}x{cols}: {:?}",
            report.teams
        );
    }
    // Ranks outside every mesh issue nothing and do not block the others.
    let report = passes(&mesh_2d(2, 2), 8);
    assert_eq!(report.events_per_rank[4..], [0, 0, 0, 0]);
}

#[test]
fn events_carry_devices_iterations_and_text() {
    let program = ring_all_gather(4);
    let inst = instantiate(&program, 4).expect("ring instantiates");
    let e = &inst.events[1][2];
    // Step 2 on rank 1: send to (4 + 1 - 2) % 4 = 3, receive from (2 + 1) % 4 = 3.
    assert_eq!((e.send_peer, e.recv_peer), (Some(3), Some(3)));
    assert_eq!(e.iteration.to_string(), " at i0=2");
    assert_eq!(e.send.map(|b| b.bytes()), Some(16 * 32 * 2));
    assert!(inst
        .inst(e)
        .text
        .starts_with("c0 = collective_permute(x -> ag_chunk, team=slice(m0, DIDx)"));
}

#[test]
fn checking_is_fast() {
    // 8 ranks, a 64-step ring and a 64-step stream broadcast: well over a thousand events.
    let mut program = ring_all_gather(8);
    let body = program.body.clone();
    for _ in 0..63 {
        program.body.extend(body.iter().cloned());
    }
    let start = Instant::now();
    let report = passes(&program, 8);
    let elapsed = start.elapsed();
    let total: usize = report.events_per_rank.iter().sum();
    eprintln!("checked {total} events on 8 ranks in {elapsed:?}");
    assert_eq!(total, 8 * 8 * 64);
    assert!(elapsed.as_millis() < 1000, "checking took {elapsed:?}");
}

#[test]
fn text_programs_pass() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/check");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("tests/data/check exists") {
        let path = entry.expect("readable entry").path();
        if path.extension().is_none_or(|e| e != "mfh") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("readable program");
        let ranks: usize = text
            .lines()
            .find_map(|l| l.strip_prefix("# ranks:"))
            .and_then(|r| r.trim().parse().ok())
            .unwrap_or_else(|| panic!("{}: no `# ranks:` header", path.display()));
        let program =
            meshflow::ir::parse_host(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if let Err(e) = meshflow::ir::verify_host(&program) {
            panic!("{}: {e}", path.display());
        }
        passes(&program, ranks);
        checked += 1;
    }
    assert!(checked >= 4, "only {checked} text programs");
}

/// Regression (fuzzing): checking was quadratic in the world size (every rank resolved its
/// team, searched the mesh and copied the member list; the deadlock simulation listed every
/// member as a need of every other) and took hours on a `iota(1048576)` mesh. It is linear
/// now: a quarter-million ranks in one team, and a 512 x 512 mesh with row and column teams.
#[test]
fn checking_a_huge_world_is_linear() {
    let d = 1usize << 18;
    let mut b = Builder::new("huge_1d");
    let m = b.mesh("m0", (0..d).collect());
    let a = b.tensor("a", DType::F32, vec![8], m);
    let r = b.tensor("r", DType::F32, vec![8], m);
    b.push(comm(0, CommKind::AllReduce, slice(m), a, r, None));
    let one_team = b.finish();

    let (rows, cols) = (512usize, 512usize);
    let mut b = Builder::new("huge_2d");
    let m = b.mesh_nd("m0", vec![rows, cols]);
    let a = b.tensor("a", DType::F32, vec![8], m);
    let r = b.tensor("r", DType::F32, vec![8], m);
    let col = b.tensor("col", DType::F32, vec![8 * rows as u64], m);
    b.push(comm(0, CommKind::AllReduce, slice(m), a, r, None));
    let by_column = Team::Slice {
        mesh: m,
        pt: ParallelType::DIDy,
    };
    b.push(comm(1, CommKind::AllGather, by_column, r, col, None));
    let rows_and_columns = b.finish();

    for (program, world, teams) in [
        (one_team, d, 1),
        (rows_and_columns, rows * cols, rows + cols),
    ] {
        let start = Instant::now();
        let report = passes(&program, world);
        let elapsed = start.elapsed();
        eprintln!("checked {} on {world} ranks in {elapsed:?}", program.name);
        assert_eq!(report.teams.len(), teams);
        assert!(elapsed.as_secs() < 30, "checking took {elapsed:?}");
    }
}

/// The stream-order check accepts everything the lowering emits: every example at 1 to 8
/// ranks, with both stream schedules and 1 to 3 worker streams (no false positive), and the
/// chunked all-reduce example with 40000 chunks, which it folds rather than unrolls.
#[test]
fn every_lowered_example_passes_the_stream_order_check() {
    use meshflow::ir::{parse_program_with, Params};
    use meshflow::pipeline::StreamSchedule;
    use meshflow::{compile, Options};
    let dir = crate::support::root().join("examples/programs");
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .expect("examples/programs")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "mf"))
        .collect();
    names.sort();
    let (mut checked, mut not_lowered) = (0, 0);
    for path in &names {
        let text = std::fs::read_to_string(path).expect("readable");
        for ranks in 1..=8i64 {
            let params: Params = [("ranks".to_string(), ranks)].into();
            let Ok(program) = parse_program_with(&text, &params) else {
                not_lowered += 1;
                continue;
            };
            for schedule in [StreamSchedule::PerIteration, StreamSchedule::Prefetch] {
                for streams in [1, 2, 3] {
                    let options = Options::new()
                        .check(false)
                        .streams(streams)
                        .stream_schedule(schedule);
                    let Ok(out) = compile(&program, &options) else {
                        not_lowered += 1;
                        continue;
                    };
                    let world = out.host().world_size();
                    check_program(out.host(), world).unwrap_or_else(|e| {
                        panic!(
                            "{} at {ranks} ranks, {schedule:?}, {streams} streams: {e}\n{}",
                            path.display(),
                            out.host()
                        )
                    });
                    checked += 1;
                }
            }
        }
    }
    eprintln!("{checked} lowered programs pass; {not_lowered} (program, ranks) do not lower");
    assert!(checked >= 200, "{checked}");
    let text = std::fs::read_to_string(dir.join("row_parallel_linear_chunked.mf")).unwrap();
    let params: Params = [("ranks".to_string(), 2), ("s".to_string(), 40_000)].into();
    let program = parse_program_with(&text, &params).unwrap();
    let host = compile(&program, &Options::new().check(false))
        .unwrap()
        .host()
        .clone();
    let start = Instant::now();
    check_program(&host, 2).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("checked 40000 chunks in {:?}", start.elapsed());
}

/// Regression: the check summary printed every rank's count (128 numbers on one line).
#[test]
fn the_summary_of_a_large_world_is_short() {
    let mut counts = vec![3usize; 128];
    counts[5] = 5;
    let report = CheckReport {
        world_size: 128,
        events_per_rank: counts,
        teams: vec![(0..128).collect()],
        collectives_per_team: vec![3],
        point_to_point: 0,
        groups: 0,
    };
    let text = report.to_string();
    assert!(
        text.contains("386 communications (3 to 5 per rank)"),
        "{text}"
    );
    assert!(text.len() < 200, "{text}");
    let even = CheckReport {
        events_per_rank: vec![3; 128],
        ..report
    };
    assert!(even.to_string().contains("(3 per rank)"), "{even}");
}
