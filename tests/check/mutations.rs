//! The mutation corpus: every broken host program in `tests/data/mutations` fails the
//! cross-rank check with the message its `# expect:` header names.

use crate::support::corpus::mutation_corpus;
use meshflow::check::check_program;
use meshflow::ir::{parse_host, verify_host};

#[test]
fn corpus_is_large_enough() {
    let corpus = mutation_corpus().expect("corpus loads");
    assert!(corpus.len() >= 40, "only {} mutations", corpus.len());
}

#[test]
fn every_mutation_is_caught_with_its_message() {
    let corpus = mutation_corpus().expect("corpus loads");
    let mut failures = Vec::new();
    for m in &corpus {
        let program = match parse_host(&m.text) {
            Ok(p) => p,
            Err(e) => {
                failures.push(format!("{}: does not parse: {e}", m.name));
                continue;
            }
        };
        // Each mutation is a cross-rank bug: the single-program verifier accepts it.
        if let Err(e) = verify_host(&program) {
            failures.push(format!("{}: rejected by the verifier: {e}", m.name));
            continue;
        }
        match check_program(&program, m.ranks) {
            Ok(report) => failures.push(format!("{}: passed the check: {report}", m.name)),
            Err(errors) => {
                let message = errors.to_string();
                if !message.contains(&m.expected) {
                    failures.push(format!(
                        "{}: expected `{}` in:\n{message}",
                        m.name, m.expected
                    ));
                }
            }
        }
    }
    // The figure of docs/hardening.md (collected by scripts/hardening.sh).
    eprintln!(
        "HARDENING|mutations|{}|{}",
        corpus.len() - failures.len(),
        corpus.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
