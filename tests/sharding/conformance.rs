//! The conformance suite: sharding cases transcribed from PyTorch DTensor's and nvFuser's
//! public tests, as data files `tests/data/conformance/<dtensor|nvfuser>/<case>.mf`.
//!
//! Each file starts with header comments:
//!
//! ```text
//! # source: pytorch test/distributed/tensor/test_redistribute.py::RedistributeTest::test_...
//! # expect: all_gather=1            (or `none`, or `refused "substring of the error"`)
//! # ranks: 4 3                      (the peer's rank count first, then at least one other)
//! ```
//!
//! followed by a level-1 program with `param ranks`. `expect` counts the communication
//! instructions of the lowered host program by their host-text names (`all_gather`,
//! `all_to_all`, `send_recv`, `collective_permute`, ...; a `comms=N` term counts all of them,
//! for peers' tests that assert only a total), statically (an instruction inside a stream loop
//! counts once, one over a single device not at all), at the peer's rank count.
//!
//! For every case and rank count the harness parses the program with `ranks` set, compiles
//! it, runs the cross-rank check and runs it on the CPU backend against the unsharded
//! reference. It fails on a malformed case, on a lowered program the check rejects, and on a
//! checked program that fails or mismatches in its run (the two lowering invariants); a
//! refusal or a count that differs from the peer's is recorded, not a failure. The summary
//! table in `tests/data/conformance/README.md` is regenerated and compared; run with
//! `MESHFLOW_BLESS=1` to rewrite it.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use crate::support::conformance::{parse_case, Case, Expect, SOURCES};

use meshflow::check::check_program;
use meshflow::compile;
use meshflow::ir::parse::{parse_program_with, Params};
use meshflow::ir::{HostProgram, InstKind};
use meshflow::runtime::compare::run_and_compare;
use meshflow::runtime::ranks::CpuOptions;

/// Static communication counts of a host program by instruction name. A communication over
/// one device, or a collective permute of every member to itself (devices copying the data
/// they keep between overlapping meshes), moves nothing between devices and is not counted.
fn comm_counts(host: &HostProgram) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    host.walk(&mut |inst, _| {
        let one_device = inst
            .kind
            .team()
            .is_some_and(|t| t.size(&host.meshes) == Some(1));
        // Every member sending to itself (the check proves it is a permutation): local copies.
        let to_itself = matches!(
            &inst.kind,
            InstKind::CollectivePermute { send_peer, recv_peer, .. } if send_peer == recv_peer
        );
        let local = one_device || to_itself;
        if inst.kind.is_communication() && !local {
            *counts.entry(inst.kind.name().to_string()).or_insert(0) += 1;
        }
    });
    counts
}

fn counts_text(c: &BTreeMap<String, usize>) -> String {
    if c.is_empty() {
        return "none".into();
    }
    c.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn matches_counts(want: &BTreeMap<String, usize>, got: &BTreeMap<String, usize>) -> bool {
    let total: usize = got.values().sum();
    let mut named = got.clone();
    if let Some(&n) = want.get("comms") {
        if n != total {
            return false;
        }
        if want.len() == 1 {
            return true;
        }
    }
    for (k, &v) in want.iter().filter(|(k, _)| *k != "comms") {
        if named.remove(k) != Some(v) {
            return false;
        }
    }
    named.is_empty()
}

/// The outcome of one case.
#[derive(Default)]
struct Outcome {
    /// Lowered at every rank count, or refused as the peer refuses.
    expressible: bool,
    /// Counts (or the refusal) as the peer expects.
    matched: bool,
    /// Every rank count lowered, checked and matched the reference (or refused as expected).
    runs_ok: bool,
    /// Why a column is false, for the README.
    note: String,
    /// Invariant violations and malformed cases: test failures.
    failures: Vec<String>,
}

fn first_line(s: &str) -> String {
    let one: Vec<&str> = s.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let mut t = one.join(" ");
    if t.len() > 300 {
        t.truncate(300);
        t.push_str("...");
    }
    t
}

fn run_case(case: &Case) -> Outcome {
    let mut out = Outcome::default();
    let mut lowered_all = true;
    let mut ran_all = true;
    let mut refusal: Option<String> = None;
    for (k, &ranks) in case.ranks.iter().enumerate() {
        let mut params = Params::new();
        params.insert("ranks".to_string(), ranks);
        let program = match parse_program_with(&case.text, &params) {
            Ok(p) => p,
            Err(e) => {
                out.failures
                    .push(format!("ranks={ranks}: the program does not parse: {e}"));
                return out;
            }
        };
        let compiled = match compile(&program, &case.options()) {
            Ok(c) => c,
            Err(e) => {
                lowered_all = false;
                ran_all = false;
                if refusal.is_none() {
                    refusal = Some(format!("ranks={ranks}: {}", first_line(&e.to_string())));
                }
                if k == 0 {
                    if let Expect::Refused(sub) = &case.expect {
                        out.matched = e.to_string().contains(sub.as_str());
                        if !out.matched {
                            out.note = format!(
                                "refused without \"{sub}\": {}",
                                first_line(&e.to_string())
                            );
                        }
                    }
                }
                continue;
            }
        };
        if k == 0 {
            let got = comm_counts(compiled.host());
            match &case.expect {
                Expect::Counts(want) => {
                    out.matched = matches_counts(want, &got);
                    if !out.matched {
                        out.note = format!(
                            "expected {}, lowered to {}",
                            counts_text(want),
                            counts_text(&got)
                        );
                    }
                }
                Expect::Refused(sub) => {
                    out.note = format!("expected a refusal (\"{sub}\"), lowered instead");
                }
            }
        }
        let world = (ranks as usize).max(compiled.host().world_size());
        if let Err(e) = check_program(compiled.host(), world) {
            ran_all = false;
            out.failures.push(format!(
                "ranks={ranks}: lowering emitted a program its own cross-rank check rejects:\n{e}\n{}",
                compiled.host()
            ));
            continue;
        }
        match run_and_compare(
            compiled.level1().expect("lowered"),
            compiled.host(),
            world,
            11,
            &CpuOptions::default(),
        ) {
            Ok(cmp) if cmp.passed() => {}
            Ok(cmp) => {
                ran_all = false;
                out.failures.push(format!(
                    "ranks={ranks}: the checked program does not match the reference: {cmp}\n{}",
                    compiled.host()
                ));
            }
            Err(e) => {
                ran_all = false;
                out.failures.push(format!(
                    "ranks={ranks}: the checked program failed to run: {e}\n{}",
                    compiled.host()
                ));
            }
        }
    }
    let refused_as_expected = matches!(case.expect, Expect::Refused(_)) && out.matched;
    out.expressible = lowered_all || refused_as_expected;
    out.runs_ok = (lowered_all && ran_all) || refused_as_expected;
    if out.note.is_empty() && !out.expressible {
        out.note = refusal.unwrap_or_default();
    } else if out.note.is_empty() && !lowered_all {
        if let Some(r) = refusal {
            out.note = r;
        }
    }
    out
}

#[derive(Default, Clone, Copy)]
struct Tally {
    cases: usize,
    expressible: usize,
    matched: usize,
    runs_ok: usize,
}

impl Tally {
    fn add(&mut self, o: &Outcome) {
        self.cases += 1;
        self.expressible += usize::from(o.expressible);
        self.matched += usize::from(o.matched);
        self.runs_ok += usize::from(o.runs_ok);
    }
}

const BEGIN: &str = "<!-- conformance summary: generated by tests/sharding/conformance.rs -->";
const END: &str = "<!-- end of conformance summary -->";

fn summary(tallies: &BTreeMap<&str, Tally>, notes: &[(String, String)]) -> String {
    let mut s = String::new();
    s.push_str(BEGIN);
    s.push_str("\n\n| source | cases | expressible | expected communication | runs ok |\n");
    s.push_str("|---|---:|---:|---:|---:|\n");
    let mut total = Tally::default();
    for (src, t) in tallies {
        let _ = writeln!(
            s,
            "| {src} | {} | {} | {} | {} |",
            t.cases, t.expressible, t.matched, t.runs_ok
        );
        total.cases += t.cases;
        total.expressible += t.expressible;
        total.matched += t.matched;
        total.runs_ok += t.runs_ok;
    }
    let _ = writeln!(
        s,
        "| **total** | {} | {} | {} | {} |",
        total.cases, total.expressible, total.matched, total.runs_ok
    );
    if !notes.is_empty() {
        s.push_str("\nCases not fully green:\n\n");
        for (case, note) in notes {
            let note = note.replace('|', "\\|");
            let _ = writeln!(s, "- `{case}`: {note}");
        }
    }
    s.push('\n');
    s.push_str(END);
    s
}

fn data_dir() -> PathBuf {
    crate::support::root().join("tests/data/conformance")
}

#[test]
fn conformance_cases_lower_check_and_run() {
    let dir = data_dir();
    let mut failures = Vec::new();
    let mut tallies: BTreeMap<&str, Tally> = BTreeMap::new();
    let mut notes = Vec::new();
    for src in SOURCES {
        let tally = tallies.entry(src).or_default();
        for path in crate::support::conformance::files(src) {
            let label = format!(
                "{src}/{}",
                path.file_name().unwrap_or_default().to_string_lossy()
            );
            let case = match parse_case(&path) {
                Ok(c) => c,
                Err(e) => {
                    failures.push(format!("{label}: malformed case: {e}"));
                    continue;
                }
            };
            let expected_prefix = if src == "dtensor" {
                "pytorch "
            } else {
                "nvfuser "
            };
            if !case.source.starts_with(expected_prefix) {
                failures.push(format!(
                    "{label}: a case under {src}/ must cite a `{expected_prefix}` source"
                ));
            }
            let o = run_case(&case);
            for f in &o.failures {
                failures.push(format!("{label} ({}): {f}", case.name));
            }
            tally.add(&o);
            if !(o.expressible && o.matched && o.runs_ok) && o.failures.is_empty() {
                notes.push((format!("{src}/{}", case.name), o.note.clone()));
            }
        }
    }
    let readme = dir.join("README.md");
    let text = std::fs::read_to_string(&readme).unwrap_or_default();
    let table = summary(&tallies, &notes);
    let current = match (text.find(BEGIN), text.find(END)) {
        (Some(a), Some(b)) if a < b => Some(&text[a..b + END.len()]),
        _ => None,
    };
    if std::env::var_os("MESHFLOW_BLESS").is_some() {
        let new = match current {
            Some(old) => text.replacen(old, &table, 1),
            None => format!("{text}\n{table}\n"),
        };
        std::fs::write(&readme, new).unwrap_or_else(|e| panic!("cannot write README: {e}"));
    } else if current != Some(table.as_str()) {
        failures.push(format!(
            "{} is out of date (rerun with MESHFLOW_BLESS=1); the summary is now:\n{table}",
            readme.display()
        ));
    }
    assert!(
        failures.is_empty(),
        "{} conformance failure(s):\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn case_headers_parse() {
    let dir = std::env::temp_dir().join(format!("mf-conformance-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        p
    };
    let ok = write(
        "ok.mf",
        "# source: pytorch a.py::T::t\n# expect: all_gather=1 all_to_all=2\n# ranks: 4 3\n\
         program p {\n  param ranks = 4\n}\n",
    );
    let c = parse_case(&ok).expect("parses");
    assert_eq!(c.ranks, vec![4, 3]);
    let mut want = BTreeMap::new();
    want.insert("all_gather".to_string(), 1);
    want.insert("all_to_all".to_string(), 2);
    assert_eq!(c.expect, Expect::Counts(want));
    let refused = write(
        "refused.mf",
        "# source: nvfuser tests/x.cpp::T\n# expect: refused \"partial sums\"\n# ranks: 2 3\n\
         program p {\n  param ranks = 2\n}\n",
    );
    assert_eq!(
        parse_case(&refused).expect("parses").expect,
        Expect::Refused("partial sums".into())
    );
    for (name, text, why) in [
        (
            "a.mf",
            "# expect: none\n# ranks: 4 3\nparam ranks",
            "source",
        ),
        (
            "b.mf",
            "# source: pytorch x\n# ranks: 4 3\nparam ranks",
            "expect",
        ),
        (
            "c.mf",
            "# source: pytorch x\n# expect: none\n# ranks: 4\nparam ranks",
            "ranks",
        ),
        (
            "d.mf",
            "# source: pytorch x\n# expect: ag\n# ranks: 4 2\nparam ranks",
            "NAME=COUNT",
        ),
        (
            "e.mf",
            "# source: other x\n# expect: none\n# ranks: 4 2\nparam ranks",
            "pytorch",
        ),
    ] {
        let e = parse_case(&write(name, text)).err().unwrap_or_default();
        assert!(e.contains(why), "{name}: `{e}` should mention {why}");
    }
    let mut got = BTreeMap::new();
    got.insert("all_gather".to_string(), 2);
    got.insert("all_to_all".to_string(), 1);
    let total = |n| [("comms".to_string(), n)].into_iter().collect();
    assert!(matches_counts(&total(3), &got));
    assert!(!matches_counts(&total(2), &got));
    let _ = std::fs::remove_dir_all(&dir);
}
