//! The conformance cases of `tests/data/conformance/<dtensor|nvfuser>/*.mf` and their headers
//! (see `tests/conformance_ops.rs`), shared by the sim and GPU tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What a case expects.
#[derive(Debug)]
pub enum Expect {
    /// Exact static counts of communication instructions by host-text name (empty: `none`).
    Counts(BTreeMap<String, usize>),
    /// Lowering fails with an error containing this substring.
    Refused(String),
}

/// One case file.
#[derive(Debug)]
pub struct Case {
    pub path: PathBuf,
    pub source: String,
    pub expect: Expect,
    pub ranks: Vec<i64>,
    pub text: String,
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

/// Every case, `dtensor/` first, sorted by file name.
pub fn cases() -> Vec<Case> {
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
