//! File-driven pass tests: every `tests/data/passes/NAME.mf` (level-1 text) is compiled through
//! the whole pipeline and its host program compared with `NAME.mfh` beside it, which is host
//! IR text itself (so it also parses back and passes the cross-rank check). With
//! `MESHFLOW_BLESS=1` the `.mfh` files are (re)written from what the compiler prints instead;
//! review the diff before committing it.
//!
//! Comment lines at the top of a `.mf` set the options: `# ranks: N`, `# streams: N`,
//! `# schedule: per-iteration|prefetch`, `# decompose: TENSOR=collective|broadcast|ring`,
//! `# disable: PASS`, `# param: NAME=VALUE` (each repeatable where it makes sense).

use std::path::{Path, PathBuf};

use meshflow::pipeline::StreamSchedule;
use meshflow::{Decomposition, Options};

/// The variable that turns blessing on.
pub const BLESS_ENV: &str = "MESHFLOW_BLESS";

/// True when the expectations are to be rewritten.
pub fn blessing() -> bool {
    std::env::var(BLESS_ENV).is_ok_and(|v| v == "1")
}

/// One input file and its expectation.
#[derive(Clone, Debug)]
pub struct Case {
    /// The file stem.
    pub name: String,
    /// The `.mf` input.
    pub input: PathBuf,
    /// The `.mfh` expectation.
    pub expected: PathBuf,
    /// The input text.
    pub text: String,
}

/// Every `*.mf` of `dir`, sorted by name.
pub fn cases(dir: &Path) -> Vec<Case> {
    let mut inputs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "mf"))
        .collect();
    inputs.sort();
    inputs
        .into_iter()
        .map(|input| Case {
            name: input
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            expected: input.with_extension("mfh"),
            text: std::fs::read_to_string(&input)
                .unwrap_or_else(|e| panic!("{}: {e}", input.display())),
            input,
        })
        .collect()
}

/// The `# key: value` lines at the top of `text`.
fn headers(text: &str) -> Vec<(String, String)> {
    text.lines()
        .take_while(|l| l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.trim_start().strip_prefix('#')?.split_once(':')?;
            Some((k.trim().to_string(), v.trim().to_string()))
        })
        .collect()
}

/// The options a case's header comments ask for (checks on, verification after every pass).
pub fn options(case: &Case) -> Result<Options, String> {
    let mut o = Options::new().verify_each_pass(true);
    for (key, value) in headers(&case.text) {
        let bad = |what: &str| format!("{}: `# {key}: {value}`: {what}", case.name);
        o = match key.as_str() {
            "ranks" => o.with_ranks(value.parse().map_err(|_| bad("not a number"))?),
            "streams" => o.streams(value.parse().map_err(|_| bad("not a number"))?),
            "schedule" => o.stream_schedule(match value.as_str() {
                "prefetch" => StreamSchedule::Prefetch,
                "per-iteration" => StreamSchedule::PerIteration,
                _ => return Err(bad("expected per-iteration or prefetch")),
            }),
            "decompose" => {
                let (t, v) = value.split_once('=').ok_or_else(|| bad("expected T=V"))?;
                let v: Decomposition = v.trim().parse().map_err(|e| bad(&format!("{e}")))?;
                o.decomposition(t.trim(), v)
            }
            "disable" => o.disable_pass(value.clone()),
            "param" => {
                let (n, v) = value.split_once('=').ok_or_else(|| bad("expected N=V"))?;
                o.param(n.trim(), v.trim().parse().map_err(|_| bad("not a number"))?)
            }
            _ => o,
        };
    }
    Ok(o)
}

/// Compares `got` with the expectation file, or writes it when blessing. `Err` describes the
/// first difference.
pub fn expect_file(path: &Path, got: &str) -> Result<(), String> {
    if blessing() {
        return std::fs::write(path, got).map_err(|e| format!("{}: {e}", path.display()));
    }
    let want = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "{}: {e} (run with {BLESS_ENV}=1 to write it)",
            path.display()
        )
    })?;
    if want == got {
        return Ok(());
    }
    let (w, g): (Vec<_>, Vec<_>) = (want.lines().collect(), got.lines().collect());
    let line = w
        .iter()
        .zip(&g)
        .position(|(a, b)| a != b)
        .unwrap_or(w.len().min(g.len()));
    Err(format!(
        "{} differs from the output at line {}:\n  expected: {}\n  got:      {}\n\
         (whole output below; {BLESS_ENV}=1 rewrites the file)\n{got}",
        path.display(),
        line + 1,
        w.get(line).unwrap_or(&"<end of file>"),
        g.get(line).unwrap_or(&"<end of output>"),
    ))
}
