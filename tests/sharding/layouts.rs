//! One tensor axis over several mesh axes and strided layouts, end to end at several rank
//! counts (lowered, checked across ranks, run on the CPU backend against the reference):
//!
//! - consecutive collectives of a resharding merge into one over the flattened team of their
//!   mesh axes (`[S0, S0] -> [R, R]` is one all-gather, `[P, P] -> [R, R]` one all-reduce),
//!   unless the pass option `merge_collectives` is off;
//! - a split inside serial pieces (an `inner_split`, DTensor's `_StridedShard`) is gathered by
//!   an all-gather and a local reorder, and sliced into locally; compute ops read and write
//!   strided tensors through plain chains; uneven strided axes are refused by name.

use meshflow::ir::HostProgram;
use meshflow::Options;

use crate::regressions::{comms, run, run_with};

fn has_team(host: &HostProgram, team: &str) -> bool {
    host.to_string().contains(team)
}

fn count(host: &HostProgram, name: &str) -> usize {
    comms(host).get(name).copied().unwrap_or(0)
}

const S0_S0_TO_R: &str = "
program s0_s0 {
  param ranks = 4
  param dy = ranks / 2
  mesh m = iota(dy, 2)
  input x: f32[dy * 6, 5] on m {outer_split(0, dy), parallelize(0, DIDy), outer_split(1, 2), parallelize(1, DIDx)}
  tensor y: f32[dy * 6, 5] on m {}
  y = set(x)
  output y
}
";

#[test]
fn s0_s0_to_replicated_is_one_all_gather_over_the_flattened_mesh() {
    for ranks in [2, 4, 6, 8] {
        let host = run(S0_S0_TO_R, ranks);
        assert_eq!(count(&host, "all_gather"), 1, "ranks={ranks}\n{host}");
        if ranks > 2 {
            assert!(has_team(&host, "flattened(m, DIDy, DIDx)"), "{host}");
        }
    }
}

#[test]
fn without_merging_each_mesh_axis_gathers_alone() {
    let mut options = Options::new().check(false);
    options.pass_options_mut().merge_collectives = false;
    for ranks in [4, 8] {
        let host = run_with(S0_S0_TO_R, ranks, &options);
        assert_eq!(count(&host, "all_gather"), 2, "ranks={ranks}\n{host}");
        assert!(!has_team(&host, "flattened("), "{host}");
    }
}

#[test]
fn partial_sums_over_two_mesh_axes_reduce_once() {
    let text = |target: &str| {
        format!(
            "
program p_p {{
  param ranks = 4
  param dy = ranks / 2
  mesh m = iota(dy, 2)
  input a: f32[dy * 4, 3, dy * 2] on m {{outer_split(2, dy), parallelize(2, DIDy), outer_split(3, 2), parallelize(3, DIDx)}}
  tensor x: f32[dy * 4, 3, r(dy * 2)] on m {{outer_split(2, dy), parallelize(2, DIDy), outer_split(3, 2), parallelize(3, DIDx)}}
  tensor y: f32[dy * 4, 3] on m {target}
  x = sum(a, axis=2)
  y = set(x)
  output y
}}
"
        )
    };
    let replicated = text("{}");
    let s0_s0 =
        text("{outer_split(0, dy), parallelize(0, DIDy), outer_split(1, 2), parallelize(1, DIDx)}");
    for ranks in [4, 6, 8] {
        let host = run(&replicated, ranks);
        assert_eq!(count(&host, "all_reduce"), 1, "ranks={ranks}\n{host}");
        let host = run(&s0_s0, ranks);
        assert_eq!(count(&host, "reduce_scatter"), 1, "ranks={ranks}\n{host}");
        assert_eq!(count(&host, "all_reduce"), 0, "ranks={ranks}\n{host}");
    }
}

#[test]
fn strided_shards_gather_with_a_local_reorder() {
    // Rows in 3 serial pieces, each split over DIDx: device k holds rows k of every piece.
    let text = "
program strided {
  param ranks = 4
  mesh m = iota(ranks)
  input x: f32[ranks * 6, 5] on m {outer_split(0, 3), outer_split(1, ranks), parallelize(1, DIDx)}
  tensor y: f32[ranks * 6, 5] on m {}
  tensor z: f32[ranks * 6, 5] on m {}
  y = set(x)
  z = gelu(y)
  output z
}
";
    for ranks in [1, 2, 3, 4, 5, 8] {
        let host = run(text, ranks);
        let want = usize::from(ranks > 1);
        assert_eq!(count(&host, "all_gather"), want, "ranks={ranks}\n{host}");
    }
}

#[test]
fn strided_targets_are_sliced_locally_and_change_factor_through_a_gather() {
    let text = |from: &str, to: &str| {
        format!(
            "
program strided {{
  param ranks = 4
  mesh m = iota(ranks)
  input x: f32[ranks * 6, 5] on m {from}
  tensor y: f32[ranks * 6, 5] on m {to}
  y = set(x)
  output y
}}
"
        )
    };
    let by3 = "{outer_split(0, 3), outer_split(1, ranks), parallelize(1, DIDx)}";
    let by2 = "{outer_split(0, 2), outer_split(1, ranks), parallelize(1, DIDx)}";
    for ranks in [1, 2, 3, 4, 5, 8] {
        let host = run(&text("{}", by3), ranks);
        assert!(comms(&host).is_empty(), "ranks={ranks}\n{host}");
        let host = run(&text(by2, by3), ranks);
        assert_eq!(
            count(&host, "all_gather"),
            usize::from(ranks > 1),
            "ranks={ranks}\n{host}"
        );
    }
}

#[test]
fn strided_inside_an_outer_mesh_axis() {
    // nvFuser's [DIDy, 2, DIDx] on one axis: serial pieces inside the DIDy chunk.
    let text = "
program strided_2d {
  param ranks = 4
  param dy = ranks / 2
  mesh m = iota(dy, 2)
  input x: f32[dy * 12, 3] on m {outer_split(0, dy), parallelize(0, DIDy), outer_split(1, 3), outer_split(2, 2), parallelize(2, DIDx)}
  tensor y: f32[dy * 12, 3] on m {}
  y = set(x)
  output y
}
";
    for ranks in [2, 4, 6, 8] {
        let host = run(text, ranks);
        assert!(count(&host, "all_gather") >= 1, "ranks={ranks}\n{host}");
    }
}

#[test]
fn uneven_strided_shards_are_refused_by_name() {
    let text = "
program strided_uneven {
  mesh m = iota(2)
  input x: f32[7, 3] on m {outer_split(0, 3), outer_split(1, 2), parallelize(1, DIDx)}
  tensor y: f32[7, 3] on m {}
  y = set(x)
  output y
}
";
    let program = meshflow::ir::parse::parse_program(text).expect("parses");
    let Err(err) = meshflow::compile(&program, &Options::new().check(false)) else {
        panic!("an uneven strided axis was lowered");
    };
    let err = err.to_string();
    assert!(
        err.contains("`x`") && err.contains("serial") && err.contains("divides"),
        "{err}"
    );
}

#[test]
fn compute_ops_read_and_write_strided_tensors_through_plain_chains() {
    let text = "
program strided_compute {
  param ranks = 4
  mesh m = iota(ranks)
  input x: f32[ranks * 6, 5] on m {outer_split(0, 3), outer_split(1, ranks), parallelize(1, DIDx)}
  tensor y: f32[ranks * 6, 5] on m {outer_split(0, 2), outer_split(1, ranks), parallelize(1, DIDx)}
  tensor z: f32[ranks * 6, 5] on m {outer_split(0, ranks), parallelize(0, DIDx)}
  y = gelu(x)
  z = silu(y)
  output z
}
";
    for ranks in [1, 2, 3, 4, 5, 8] {
        run(text, ranks);
    }
}
