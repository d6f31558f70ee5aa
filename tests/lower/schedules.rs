//! Every plan the schedule search can take, forced through the options the user has: each is
//! compiled for 1, 2, 3, 4, 5 and 8 ranks with 1, 2 and 3 worker streams, passes the cross-rank
//! check and matches the unsharded reference on CPU ranks with the race checker on. Insta
//! snapshots of the lowered neighbour rings and per-step reduces.

use std::collections::BTreeMap;

use meshflow::check::check_program;
use meshflow::ir::{DType, DeviceMesh, ParallelType::DIDx, Program, ProgramBuilder};
use meshflow::pipeline::StreamSchedule;
use meshflow::runtime::{run_and_compare, CpuOptions};
use meshflow::{compile, Compiled, Options};
use meshflow::{CostModel, Decomposition, Profile};

const RANKS: [u64; 6] = [1, 2, 3, 4, 5, 8];

/// Column-parallel linear with nothing but the inputs annotated: `x_gathered` is the search's.
fn agmm(d: u64, dtype: DType) -> Program {
    let mut b = ProgramBuilder::new("agmm");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let x = b.input("x", dtype, &[16 * d, 32], m).unwrap();
    let w = b.input("w", dtype, &[12 * d, 32], m).unwrap();
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, d).parallelize(0, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    b.build().unwrap()
}

/// Row-parallel linear: the partial sums `y` are left to the search, `z` is split on rows.
fn rsmm(d: u64, dtype: DType) -> Program {
    let mut b = ProgramBuilder::new("rsmm");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let x = b.input("x", dtype, &[16 * d, 16 * d], m).unwrap();
    let w = b.input("w", dtype, &[24, 16 * d], m).unwrap();
    b.schedule(x).outer_split(1, d).parallelize(1, DIDx);
    b.schedule(w).outer_split(1, d).parallelize(1, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    let z = b.set(y).unwrap();
    b.rename(z, "z").unwrap();
    b.schedule(z).outer_split(0, d).parallelize(0, DIDx);
    b.output(z);
    b.build().unwrap()
}

fn options(tensor: &str, d: Decomposition, schedule: StreamSchedule, streams: usize) -> Options {
    Options::new()
        .check(false)
        .streams(streams)
        .stream_schedule(schedule)
        .decomposition(tensor, d)
        .verify_each_pass(true)
}

/// Checks `c` across ranks and runs it against the reference with the race checker on.
fn check_and_run(what: &str, c: &Compiled) {
    check_and_run_host(what, c.level1().expect("lowered"), c.host());
}

/// As [`check_and_run`], for a host program lowered from `program` by hand.
fn check_and_run_host(what: &str, program: &Program, host: &meshflow::ir::HostProgram) {
    let world = host.world_size();
    check_program(host, world).unwrap_or_else(|e| panic!("{what}: {e}\n{host}"));
    let mut cpu = CpuOptions::default();
    cpu.config.race_check = true;
    let cmp = run_and_compare(program, host, world, 5, &cpu)
        .unwrap_or_else(|e| panic!("{what}: {e}\n{host}"));
    assert!(cmp.passed(), "{what}: {cmp}\n{host}");
}

/// A profile where an add costs far more than a GEMM piece: the reduce-scatter ring hides its
/// adds under the GEMM pieces (4 per step).
fn adds_are_expensive() -> CostModel {
    let mut p = Profile::builtin("h200x2").unwrap();
    p.memory.hbm_gb_s = 1.0;
    p.memory.concurrent_add_slowdown = 0.0;
    p.host.launch_us = 0.01;
    CostModel::new(p)
}

#[test]
fn every_all_gather_plan_runs_at_every_rank_count() {
    let plans = [
        (Decomposition::Collective, StreamSchedule::Auto),
        (Decomposition::StreamBroadcast, StreamSchedule::Auto),
        (Decomposition::Ring, StreamSchedule::PerIteration),
        (Decomposition::Ring, StreamSchedule::Prefetch),
        (Decomposition::RingForward, StreamSchedule::Auto),
        (Decomposition::RingBidirectional, StreamSchedule::Auto),
    ];
    let mut runs = 0;
    for d in RANKS {
        for dtype in [DType::F32, DType::BF16] {
            let program = agmm(d, dtype);
            for (dec, schedule) in plans {
                for streams in [1, 2, 3] {
                    let what = format!(
                        "agmm d={d} {dtype} {} {} streams={streams}",
                        dec.name(),
                        schedule.name()
                    );
                    let c = compile(&program, &options("x_gathered", dec, schedule, streams));
                    if d == 1 && dec != Decomposition::Collective {
                        // A team of one has nothing to decompose.
                        let e = c.expect_err(&what).to_string();
                        assert!(e.contains("cannot be decomposed"), "{what}: {e}");
                        continue;
                    }
                    let c = c.unwrap_or_else(|e| panic!("{what}: {e}"));
                    if d == 1 {
                        // A team of one: the resharding is a local copy, nothing to choose.
                        assert!(c.explain().is_empty(), "{what}: {:?}", c.explain());
                        check_and_run(&what, &c);
                        runs += 1;
                        continue;
                    }
                    let chosen = &c.explain()[0].chosen;
                    assert!(
                        chosen.starts_with(&format!("{}(", dec.name())),
                        "{what}: {chosen}"
                    );
                    check_and_run(&what, &c);
                    runs += 1;
                }
            }
        }
    }
    assert_eq!(runs, 2 * 3 + 5 * 2 * 6 * 3);
}

#[test]
fn neighbour_rings_also_fill_a_gathered_output() {
    // The annotated ring example with its gathered `ag` also an output, lowered with a plan
    // for a forwarding or bidirectional ring: the own chunk is copied into `ag` as well.
    let text = include_str!("../../examples/programs/column_parallel_linear_ring.mf")
        .replace("  output y\n", "  output y\n  output ag\n");
    for d in [1i64, 2, 3, 4, 8] {
        let params = meshflow::ir::Params::from([("ranks".to_string(), d)]);
        let program = meshflow::ir::parse_program_with(&text, &params).unwrap();
        let c = compile(&program, &Options::new().check(false)).unwrap();
        for dec in [Decomposition::RingForward, Decomposition::RingBidirectional] {
            let plan = meshflow::Plan {
                decomposition: dec,
                pieces: 1,
                schedule: StreamSchedule::Prefetch,
                transport: meshflow::Transport::Nccl,
                accumulate: false,
            };
            let plans = BTreeMap::from([("ag".to_string(), plan)]);
            let (host, _) = meshflow::passes::passes::lower_to_host::lower_planned(
                c.level1().expect("lowered"),
                &plans,
            )
            .unwrap();
            meshflow::ir::verify_host(&host).unwrap();
            let what = format!("ring example d={d} {}", dec.name());
            let text = host.to_string();
            if d > 1 {
                assert!(
                    text.contains("ag_own"),
                    "{what}: the own chunk is copied\n{text}"
                );
            }
            check_and_run_host(&what, c.level1().expect("lowered"), &host);
        }
    }
}

#[test]
fn every_reduce_scatter_plan_runs_at_every_rank_count() {
    let mut runs = 0;
    for d in RANKS {
        for dtype in [DType::F32, DType::BF16] {
            let program = rsmm(d, dtype);
            let mut cases: Vec<(String, Options)> = Vec::new();
            for dec in [
                Decomposition::Collective,
                Decomposition::StreamReduce,
                Decomposition::RingForward,
            ] {
                for streams in [1, 2, 3] {
                    let o = options("y", dec, StreamSchedule::Auto, streams);
                    cases.push((format!("{} streams={streams}", dec.name()), o));
                }
            }
            // The ring in four pieces per step, from a profile where that pays.
            let pieces = options("y", Decomposition::RingForward, StreamSchedule::Auto, 2)
                .cost_model(adds_are_expensive());
            cases.push(("ring_forward in 4 pieces".into(), pieces));
            for (name, o) in cases {
                let what = format!("rsmm d={d} {dtype} {name}");
                let forced = o.pass_options().decompositions["y"];
                let c = compile(&program, &o);
                if d == 1 && forced != Decomposition::Collective {
                    let e = c.expect_err(&what).to_string();
                    assert!(e.contains("cannot be decomposed"), "{what}: {e}");
                    continue;
                }
                let c = c.unwrap_or_else(|e| panic!("{what}: {e}"));
                if name.contains("pieces") {
                    assert_eq!(c.plans()["y"].pieces, 4, "{what}: {}", c.explain()[0]);
                }
                check_and_run(&what, &c);
                runs += 1;
            }
        }
    }
    assert_eq!(runs, 2 * 3 + 5 * 2 * 10);
}

#[test]
fn the_default_lowering_of_large_cases_decomposes_and_passes_the_check() {
    // Shapes large enough (per the profile) that the search decomposes; the plans it picks by
    // itself pass the cross-rank check (running them on CPU ranks would take minutes; the same
    // plans run above at small sizes, forced).
    for d in [2u64, 3, 4] {
        for (name, program) in [("agmm", big_agmm(d)), ("rsmm", big_rsmm(d))] {
            let c = compile(&program, &Options::new().check(false)).unwrap();
            let chosen = &c.explain()[0].chosen;
            assert!(
                !chosen.starts_with("collective"),
                "{name} d={d}: {}",
                c.explain()[0]
            );
            let world = c.host().world_size();
            check_program(c.host(), world).unwrap_or_else(|e| panic!("{name} d={d}: {e}"));
        }
    }
}

/// AG+GEMM at 8192 x 8192 x 8192, bf16 (lowered, not run: the CPU backend would take minutes).
fn big_agmm(d: u64) -> Program {
    let mut b = ProgramBuilder::new("agmm");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let n = 8192 * d / 2;
    let x = b.input("x", DType::BF16, &[n, 8192], m).unwrap();
    let w = b.input("w", DType::BF16, &[n, 8192], m).unwrap();
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, d).parallelize(0, DIDx);
    let y = b.linear(x, w).unwrap();
    b.output(y);
    b.build().unwrap()
}

/// GEMM+RS at 8192 x 8192 x 8192, bf16.
fn big_rsmm(d: u64) -> Program {
    let mut b = ProgramBuilder::new("rsmm");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let n = 8192 * d / 2;
    let x = b.input("x", DType::BF16, &[n, n], m).unwrap();
    let w = b.input("w", DType::BF16, &[8192, n], m).unwrap();
    b.schedule(x).outer_split(1, d).parallelize(1, DIDx);
    b.schedule(w).outer_split(1, d).parallelize(1, DIDx);
    let y = b.linear(x, w).unwrap();
    b.rename(y, "y").unwrap();
    let z = b.set(y).unwrap();
    b.schedule(z).outer_split(0, d).parallelize(0, DIDx);
    b.output(z);
    b.build().unwrap()
}

#[test]
fn snapshots_of_the_lowered_rings_and_reduces() {
    let ag = agmm(4, DType::BF16);
    for (dec, schedule) in [
        (Decomposition::Ring, StreamSchedule::Prefetch),
        (Decomposition::RingForward, StreamSchedule::Auto),
        (Decomposition::RingBidirectional, StreamSchedule::Auto),
    ] {
        let c = compile(&ag, &options("x_gathered", dec, schedule, 2)).unwrap();
        let name = format!("agmm_{}_{}", dec.name(), schedule.name());
        insta::assert_snapshot!(name, c.host().to_string());
    }
    let rs = rsmm(4, DType::F32);
    let c = compile(
        &rs,
        &options("y", Decomposition::StreamReduce, StreamSchedule::Auto, 2),
    )
    .unwrap();
    insta::assert_snapshot!("rsmm_reduce", c.host().to_string());
    let pieces = options("y", Decomposition::RingForward, StreamSchedule::Auto, 2)
        .cost_model(adds_are_expensive());
    let c = compile(&rs, &pieces).unwrap();
    insta::assert_snapshot!("rsmm_ring_forward_pieces", c.host().to_string());
    // The ring accumulating in place, 2 pieces per step, as lowered (before the host passes).
    let plan = meshflow::Plan {
        pieces: 2,
        accumulate: true,
        ..c.plans()["y"]
    };
    let plans = BTreeMap::from([("y".to_string(), plan)]);
    let (host, _) =
        meshflow::passes::passes::lower_to_host::lower_planned(c.level1().unwrap(), &plans)
            .unwrap();
    insta::assert_snapshot!("rsmm_ring_forward_accumulate_pieces", host.to_string());
}

#[test]
fn forced_pieces_pick_the_cut_ring_and_bad_pieces_are_named_errors() {
    for d in [2u64, 3, 4] {
        let program = rsmm(d, DType::F32);
        for pieces in [1u64, 2, 4] {
            let o = options("y", Decomposition::RingForward, StreamSchedule::Auto, 2)
                .pieces("y", pieces);
            let what = format!("rsmm d={d} ring_forward pieces={pieces}");
            let c = compile(&program, &o).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(c.plans()["y"].pieces, pieces, "{what}: {}", c.explain()[0]);
            check_and_run(&what, &c);
        }
        // Pieces alone (no forced decomposition) leave only the cut reduce-scatter ring.
        let c = compile(&program, &Options::new().check(false).pieces("y", 2)).unwrap();
        assert_eq!(c.plans()["y"].decomposition, Decomposition::RingForward);
        assert_eq!(c.plans()["y"].pieces, 2);
        for (o, want) in [
            (Options::new().pieces("y", 3), "cannot be cut into 3 pieces"),
            (Options::new().pieces("y", 0), "at least 1"),
            (Options::new().pieces("nope", 2), "nope"),
            (
                Options::new()
                    .decomposition("y", Decomposition::StreamReduce)
                    .pieces("y", 2),
                "cannot be cut into 2 pieces",
            ),
        ] {
            let e = compile(&program, &o).expect_err(want).to_string();
            assert!(e.contains(want), "d={d}: {e}");
        }
    }
    let e = compile(
        &agmm(2, DType::F32),
        &Options::new().pieces("x_gathered", 2),
    )
    .expect_err("an all-gather has no pieces")
    .to_string();
    assert!(e.contains("reduce-scatter"), "{e}");
}

#[test]
fn the_reduce_scatter_ring_runs_with_and_without_accumulating_in_place() {
    // Both lowerings of the ring of running sums, in 1, 2 and 4 pieces per step, at every
    // rank count: with a separate add per step, and accumulating in place (the received sum
    // lands in the step's accumulator or in z, the chunk GEMM adds onto it).
    let mut runs = 0;
    for d in RANKS.into_iter().filter(|&d| d >= 2) {
        for dtype in [DType::F32, DType::BF16] {
            let program = rsmm(d, dtype);
            let o = options("y", Decomposition::RingForward, StreamSchedule::Auto, 2);
            let c = compile(&program, &o).unwrap();
            let level1 = c.level1().expect("lowered");
            for pieces in [1u64, 2, 4] {
                for accumulate in [false, true] {
                    let plan = meshflow::Plan {
                        decomposition: Decomposition::RingForward,
                        pieces,
                        schedule: StreamSchedule::Prefetch,
                        transport: meshflow::Transport::Nccl,
                        accumulate,
                    };
                    let plans = BTreeMap::from([("y".to_string(), plan)]);
                    let (host, _) =
                        meshflow::passes::passes::lower_to_host::lower_planned(level1, &plans)
                            .unwrap();
                    meshflow::ir::verify_host(&host).unwrap();
                    let what =
                        format!("rsmm d={d} {dtype} pieces={pieces} accumulate={accumulate}");
                    let text = host.to_string();
                    assert_eq!(
                        text.contains("linear_accumulate("),
                        accumulate,
                        "{what}\n{text}"
                    );
                    assert_eq!(text.contains("add("), !accumulate, "{what}\n{text}");
                    // Accumulating: one transfer per piece of every step but the last.
                    let permutes = text.matches("collective_permute(").count() as u64;
                    if accumulate {
                        assert!(permutes >= pieces.min(2), "{what}\n{text}");
                        assert!(!text.contains("z_part"), "{what}\n{text}");
                    }
                    check_and_run_host(&what, level1, &host);
                    runs += 1;
                }
            }
        }
    }
    assert_eq!(runs, 5 * 2 * 3 * 2);
}

#[test]
fn the_ring_accumulates_in_place_only_where_the_producer_is_a_linear_of_one_dtype() {
    let d = 2;
    // Where it applies, both lowerings are candidates and priced.
    let c = compile(
        &rsmm(d, DType::BF16),
        &options("y", Decomposition::RingForward, StreamSchedule::Auto, 2),
    )
    .unwrap();
    let record = &c.explain()[0];
    let labels: Vec<&str> = record.variants.iter().map(|v| v.variant.as_str()).collect();
    assert!(
        labels.iter().any(|l| l.ends_with(", accumulate)")),
        "{record}"
    );
    assert!(
        labels.iter().any(|l| !l.ends_with(", accumulate)")),
        "{record}"
    );
    // A producer other than a linear (a matmul): only the ring with a separate add.
    let mut b = ProgramBuilder::new("rsmm_matmul");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).unwrap())
        .unwrap();
    let x = b.input("x", DType::F32, &[16 * d, 16 * d], m).unwrap();
    let w = b.input("w", DType::F32, &[16 * d, 24], m).unwrap();
    b.schedule(x).outer_split(1, d).parallelize(1, DIDx);
    b.schedule(w).outer_split(0, d).parallelize(0, DIDx);
    let y = b.matmul(x, w).unwrap();
    b.rename(y, "y").unwrap();
    let z = b.set(y).unwrap();
    b.schedule(z).outer_split(0, d).parallelize(0, DIDx);
    b.output(z);
    let program = b.build().unwrap();
    let c = compile(
        &program,
        &options("y", Decomposition::RingForward, StreamSchedule::Auto, 2),
    )
    .unwrap();
    let record = &c.explain()[0];
    assert!(
        record
            .variants
            .iter()
            .all(|v| !v.variant.contains("accumulate")),
        "{record}"
    );
    assert!(!c.plans()["y"].accumulate);
    check_and_run("rsmm matmul d=2", &c);
    // A plan that asks for it there is a named error.
    let plan = meshflow::Plan {
        accumulate: true,
        ..c.plans()["y"]
    };
    let plans = BTreeMap::from([("y".to_string(), plan)]);
    let e = meshflow::passes::passes::lower_to_host::lower_planned(c.level1().unwrap(), &plans)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`y`") && e.contains("cannot accumulate in place"),
        "{e}"
    );
}
