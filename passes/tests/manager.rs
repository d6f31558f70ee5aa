//! The pass manager: disabling, dumping, timing, verification.

mod common;

use meshflow_ir::{DType, ParallelType::*, Program};
use meshflow_passes::{PassContext, PassError, PassManager};

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
    PassManager::new(common::all_passes())
}

#[test]
fn unknown_pass_names_list_the_valid_ones() {
    let e = manager().disable("fuse_everything").unwrap_err();
    let PassError::UnknownPass { name, valid } = &e else {
        panic!("{e}");
    };
    assert_eq!(name, "fuse_everything");
    assert!(valid.contains("propagate_shardings") && valid.contains("defer_waits"));
    assert!(manager().dump_after("nope").is_err());
}

#[test]
fn required_passes_cannot_be_disabled() {
    for p in ["lower_to_host", "verify_program", "verify_host"] {
        let e = manager().disable(p).unwrap_err();
        assert!(matches!(e, PassError::CannotDisable { .. }), "{e}");
        assert!(e.to_string().contains(p));
    }
}

#[test]
fn disabled_passes_are_skipped_and_reported() {
    let mut m = manager();
    m.disable("assign_streams").unwrap();
    m.disable("defer_waits").unwrap();
    let p = ring();
    let mut cx = PassContext::new(&p);
    let out = m.run(p, &mut cx).unwrap();
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
    let mut m = manager();
    m.dump_after("lower_to_host").unwrap();
    let out = m.run(p.clone(), &mut PassContext::new(&p)).unwrap();
    assert_eq!(out.dumps.len(), 1);
    assert!(out.dumps[0].text.starts_with("host ring {"));
    let mut m = manager();
    m.dump_after("all").unwrap();
    let out = m.run(p.clone(), &mut PassContext::new(&p)).unwrap();
    assert_eq!(out.dumps.len(), 10);
    assert!(out.dumps[1].text.starts_with("program ring {"));
}

#[test]
fn timings_are_reported_for_every_pass_in_order() {
    let p = ring();
    let out = manager().run(p.clone(), &mut PassContext::new(&p)).unwrap();
    let names: Vec<_> = out.timings.iter().map(|t| t.pass).collect();
    assert_eq!(names, manager().pass_names());
    assert!(out.timings.iter().all(|t| t.ran));
}

#[test]
fn passes_in_the_wrong_phase_are_an_error() {
    use meshflow_passes::passes::{PropagateShardings, SimplifyIndices};
    use meshflow_passes::Pass;
    let p = ring();
    let m = PassManager::new(vec![Pass::Host(Box::new(SimplifyIndices))]);
    assert!(m.run(p.clone(), &mut PassContext::new(&p)).is_err());
    let m = PassManager::new(vec![Pass::Program(Box::new(PropagateShardings))]);
    let e = m.run(p.clone(), &mut PassContext::new(&p)).unwrap_err();
    assert!(e.to_string().contains("no lowering"), "{e}");
}
