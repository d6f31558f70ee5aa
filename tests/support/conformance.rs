//! The conformance cases of `tests/data/conformance/<dtensor|nvfuser>/*.mf` and their headers
//! (see `tests/sharding/conformance.rs`), shared by the CPU harness and the GPU test.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The peers, one folder each.
pub const SOURCES: [&str; 2] = ["dtensor", "nvfuser"];

/// What a case expects of the lowering at the peer's rank count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Communication counts by host-text name (`comms` = the total); empty for `none`.
    Counts(BTreeMap<String, usize>),
    /// Lowering fails with an error containing this substring.
    Refused(String),
}

/// One case file.
#[derive(Debug)]
pub struct Case {
    /// The file.
    pub path: PathBuf,
    /// The file stem.
    pub name: String,
    /// `dtensor` or `nvfuser`.
    pub peer: String,
    /// The `# source:` line.
    pub source: String,
    /// The `# expect:` line.
    pub expect: Expect,
    /// The peer's rank count first, then others.
    pub ranks: Vec<i64>,
    /// The whole file (a level-1 program after the header comments).
    pub text: String,
    /// False with `# merge: off`: the peer does not merge consecutive collectives over a
    /// flattened mesh in this test (DTensor without a user-created flattened mesh), so the
    /// case is compiled with `merge_collectives` of the pass options off.
    pub merge: bool,
}

impl Case {
    /// The compile options of the case: no cross-rank check (the harness runs it) and the
    /// merging of collectives as the peer does.
    pub fn options(&self) -> meshflow::Options {
        let mut options = meshflow::Options::new().check(false);
        options.pass_options_mut().merge_collectives = self.merge;
        options
    }
}

/// Parses the headers of one case file (see `tests/data/conformance/README.md`).
pub fn parse_case(path: &Path) -> Result<Case, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read: {e}"))?;
    let header = |key: &str| -> Result<String, String> {
        let prefix = format!("# {key}:");
        let mut lines = text.lines().filter(|l| l.starts_with(&prefix));
        let line = lines
            .next()
            .ok_or_else(|| format!("missing header line `# {key}: ...`"))?;
        if lines.next().is_some() {
            return Err(format!("header `# {key}:` appears twice"));
        }
        Ok(line[prefix.len()..].trim().to_string())
    };
    let source = header("source")?;
    if !(source.starts_with("pytorch ") || source.starts_with("nvfuser ")) {
        return Err(format!(
            "`# source:` must start with `pytorch ` or `nvfuser `, got `{source}`"
        ));
    }
    let expect_text = header("expect")?;
    let expect = if let Some(rest) = expect_text.strip_prefix("refused") {
        let quoted = rest.trim();
        let inner = quoted
            .strip_prefix('"')
            .and_then(|q| q.strip_suffix('"'))
            .ok_or_else(|| {
                format!("`# expect: refused \"...\"` needs a quoted substring, got `{quoted}`")
            })?;
        Expect::Refused(inner.to_string())
    } else if expect_text == "none" {
        Expect::Counts(BTreeMap::new())
    } else {
        let mut counts = BTreeMap::new();
        for term in expect_text.split(',').flat_map(str::split_whitespace) {
            let (name, n) = term
                .split_once('=')
                .ok_or_else(|| format!("`# expect:` term `{term}` is not NAME=COUNT"))?;
            let n: usize = n
                .parse()
                .map_err(|_| format!("`# expect:` term `{term}`: `{n}` is not a count"))?;
            if n == 0 || counts.insert(name.to_string(), n).is_some() {
                return Err(format!(
                    "`# expect:` term `{term}`: counts are positive and each name appears once"
                ));
            }
        }
        if counts.is_empty() {
            return Err("`# expect:` is empty (write `none` for a local-only case)".into());
        }
        Expect::Counts(counts)
    };
    let ranks: Vec<i64> = header("ranks")?
        .split_whitespace()
        .map(|r| {
            r.parse::<i64>()
                .map_err(|_| format!("`# ranks:` `{r}` is not an integer"))
        })
        .collect::<Result<_, _>>()?;
    if ranks.len() < 2 || ranks.iter().any(|&r| r < 1) {
        return Err("`# ranks:` needs the peer's rank count and at least one other".into());
    }
    if !text.contains("param ranks") {
        return Err("the program must declare `param ranks`".into());
    }
    let merge = match header("merge") {
        Ok(v) if v == "off" => false,
        Ok(v) => return Err(format!("`# merge:` takes only `off`, got `{v}`")),
        Err(_) => true,
    };
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let peer = path
        .parent()
        .and_then(|p| p.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(Case {
        path: path.to_path_buf(),
        name,
        peer,
        source,
        expect,
        ranks,
        text,
        merge,
    })
}

/// The case files of `peer`'s folder, sorted.
pub fn files(peer: &str) -> Vec<PathBuf> {
    let dir = super::root().join("tests/data/conformance").join(peer);
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "mf"))
        .collect();
    out.sort();
    out
}

/// Every case, `dtensor/` first, sorted by file name (a malformed case panics with its file).
pub fn cases() -> Vec<Case> {
    SOURCES
        .iter()
        .flat_map(|peer| files(peer))
        .map(|p| parse_case(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}
