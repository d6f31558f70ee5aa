//! The pass manager: disabling, dumping, timing, verification.

mod common;

use meshflow_ir::{DType, ParallelType::*, Program};
use meshflow_passes::{PassError, PassManager, PassOptions, Stage};

fn ring() -> Program {
    let (mut b, m) = common::builder("ring", 2);
    let x = b.input("x", DType::F32, &[8, 4], m).unwrap();
    b.schedule(x).outer_split(0, 2).parallelize(0, DIDx);
    let ag = b.set(x).unwrap();
    b.rename(ag, "ag").unwrap();
    b.schedule(ag)
        .outer_split(0, 2)
        .swizzle1d(0, DIDx)
        .parallelize(0, Stream);
    let y = b.gelu(ag).unwrap();
    b.rename(y, "y").unwrap();
    b.output(y);
    b.build().unwrap()
}

fn manager() -> PassManager {
    common::all_passes()
}

fn with(f: impl FnOnce(&mut PassOptions)) -> PassOptions {
    let mut o = common::verifying();
    f(&mut o);
    o
}

#[test]
fn unknown_pass_names_list_the_valid_ones() {
    let p = ring();
    let o = with(|o| o.disabled_passes.push("fuse_everything".into()));
    let e = manager().run(p.clone(), &o).unwrap_err();
    let PassError::UnknownPass { name, valid } = &e else {
        panic!("{e}");
    };
    assert_eq!(name, "fuse_everything");
    assert!(valid.contains("propagate_shardings") && valid.contains("defer_waits"));
    let o = with(|o| o.dump_after = Some("nope".into()));
    assert!(manager().run(p, &o).is_err());
}

#[test]
fn required_passes_cannot_be_disabled() {
    for p in ["lower_to_host", "verify_program", "verify_host"] {
        let o = with(|o| o.disabled_passes.push(p.into()));
        let e = manager().check_options(&o).unwrap_err();
        assert!(matches!(e, PassError::CannotDisable { .. }), "{e}");
        assert!(e.to_string().contains(p));
    }
}

#[test]
fn disabled_passes_are_skipped_and_reported() {
    let o = with(|o| {
        o.disabled_passes = vec!["assign_streams".into(), "defer_waits".into()];
    });
    let out = manager().run(ring(), &o).unwrap();
    let text = out.host.to_string();
    assert!(!text.contains("get_current_stream"), "{text}");
    assert!(!text.contains("_ring"), "no double buffering: {text}");
    let skipped: Vec<_> = out
        .timings
        .iter()
        .filter(|t| !t.ran)
        .map(|t| t.pass)
        .collect();
    assert_eq!(skipped, vec!["assign_streams", "defer_waits"]);
    assert_eq!(out.timings.len(), 10);
}

#[test]
fn dumps_after_one_pass_or_all() {
    let p = ring();
    let o = with(|o| o.dump_after = Some("lower_to_host".into()));
    let out = manager().run(p.clone(), &o).unwrap();
    assert_eq!(out.dumps.len(), 1);
    assert!(out.dumps[0].text.starts_with("host ring {"));
    let o = with(|o| o.dump_after = Some("all".into()));
    let out = manager().run(p, &o).unwrap();
    assert_eq!(out.dumps.len(), 10);
    assert!(out.dumps[1].text.starts_with("program ring {"));
}

#[test]
fn timings_are_reported_for_every_pass_in_order() {
    let out = manager().run(ring(), &common::verifying()).unwrap();
    let names: Vec<_> = out.timings.iter().map(|t| t.pass).collect();
    assert_eq!(names, manager().pass_names());
    assert!(out.timings.iter().all(|t| t.ran));
}

#[test]
fn a_stage_chain_runs_passes_in_the_order_written() {
    use meshflow_passes::passes::{LowerToHost, PropagateShardings, SimplifyIndices};
    let o = common::verifying();
    let out = Stage::start(ring(), &o)
        .and_then(|s| s.then(&PropagateShardings))
        .and_then(|s| s.lower(&LowerToHost))
        .and_then(|s| s.then(&SimplifyIndices))
        .unwrap()
        .finish();
    let names: Vec<_> = out.timings.iter().map(|t| t.pass).collect();
    assert_eq!(
        names,
        ["propagate_shardings", "lower_to_host", "simplify_indices"]
    );
    assert_eq!(out.program.name, "ring");
}

#[test]
fn zero_streams_are_refused_before_any_pass_runs() {
    let o = with(|o| o.num_streams = 0);
    let e = manager().run(ring(), &o).unwrap_err();
    assert!(matches!(e, PassError::Options(_)), "{e}");
    assert!(e.to_string().contains("at least 1"), "{e}");
}
