//! Adversarial inputs, as a new user (or a fuzzer) writes them: every example, test program
//! and host program of the repository, broken in systematic ways (lines deleted, duplicated
//! or swapped, numbers replaced by 0, -1 and huge values, text cut short, a 1 MB identifier,
//! 100 levels of parentheses, a 2000-term sum, absurd parameters). Each goes through
//! parse -> verify -> lower -> check and, when it passes, runs on the CPU backend (short
//! timeout) against the reference. Nothing may panic or hang: every input ends in a result
//! or an error. The count is a figure of docs/hardening.md.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Duration;

use meshflow::check::check_program;
use meshflow::ir::{parse_host, parse_program_with, verify_host, verify_program, Role};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::{run_and_compare, run_cpu, CpuConfig, CpuOptions, RunInputs};
use meshflow::{compile, Options};

fn root() -> PathBuf {
    crate::support::root()
}

fn texts(dir: &Path, ext: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("readable");
            (
                p.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
                text,
            )
        })
        .collect();
    out.sort();
    out
}

/// The broken variants of one text.
fn variants(text: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let join = |ls: &[&str]| ls.join("\n");
    let mut out = Vec::new();
    for k in 0..lines.len() {
        let mut v = lines.clone();
        v.remove(k);
        out.push((format!("delete line {}", k + 1), join(&v)));
        let mut v = lines.clone();
        v.insert(k, lines[k]);
        out.push((format!("duplicate line {}", k + 1), join(&v)));
        if k + 1 < lines.len() {
            let mut v = lines.clone();
            v.swap(k, k + 1);
            out.push((format!("swap lines {} and {}", k + 1, k + 2), join(&v)));
        }
    }
    // Every number, one at a time, replaced by adversarial values.
    let bytes = text.as_bytes();
    let mut i = 0;
    let mut numbers = 0;
    while i < bytes.len() && numbers < 12 {
        if bytes[i].is_ascii_digit() && (i == 0 || !bytes[i - 1].is_ascii_alphanumeric()) {
            let end = (i..bytes.len())
                .find(|&j| !bytes[j].is_ascii_digit())
                .unwrap_or(bytes.len());
            for bad in ["0", "-1", "999999999999", "18446744073709551616"] {
                let v = format!("{}{bad}{}", &text[..i], &text[end..]);
                out.push((format!("number at byte {i} -> {bad}"), v));
            }
            numbers += 1;
            i = end;
        } else {
            i += 1;
        }
    }
    for cut in [10, 50, 90] {
        let at = text.len() * cut / 100;
        let at = (0..=at)
            .rev()
            .find(|&a| text.is_char_boundary(a))
            .unwrap_or(0);
        out.push((format!("cut at {cut}%"), text[..at].to_string()));
    }
    // The first identifier after the header made enormous.
    if let Some(pos) = text.find(" x") {
        let v = format!(
            "{} {}{}",
            &text[..pos],
            "x".repeat(1 << 20),
            &text[pos + 2..]
        );
        out.push(("1 MB identifier".into(), v));
    }
    // Deep nesting and a long flat sum in the first expression after `=`.
    if let Some(pos) = text.find("= ") {
        let deep = format!("{}1{}", "(".repeat(100), ")".repeat(100));
        out.push((
            "100 parentheses".into(),
            format!("{}= {deep} + {}", &text[..pos], &text[pos + 2..]),
        ));
        let flat = vec!["1"; 2000].join(" + ");
        out.push((
            "2000-term sum".into(),
            format!("{}= {flat} + {}", &text[..pos], &text[pos + 2..]),
        ));
    }
    out.push((
        "bad characters".into(),
        format!("{text}\n@@ \u{0}\u{7f} \""),
    ));
    out
}

/// What happened to one input.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    ParseError,
    VerifyError,
    LowerError,
    CheckError,
    RunError,
    Mismatch,
    Ran,
    Skipped,
}

fn options() -> CpuOptions {
    CpuOptions {
        ranks: None,
        config: CpuConfig {
            timeout: Duration::from_millis(200),
            memory_limit: Some(64 << 20),
            ..CpuConfig::default()
        },
        trace: false,
    }
}

/// Small enough to run: at most 8 ranks and 2^16 elements per tensor.
fn small(world: usize, shapes: impl Iterator<Item = Vec<u64>>) -> bool {
    (1..=8).contains(&world)
        && shapes.into_iter().all(|s| {
            s.iter()
                .try_fold(1u64, |n, &e| n.checked_mul(e))
                .is_some_and(|n| n <= 1 << 16)
        })
}

fn level1(text: &str, params: &BTreeMap<String, i64>) -> Outcome {
    let Ok(program) = parse_program_with(text, params) else {
        return Outcome::ParseError;
    };
    if verify_program(&program).is_err() {
        return Outcome::VerifyError;
    }
    let Ok(out) = compile(&program, &Options::new().check(false)) else {
        return Outcome::LowerError;
    };
    let world = out.host().world_size();
    if world > 1 << 16 {
        return Outcome::Skipped;
    }
    if check_program(out.host(), world).is_err() {
        return Outcome::CheckError;
    }
    let shapes = out
        .level1()
        .expect("lowered")
        .tensors
        .values()
        .map(|t| t.ty.value_shape());
    if !small(world, shapes) {
        return Outcome::Skipped;
    }
    match run_and_compare(
        out.level1().expect("lowered"),
        out.host(),
        world,
        1,
        &options(),
    ) {
        Ok(c) if c.passed() => Outcome::Ran,
        Ok(_) => Outcome::Mismatch,
        Err(_) => Outcome::RunError,
    }
}

fn host(text: &str) -> Outcome {
    let Ok(host) = parse_host(text) else {
        return Outcome::ParseError;
    };
    if verify_host(&host).is_err() {
        return Outcome::VerifyError;
    }
    let world = host.world_size();
    if world > 1 << 16 {
        return Outcome::Skipped;
    }
    if check_program(&host, world).is_err() {
        return Outcome::CheckError;
    }
    if !small(world, host.tensors.values().map(|t| t.shape.clone())) {
        return Outcome::Skipped;
    }
    let mut per_rank: BTreeMap<usize, BTreeMap<String, TensorData>> = BTreeMap::new();
    for (i, t) in host.tensors.values().enumerate() {
        if t.role != Role::Input {
            continue;
        }
        for &d in host.meshes[t.mesh].mesh.devices() {
            let Ok(data) = TensorData::random(t.dtype, &t.shape, (d * 100 + i) as u64) else {
                return Outcome::Skipped;
            };
            per_rank.entry(d).or_default().insert(t.name.clone(), data);
        }
    }
    match run_cpu(&host, RunInputs::PerRank(per_rank), &options()) {
        Ok(_) => Outcome::Ran,
        Err(_) => Outcome::RunError,
    }
}

#[test]
fn bad_inputs_end_in_errors_never_panics() {
    let mut inputs: Vec<(String, bool, String, BTreeMap<String, i64>)> = Vec::new();
    let none = BTreeMap::new();
    let level1_dirs = [
        root().join("examples/programs"),
        root().join("tests/data/runtime"),
    ];
    for dir in &level1_dirs {
        for (name, text) in texts(dir, "mf") {
            for (what, v) in variants(&text) {
                inputs.push((format!("{name}: {what}"), false, v, none.clone()));
            }
            // Absurd parameters.
            for (p, v) in [
                ("ranks", 0),
                ("ranks", -3),
                ("ranks", 100000),
                ("d", 0),
                ("s", 0),
                ("k", 99),
                ("t", 0),
            ] {
                if text.contains(&format!("param {p} ")) {
                    let params = BTreeMap::from([(p.to_string(), v)]);
                    inputs.push((format!("{name}: {p} = {v}"), false, text.clone(), params));
                }
            }
        }
    }
    let host_dirs = [
        root().join("ir/tests/data/host"),
        root().join("tests/data/check"),
        root().join("tests/data/mutations"),
    ];
    for dir in &host_dirs {
        for (name, text) in texts(dir, "mfh") {
            inputs.push((
                format!("{name}: as written"),
                true,
                text.clone(),
                none.clone(),
            ));
            for (what, v) in variants(&text) {
                inputs.push((format!("{name}: {what}"), true, v, none.clone()));
            }
        }
    }
    // Unoptimized builds (the default `cargo test`) try every 6th input; the full set runs
    // with `--release` (scripts/hardening.sh), a few seconds.
    let step = if cfg!(debug_assertions) { 6 } else { 1 };
    let inputs: Vec<_> = inputs.into_iter().step_by(step).collect();
    let mut outcomes: BTreeMap<Outcome, usize> = BTreeMap::new();
    let mut panics = Vec::new();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for (what, is_host, text, params) in &inputs {
        let r = catch_unwind(AssertUnwindSafe(|| {
            if *is_host {
                host(text)
            } else {
                level1(text, params)
            }
        }));
        match r {
            Ok(o) => *outcomes.entry(o).or_insert(0) += 1,
            Err(_) => panics.push(what.clone()),
        }
    }
    std::panic::set_hook(hook);
    eprintln!(
        "{} bad inputs: {outcomes:?}; {} panics",
        inputs.len(),
        panics.len()
    );
    eprintln!(
        "HARDENING|bad_inputs|{}|{}|{}",
        inputs.len(),
        panics.len(),
        outcomes
            .iter()
            .map(|(o, n)| format!("{o:?} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert!(inputs.len() * step >= 6000, "only {} inputs", inputs.len());
    assert!(panics.is_empty(), "{} panics: {panics:#?}", panics.len());
}
