//! Conformance cases of `tests/data/conformance/<dtensor|nvfuser>/*.mf`: sharding programs
//! transcribed from PyTorch DTensor's and nvFuser's multi-device tests. Each file starts with
//! header comments:
//!
//! ```text
//! # source: pytorch test/distributed/tensor/test_view_ops.py::TestViewOps::test_view_ops
//! # expect: all_gather=1            (or `none`, or `refused "substring of the error"`)
//! # ranks: 6 4                      (the peer's rank count first, then others)
//! ```
//!
//! and is a level-1 program with `param ranks`. At every listed rank count the case is
//! lowered; a refused case must fail with an error containing the substring, any other case
//! must lower to exactly the expected static counts of communication instructions (by their
//! host-text name; `none` means no communication), pass the cross-rank check and match the
//! unsharded reference on the sim backend.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use meshflow::check::check_program;
use meshflow::ir::{parse_program_with, HostProgram, Params};
use meshflow::pipeline::{compile, CompileOptions};
use meshflow::runtime::compare::run_and_compare;
use meshflow::runtime::launch::SimOptions;

/// What a case expects.
#[derive(Debug)]
enum Expect {
    Counts(BTreeMap<String, usize>),
    Refused(String),
}

#[derive(Debug)]
struct Case {
    path: PathBuf,
    source: String,
    expect: Expect,
    ranks: Vec<i64>,
    text: String,
}

fn parse_case(path: &Path) -> Result<Case, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let header = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("# {key}:")))
            .map(|v| v.trim().to_string())
            .ok_or(format!("missing `# {key}:` line"))
    };
    let source = header("source")?;
    let expect_text = header("expect")?;
    let expect = if let Some(rest) = expect_text.strip_prefix("refused") {
        let s = rest.trim();
        let inner = s
            .strip_prefix('"')
            .and_then(|s| s.strip_suffix('"'))
            .ok_or("`refused` needs a quoted substring")?;
        Expect::Refused(inner.to_string())
    } else if expect_text == "none" {
        Expect::Counts(BTreeMap::new())
    } else {
        let mut counts = BTreeMap::new();
        for item in expect_text.split([' ', ',']).filter(|s| !s.is_empty()) {
            let (name, n) = item.split_once('=').ok_or(format!("bad count `{item}`"))?;
            let n: usize = n.parse().map_err(|_| format!("bad count `{item}`"))?;
            counts.insert(name.to_string(), n);
        }
        Expect::Counts(counts)
    };
    let ranks: Vec<i64> = header("ranks")?
        .split_whitespace()
        .map(|r| r.parse().map_err(|_| format!("bad rank count `{r}`")))
        .collect::<Result<_, _>>()?;
    if ranks.len() < 2 {
        return Err("`# ranks:` needs the peer's count and at least one other".into());
    }
    Ok(Case {
        path: path.to_path_buf(),
        source,
        expect,
        ranks,
        text,
    })
}

fn cases() -> Vec<Case> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/conformance");
    let mut out = Vec::new();
    for peer in ["dtensor", "nvfuser"] {
        let dir = root.join(peer);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "mf"))
            .collect();
        paths.sort();
        for p in paths {
            match parse_case(&p) {
                Ok(c) => out.push(c),
                Err(e) => panic!("{}: {e}", p.display()),
            }
        }
    }
    out
}

/// Static counts of communication instructions by host-text name.
fn comm_counts(host: &HostProgram) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    host.walk(&mut |inst, _| {
        if inst.kind.is_communication() {
            *counts.entry(inst.kind.name().to_string()).or_insert(0) += 1;
        }
    });
    counts
}

fn run_case(case: &Case, ranks: i64) -> Result<(), String> {
    let mut params = Params::new();
    params.insert("ranks".into(), ranks);
    let parsed = parse_program_with(&case.text, &params).map_err(|e| e.to_string());
    let compiled = parsed.and_then(|p| {
        compile(&p, &CompileOptions::default())
            .map_err(|e| e.to_string())
            .map(|c| (p, c))
    });
    match (&case.expect, compiled) {
        (Expect::Refused(needle), Err(e)) => {
            if e.contains(needle.as_str()) {
                Ok(())
            } else {
                Err(format!("refused, but without {needle:?}: {e}"))
            }
        }
        (Expect::Refused(needle), Ok(_)) => Err(format!(
            "expected a refusal containing {needle:?}, but it lowered"
        )),
        (Expect::Counts(_), Err(e)) => Err(format!("lowering failed: {e}")),
        (Expect::Counts(want), Ok((_, compiled))) => {
            let got = comm_counts(&compiled.host);
            if &got != want {
                return Err(format!(
                    "communications {got:?}, expected {want:?}\n{}",
                    compiled.host
                ));
            }
            let world = compiled.host.world_size();
            check_program(&compiled.host, world)
                .map_err(|e| format!("cross-rank check failed: {e}\n{}", compiled.host))?;
            let cmp = run_and_compare(
                &compiled.program,
                &compiled.host,
                world,
                11,
                &SimOptions::default(),
            )
            .map_err(|e| format!("run failed: {e}"))?;
            if cmp.passed() {
                Ok(())
            } else {
                Err(format!("mismatch: {cmp}"))
            }
        }
    }
}

#[test]
fn every_conformance_case_behaves_as_its_source_expects() {
    let cases = cases();
    assert!(cases.len() >= 20, "found only {} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        for &r in &case.ranks {
            if let Err(e) = run_case(case, r) {
                failures.push(format!(
                    "{} at {r} ranks (source: {}): {e}",
                    case.path.display(),
                    case.source
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failing:\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
