//! The mutation corpus: broken host programs in `tests/data/mutations/*.mfh`, shared by the
//! cross-rank check tests and the runtime tests (forced to run, each must end in an error
//! rather than hang).
//!
//! Each file starts with two comments: `# expect: <substring of the check's message>` and
//! `# ranks: <world size>`.

use std::path::{Path, PathBuf};

/// One broken program of the corpus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mutation {
    /// File stem.
    pub name: String,
    /// The host program text (comments included).
    pub text: String,
    /// The world size to check and run it at.
    pub ranks: usize,
    /// A substring of the error message the cross-rank check must report.
    pub expected: String,
}

/// Why the corpus could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum CorpusError {
    /// A file or the folder could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file lacks its `# expect:` or `# ranks:` header.
    #[error("{path}: missing or malformed `# {what}:` header comment")]
    Header {
        /// The path.
        path: PathBuf,
        /// `expect` or `ranks`.
        what: &'static str,
    },
}

/// The folder holding the corpus.
pub fn mutation_dir() -> PathBuf {
    super::root().join("tests/data/mutations")
}

fn header<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .take_while(|l| l.trim_start().starts_with('#'))
        .find_map(|l| {
            l.trim_start()
                .strip_prefix('#')?
                .trim()
                .strip_prefix(key)?
                .strip_prefix(':')
        })
        .map(str::trim)
}

/// Loads every `*.mfh` of [`mutation_dir`], sorted by name.
pub fn mutation_corpus() -> Result<Vec<Mutation>, CorpusError> {
    let dir = mutation_dir();
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CorpusError::Io { path, source }
    };
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(io(&dir))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "mfh"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).map_err(io(&path))?;
            let bad = |what| CorpusError::Header {
                path: path.clone(),
                what,
            };
            let expected = header(&text, "expect")
                .filter(|e| !e.is_empty())
                .ok_or_else(|| bad("expect"))?;
            let ranks = header(&text, "ranks")
                .and_then(|r| r.parse().ok())
                .ok_or_else(|| bad("ranks"))?;
            Ok(Mutation {
                name: path
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                expected: expected.to_string(),
                ranks,
                text,
            })
        })
        .collect()
}
