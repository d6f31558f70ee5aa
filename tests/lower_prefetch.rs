//! `StreamSchedule::Prefetch` (`prefetch_transfers`): every example program, compiled with it
//! for 1, 2, 3, 4 and 8 ranks (where the program parses), passes the cross-rank check and
//! matches the unsharded reference on sim ranks with the race checker on; ring loops take the
//! prefetch shape (compute on the main stream, permutes one iteration ahead on worker 0), other
//! loops (broadcasts, for one) keep one worker per iteration.

use meshflow::check::check_program;
use meshflow::ir::{parse_program_with, Params, Program};
use meshflow::pipeline::{compile, CompileOptions, StreamSchedule};
use meshflow::runtime::{run_and_compare, SimOptions};

const EXAMPLES: [&str; 7] = [
    "column_parallel_linear_broadcast",
    "column_parallel_linear_collective",
    "column_parallel_linear_ring",
    "mlp_2d_mesh",
    "moe_layer",
    "pipeline_two_meshes",
    "row_parallel_linear_chunked",
];

fn parse(name: &str, ranks: i64) -> Option<Program> {
    let path = format!("{}/examples/programs/{name}.mf", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut params = Params::new();
    params.insert("ranks".into(), ranks);
    parse_program_with(&text, &params).ok()
}

fn prefetch() -> CompileOptions {
    CompileOptions {
        stream_schedule: StreamSchedule::Prefetch,
        verify: true,
        ..CompileOptions::default()
    }
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
                    compile(&program, &CompileOptions::default()).is_err(),
                    "{name} at {ranks} ranks compiles only with the default schedule"
                );
                continue;
            };
            let world = c.host.world_size();
            check_program(&c.host, world)
                .unwrap_or_else(|e| panic!("{name} at {ranks} ranks:\n{e}\n{}", c.host));
            for seed in [1, 2] {
                let cmp = run_and_compare(&c.program, &c.host, world, seed, &SimOptions::default())
                    .unwrap_or_else(|e| panic!("{name} at {ranks} ranks: {e}\n{}", c.host));
                assert!(cmp.passed(), "{name} at {ranks} ranks: {cmp}\n{}", c.host);
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
        let text = compile(&program, &prefetch()).unwrap().host.to_string();
        assert!(text.contains("set_current_stream worker(i0"), "{text}");
    }
    for name in ["column_parallel_linear_ring"] {
        for ranks in [2i64, 4] {
            let program = parse(name, ranks).expect("the example parses");
            let text = compile(&program, &prefetch()).unwrap().host.to_string();
            // The compute runs on the main stream: no worker per iteration.
            assert!(!text.contains("worker(i0"), "{name}:\n{text}");
            // The loop body: the transfer of the next chunk on worker 0 first, then back to the
            // main stream for the compute, then the wait for the transfer.
            // The first chunk moves before the loop, which runs d - 1 times.
            let at = text
                .find(&format!("for i0 in 0..{} ", ranks - 1))
                .expect("a loop of d - 1 iterations");
            assert!(
                text[..at].contains("collective_permute("),
                "{name}: no transfer before the loop:\n{text}"
            );
            let body = &text[at..];
            let (w, back, gemm, wait) = (
                body.find("set_current_stream worker(0)").expect("worker 0"),
                body.find("set_current_stream s")
                    .expect("back to the main stream"),
                body.find("linear(").expect("the GEMM"),
                body.find("wait c").expect("the wait"),
            );
            assert!(w < back && back < gemm && gemm < wait, "{name}:\n{text}");
            // The default schedule is unchanged.
            let default = compile(&program, &CompileOptions::default())
                .unwrap()
                .host
                .to_string();
            assert!(
                default.contains("set_current_stream worker(i0"),
                "{name}:\n{default}"
            );
        }
    }
}
