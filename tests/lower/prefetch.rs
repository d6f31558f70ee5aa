//! `StreamSchedule::Prefetch` (`prefetch_transfers`): every example program, compiled with it
//! for 1, 2, 3, 4 and 8 ranks (where the program parses), passes the cross-rank check and
//! matches the unsharded reference on CPU ranks with the race checker on; ring loops take the
//! prefetch shape (compute on the main stream, permutes one iteration ahead on worker 0, the
//! first chunk computed from the input), other loops (broadcasts, for one) keep one worker per
//! iteration.

use meshflow::check::check_program;
use meshflow::ir::{parse_program_with, Params, Program};
use meshflow::pipeline::StreamSchedule;
use meshflow::runtime::{run_and_compare, CpuOptions};
use meshflow::{compile, Options};

const EXAMPLES: [&str; 11] = [
    "column_parallel_linear_broadcast",
    "column_parallel_linear_collective",
    "column_parallel_linear_ring",
    "fsdp_tp_weight",
    "mlp_2d_mesh",
    "moe_layer",
    "moe_layer_fp8",
    "pipeline_two_meshes",
    "row_parallel_linear_chunked",
    "row_parallel_linear_ring",
    "transformer_block_2d",
];

fn parse(name: &str, ranks: i64) -> Option<Program> {
    let path = format!("{}/examples/programs/{name}.mf", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut params = Params::new();
    params.insert("ranks".into(), ranks);
    parse_program_with(&text, &params).ok()
}

fn prefetch() -> Options {
    Options::new()
        .check(false)
        .stream_schedule(StreamSchedule::Prefetch)
        .verify_each_pass(true)
}

#[test]
fn every_example_matches_the_reference_with_prefetched_transfers() {
    let mut runs = 0;
    for name in EXAMPLES {
        for ranks in [1i64, 2, 3, 4, 8] {
            let Some(program) = parse(name, ranks) else {
                continue;
            };
            let Ok(c) = compile(&program, &prefetch()) else {
                // The default schedule must reject it too (a size the example does not support).
                assert!(
                    compile(&program, &Options::new().check(false)).is_err(),
                    "{name} at {ranks} ranks compiles only with the default schedule"
                );
                continue;
            };
            let world = c.host().world_size();
            check_program(c.host(), world)
                .unwrap_or_else(|e| panic!("{name} at {ranks} ranks:\n{e}\n{}", c.host()));
            for seed in [1, 2] {
                let cmp = run_and_compare(
                    c.level1().expect("lowered"),
                    c.host(),
                    world,
                    seed,
                    &CpuOptions::default(),
                )
                .unwrap_or_else(|e| panic!("{name} at {ranks} ranks: {e}\n{}", c.host()));
                assert!(cmp.passed(), "{name} at {ranks} ranks: {cmp}\n{}", c.host());
            }
            runs += 1;
        }
    }
    assert!(runs >= 20, "only {runs} example runs");
}

#[test]
fn ring_loops_take_the_prefetch_shape_and_broadcast_loops_do_not() {
    for ranks in [2i64, 4] {
        let program = parse("column_parallel_linear_broadcast", ranks).expect("the example parses");
        let text = compile(&program, &prefetch())
            .unwrap()
            .host()
            .clone()
            .to_string();
        assert!(text.contains("set_current_stream worker(i0"), "{text}");
    }
    for name in ["column_parallel_linear_ring"] {
        for ranks in [2i64, 4] {
            let program = parse(name, ranks).expect("the example parses");
            let text = compile(&program, &prefetch())
                .unwrap()
                .host()
                .clone()
                .to_string();
            // The compute runs on the main stream: no worker per iteration.
            assert!(!text.contains("worker(i0"), "{name}:\n{text}");
            // Step 0 is a copy to itself: the first chunk is computed straight from the input,
            // without waiting for any transfer, while the first real transfer runs on worker 0;
            // the copy itself is left out (`ag` is a temporary nobody else reads).
            let first = text.find("linear(x, w -> ").expect("the GEMM of the input");
            let first_wait = text.find("wait c").expect("a wait");
            assert!(first < first_wait, "{name}: the first GEMM waits:\n{text}");
            assert_eq!(
                text.matches("collective_permute(").count(),
                if ranks == 2 { 1 } else { 2 },
                "{name}: d - 1 transfers and no copy to itself:\n{text}"
            );
            assert!(
                text[..first].contains("collective_permute("),
                "{name}: the first transfer before the first GEMM:\n{text}"
            );
            // The loop runs the remaining d - 2 transfers: the transfer of the next chunk on
            // worker 0 first, then back to the main stream for the compute, then the wait.
            match text.find(&format!("for i0 in 1..{} ", ranks - 1)) {
                None => assert!(ranks == 2 && !text.contains("for i0"), "{name}:\n{text}"),
                Some(at) => {
                    let body = &text[at..];
                    let (w, back, gemm, wait) = (
                        body.find("set_current_stream worker(0)").expect("worker 0"),
                        body.find("set_current_stream s")
                            .expect("back to the main stream"),
                        body.find("linear(").expect("the GEMM"),
                        body.find("wait c").expect("the wait"),
                    );
                    assert!(w < back && back < gemm && gemm < wait, "{name}:\n{text}");
                }
            }
            // The per-iteration schedule is unchanged.
            let per_iteration = Options::new()
                .check(false)
                .stream_schedule(StreamSchedule::PerIteration);
            let default = compile(&program, &per_iteration)
                .unwrap()
                .host()
                .to_string();
            assert!(
                default.contains("set_current_stream worker(i0"),
                "{name}:\n{default}"
            );
        }
    }
}

#[test]
fn a_gathered_output_keeps_the_copy_to_itself_and_matches_the_reference() {
    // With `ag` an output its own chunk is read after the run: the copy to itself stays (on
    // worker 0, after the first real transfer) and both outputs match the reference.
    let path = format!(
        "{}/examples/programs/column_parallel_linear_ring.mf",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("  output y\n", "  output y\n  output ag\n");
    for ranks in [2i64, 3, 4, 8] {
        let mut params = Params::new();
        params.insert("ranks".into(), ranks);
        let program = parse_program_with(&text, &params).expect("the variant parses");
        let c = compile(&program, &prefetch()).unwrap();
        let host = c.host().to_string();
        let first = host.find("linear(x, w -> ").expect("the GEMM of the input");
        let before = &host[..first];
        let (transfer, copy) = (
            before
                .find("send=(my(m0, DIDx) + ")
                .expect("the first transfer"),
            before
                .find("send=my(m0, DIDx), recv=my(m0, DIDx)")
                .expect("the copy to itself"),
        );
        assert!(transfer < copy, "{host}");
        let world = c.host().world_size();
        check_program(c.host(), world).unwrap_or_else(|e| panic!("{ranks} ranks: {e}\n{host}"));
        let cmp = run_and_compare(
            c.level1().expect("lowered"),
            c.host(),
            world,
            3,
            &CpuOptions::default(),
        )
        .unwrap_or_else(|e| panic!("{ranks} ranks: {e}\n{host}"));
        assert!(cmp.passed(), "{ranks} ranks: {cmp}\n{host}");
    }
}
