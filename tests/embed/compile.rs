//! The embedding API's compile side: options change the lowering as documented, the job size
//! is re-parsed or checked, the host program round-trips through text, and every failure is
//! one `meshflow::Error`.

use crate::support::embed as embed_support;

use meshflow::ir::host::InstKind;
use meshflow::ir::DeviceMesh;
use meshflow::ir::{DType, ParallelType::*, Program, ProgramBuilder};
use meshflow::{compile, Compiled, Decomposition, Error, Options, Transport};

const RING: &str = include_str!("../../examples/programs/column_parallel_linear_ring.mf");

/// `y = linear(x, w)`, x split on rows, w on output columns, nothing else annotated: `x` is
/// gathered into `x_gathered` by a decomposition the cost model (or the options) choose.
fn column_parallel(d: u64) -> Program {
    let mut b = ProgramBuilder::new("cp");
    let m = b
        .mesh("m0", DeviceMesh::iota(vec![d as usize], 0).expect("mesh"))
        .expect("mesh");
    let x = b.input("x", DType::BF16, &[16 * d, 32], m).expect("x");
    let w = b.input("w", DType::BF16, &[12 * d, 32], m).expect("w");
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, d).parallelize(0, DIDx);
    let y = b.linear(x, w).expect("linear");
    b.rename(y, "y").expect("name");
    b.output(y);
    b.build().expect("verifies")
}

fn count(c: &Compiled, name: &str) -> usize {
    let mut n = 0;
    c.host()
        .walk(&mut |i, _| n += usize::from(i.kind.name() == name));
    n
}

#[test]
fn for_ranks_reparses_the_ranks_parameter() {
    let options = Options::for_ranks(8);
    let program = meshflow::parse(RING, &options).expect("parses");
    assert_eq!(program.world_size(), 8);
    let c = compile(&program, &options).expect("compiles");
    assert_eq!(c.world_size(), 8);
    let x = c.tensor("x").expect("x");
    assert_eq!((x.shape.as_slice(), x.devices.len()), (&[16u64, 32][..], 8));
    assert_eq!(c.check_report().expect("checked").world_size, 8);
}

#[test]
fn for_ranks_checks_a_program_without_the_parameter() {
    let text = RING
        .replace("param ranks = 4\n", "")
        .replace("param d = ranks", "param d = 4");
    // More ranks than the program needs: the others hold nothing.
    let options = Options::for_ranks(6);
    let program = meshflow::parse(&text, &options).expect("parses at its own size");
    assert_eq!(program.world_size(), 4);
    assert_eq!(compile(&program, &options).expect("fits").world_size(), 6);
    // Fewer: an error.
    let e = compile(&program, &Options::for_ranks(2)).expect_err("too small");
    assert!(
        matches!(
            e,
            Error::WorldSize {
                needed: 4,
                ranks: 2
            }
        ),
        "{e}"
    );
    assert_eq!(e.to_string(), "the program needs 4 ranks but the job has 2");
    // An explicit `ranks` override of a program without it is still an error.
    let e = meshflow::parse(&text, &Options::new().param("ranks", 4)).expect_err("undeclared");
    assert!(matches!(e, Error::Parse(_)), "{e}");
}

#[test]
fn decomposition_and_transport_options_change_the_lowering() {
    let program = column_parallel(4);
    let default = compile(&program, &Options::new()).expect("compiles");
    assert_eq!(count(&default, "all_gather"), 1);
    assert_eq!(count(&default, "collective_permute"), 0);
    let ring = compile(
        &program,
        &Options::new().decomposition("x_gathered", Decomposition::Ring),
    )
    .expect("compiles");
    assert_eq!(count(&ring, "all_gather"), 0);
    assert!(
        count(&ring, "collective_permute") >= 1,
        "{}",
        ring.host_text()
    );
    assert!(
        ring.explain()[0].chosen.starts_with("ring(s=4, "),
        "{}",
        ring.explain()[0]
    );
    let broadcast = compile(
        &program,
        &Options::new().decomposition("x_gathered", Decomposition::StreamBroadcast),
    )
    .expect("compiles");
    assert_eq!(
        count(&broadcast, "broadcast"),
        1,
        "{}",
        broadcast.host_text()
    );
    // The transport changes the costs the choice is made from.
    let ce = compile(&program, &Options::new().transport(Transport::CopyEngine)).expect("ok");
    assert_ne!(
        format!("{:?}", ce.explain()[0].variants),
        format!("{:?}", default.explain()[0].variants)
    );
}

#[test]
fn the_profile_option_drives_the_plans_and_the_transport() {
    let text = include_str!("../../examples/programs/row_parallel_linear_ring.mf");
    let program = meshflow::parse(text, &Options::for_ranks(2)).expect("parses");
    for name in ["h200x2", "h100x2"] {
        let profile = meshflow::Profile::builtin(name).unwrap();
        let c = compile(&program, &Options::for_ranks(2).profile(profile)).expect("compiles");
        let plan = c.plans()["y"];
        assert_eq!(plan.decomposition, Decomposition::RingForward);
        assert_eq!(c.transport(), Some(plan.transport));
    }
    let forced = Options::for_ranks(2).transport(Transport::CopyEngine);
    let c = compile(&program, &forced).expect("compiles");
    assert_eq!(c.transport(), Some(Transport::CopyEngine));
}

#[test]
fn the_gpu_model_chooses_the_profile_unless_one_is_given() {
    let text = include_str!("../../examples/programs/row_parallel_linear_ring.mf");
    let program = meshflow::parse(text, &Options::for_ranks(2)).expect("parses");
    let h100 = "NVIDIA H100 80GB HBM3";
    let builtin = |name: &str| meshflow::Profile::builtin(name).unwrap();
    // No GPU named: the default, said so.
    let c = compile(&program, &Options::for_ranks(2)).expect("compiles");
    assert_eq!(
        c.profile_reason(),
        Some("h200x2: default, no GPU named (the target machine is unknown)")
    );
    // The GPU's built-in profile: the same plans as naming that profile.
    let on_h100 = Options::for_ranks(2).device(h100);
    assert_eq!(on_h100.pass_options().cost_model.profile, builtin("h100x2"));
    let c = compile(&program, &on_h100).expect("compiles");
    let named = compile(&program, &Options::for_ranks(2).profile(builtin("h100x2"))).unwrap();
    assert_eq!(
        c.profile_reason(),
        Some(&*format!("h100x2: built-in profile of {h100}"))
    );
    assert_eq!(c.host_text(), named.host_text());
    assert_eq!(c.plans(), named.plans());
    // A model no built-in profile describes: the default, said so.
    let a100 = Options::for_ranks(2).device("NVIDIA A100-SXM4-80GB");
    assert_eq!(a100.pass_options().cost_model.profile, builtin("h200x2"));
    assert_eq!(
        a100.profile_reason(),
        "h200x2: default, no built-in profile for NVIDIA A100-SXM4-80GB"
    );
    // A given profile wins, given before or after the GPU.
    for given in [
        Options::for_ranks(2)
            .profile(builtin("h200x2"))
            .device(h100),
        Options::for_ranks(2)
            .device(h100)
            .profile(builtin("h200x2")),
        Options::for_ranks(2)
            .cost_model(meshflow::passes::CostModel::new(builtin("h200x2")))
            .device(h100),
    ] {
        assert_eq!(given.pass_options().cost_model.profile, builtin("h200x2"));
        assert_eq!(given.profile_reason(), "h200x2: given");
    }
    // Host IR is not lowered: no profile.
    let loaded = Compiled::from_host_text(&c.host_text(), &Options::for_ranks(2)).unwrap();
    assert_eq!(loaded.profile_reason(), None);
}

#[test]
fn stream_and_pass_options_change_the_lowering() {
    let program = meshflow::parse(RING, &Options::new()).expect("parses");
    let workers = |c: &Compiled| {
        let mut found = Vec::new();
        c.host().walk(&mut |i, _| {
            if let InstKind::SetCurrentStream { .. } = &i.kind {
                found.push(meshflow::ir::text::inst_to_string(c.host(), i));
            }
        });
        found
    };
    let two = compile(&program, &Options::new()).expect("compiles");
    let one = compile(&program, &Options::new().streams(1)).expect("compiles");
    assert_ne!(two.host_text(), one.host_text());
    assert!(!workers(&two).is_empty());
    // Without assign_streams everything runs on the main stream.
    let none = compile(&program, &Options::new().disable_pass("assign_streams")).expect("ok");
    assert!(workers(&none).is_empty(), "{}", none.host_text());
    // The prefetch schedule keeps the ring's compute on the main stream: one worker, fixed.
    let prefetch = compile(
        &program,
        &Options::new().stream_schedule(meshflow::pipeline::StreamSchedule::Prefetch),
    )
    .expect("compiles");
    assert_ne!(prefetch.host_text(), two.host_text());
    assert!(
        workers(&prefetch).iter().all(|w| !w.contains("worker(i")),
        "{}",
        prefetch.host_text()
    );
    // Dumps and an unknown pass.
    let dumped = compile(&program, &Options::new().dump_after("lower_to_host")).expect("ok");
    assert_eq!(dumped.dumps().len(), 1);
    let e = compile(&program, &Options::new().disable_pass("no_such_pass")).expect_err("bad");
    assert!(matches!(e, Error::Compile(_)), "{e}");
    let e = compile(&program, &Options::new().streams(0)).expect_err("zero streams");
    assert!(e.to_string().contains("at least 1"), "{e}");
    // The cross-rank check can be skipped.
    assert!(two.check_report().is_some());
    let unchecked = compile(&program, &Options::new().check(false)).expect("compiles");
    assert!(unchecked.check_report().is_none());
}

#[test]
fn host_text_round_trips() {
    let c = compile(&embed_support::mlp(4), &Options::for_ranks(4)).expect("compiles");
    let text = c.host_text();
    assert!(text.contains("call_kernel("), "{text}");
    let loaded = Compiled::from_host_text(&text, &Options::for_ranks(4)).expect("loads");
    assert_eq!(loaded.host(), c.host());
    assert_eq!(loaded.host_text(), text);
    assert_eq!(loaded.kernels(), ["bias_gelu"]);
    assert_eq!(loaded.inputs(), c.inputs());
    assert!(loaded.check_report().is_some());
    assert!(loaded.program().is_none());
    let full = meshflow::TensorData::zeros(DType::F32, &[4, 6]).expect("zeros");
    let e = loaded.scatter("x", &full).expect_err("no level-1 program");
    assert!(matches!(e, Error::NoProgram { what: "scatter" }), "{e}");
    // Loading checks the job size too.
    let e = Compiled::from_host_text(&text, &Options::for_ranks(2)).expect_err("too small");
    assert!(matches!(e, Error::WorldSize { .. }), "{e}");
}

#[test]
fn every_layer_fails_into_one_error() {
    let e = meshflow::parse("program p {", &Options::new()).expect_err("parse");
    assert!(matches!(e, Error::Parse(_)), "{e}");
    let e =
        Compiled::from_host_text("host h {\n  wait c9\n}\n", &Options::new()).expect_err("verify");
    assert!(matches!(e, Error::Verify(_)), "{e}");
    let e: Error = DeviceMesh::new(vec![2], vec![0, 0])
        .expect_err("duplicate")
        .into();
    assert!(matches!(e, Error::Mesh(_)), "{e}");
    let e: Error = meshflow::TensorData::from_f32(DType::F32, &[2], &[1.0])
        .expect_err("size")
        .into();
    assert!(matches!(e, Error::Data(_)), "{e}");
    // A host program whose ranks disagree is refused by the cross-rank check.
    let bad = "host h {\n  mesh m = [0, 1]\n  in x: f32[4] on m\n  out y: f32[4] on m\n  allocate y\n  c0 = broadcast(x -> y, team=slice(m, DIDx), root=rank)\n  wait c0\n}\n";
    let e = Compiled::from_host_text(bad, &Options::new()).expect_err("check");
    assert!(matches!(e, Error::Check(_)), "{e}");
}

#[test]
fn load_tells_level_1_from_host_text_by_content() {
    use meshflow::{format_of, load, Format};
    let options = Options::for_ranks(4);
    let from_level1 = load(RING, &options).expect("level-1 text compiles");
    assert!(from_level1.program().is_some());
    let host_text = from_level1.host_text();
    assert_eq!(format_of(RING), Some(Format::Program));
    assert_eq!(
        format_of(&format!("# a comment\n\n{host_text}")),
        Some(Format::Host)
    );
    assert_eq!(format_of("nonsense"), None);
    let from_host = load(&host_text, &options).expect("host text loads");
    assert!(from_host.program().is_none());
    assert_eq!(from_host.host(), from_level1.host());
    assert!(from_host.check_report().is_some());
    // Host IR has no parameters: one given for it is refused, naming it.
    let e = load(&host_text, &Options::new().param("d", 3)).expect_err("params on host IR");
    assert!(
        matches!(&e, Error::HostParams { params } if params == &["d"]),
        "{e}"
    );
    assert!(
        e.to_string().contains("applies to level-1 programs only"),
        "{e}"
    );
    // Level-1 text takes them.
    let two = load(RING, &Options::new().param("d", 2)).expect("compiles");
    assert_eq!(two.world_size(), 2);
}
