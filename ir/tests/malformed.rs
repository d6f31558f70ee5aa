//! Malformed input never panics: every truncation of the examples, seeded random garbling and
//! random token soup, for both parsers. Every error lies inside the text (or one past its
//! end) and has a message. Whatever still parses must verify without panicking and
//! round-trip.

mod common;

use common::{examples, host_examples};
use meshflow_ir::{parse_host, parse_program, verify_host, verify_program, ParseError};

/// A small deterministic generator (SplitMix64), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

#[derive(Clone, Copy)]
enum Level {
    Program,
    Host,
}

/// Checks that an error points into `text` (or one past its end).
fn check_error(text: &str, e: &ParseError) {
    assert!(!e.message.is_empty(), "empty message for {text:?}");
    let lines: Vec<&str> = text.split('\n').collect();
    let line = e.line as usize;
    assert!(
        line >= 1 && line <= lines.len(),
        "line {} outside the text ({} lines): {e} for {text:?}",
        e.line,
        lines.len()
    );
    let len = lines[line - 1].chars().count();
    assert!(
        e.col >= 1 && e.col as usize <= len + 1,
        "column {} outside line {line} ({len} chars): {e} for {text:?}",
        e.col
    );
}

/// Parses `text`; on success verifies (must not panic) and round-trips; on failure checks the
/// error. Returns true when the text parsed.
fn exercise(level: Level, text: &str) -> bool {
    match level {
        Level::Program => match parse_program(text) {
            Ok(p) => {
                let _ = verify_program(&p);
                let printed = p.to_string();
                assert_eq!(parse_program(&printed).as_ref(), Ok(&p), "{printed}");
                true
            }
            Err(e) => {
                check_error(text, &e);
                false
            }
        },
        Level::Host => match parse_host(text) {
            Ok(p) => {
                let _ = verify_host(&p);
                let printed = p.to_string();
                assert_eq!(parse_host(&printed).as_ref(), Ok(&p), "{printed}");
                true
            }
            Err(e) => {
                check_error(text, &e);
                false
            }
        },
    }
}

fn corpus() -> Vec<(Level, String)> {
    let mut out: Vec<(Level, String)> = examples()
        .into_iter()
        .map(|(_, t)| (Level::Program, t))
        .collect();
    out.extend(host_examples().into_iter().map(|(_, t)| (Level::Host, t)));
    out
}

#[test]
fn every_truncation_fails_cleanly() {
    let mut cases = 0;
    for (level, text) in corpus() {
        let ends: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        for &end in &ends {
            let cut = &text[..end];
            // Only the whole text (modulo trailing trivia) is a complete program.
            let parsed = exercise(level, cut);
            if parsed {
                assert!(
                    text[end..].trim().is_empty() || text[end..].trim_start().starts_with('#'),
                    "a strict prefix parsed: {cut:?}"
                );
            }
            cases += 1;
        }
    }
    assert!(cases > 5000, "{cases} truncations");
}

const NOISE: &[&str] = &[
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    "=",
    "+",
    "-",
    "*",
    "/",
    "%",
    "->",
    "..",
    ".",
    "#",
    "\"",
    "\\",
    "\n",
    " ",
    "0",
    "7",
    "99999999999999999999999",
    "r",
    "r0",
    "x",
    "i0",
    "s0",
    "c0",
    "my",
    "rank",
    "é",
    "\0",
    "\t",
    "@",
    "in",
    "out",
    "for",
    "mesh",
    "iota",
    "param",
];

/// One random edit: replace, insert or delete a char, duplicate or delete a line, or swap two
/// lines.
fn garble(rng: &mut Rng, text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let at = rng.below(chars.len() + 1);
    let noise: Vec<char> = rng.pick(NOISE).chars().collect();
    match rng.below(6) {
        0 => {
            let mut c = chars.clone();
            if at < c.len() {
                c.splice(at..=at, noise);
            }
            c.into_iter().collect()
        }
        1 => {
            let mut c = chars.clone();
            c.splice(at..at, noise);
            c.into_iter().collect()
        }
        2 => {
            let mut c = chars.clone();
            let len = rng.below(8).min(c.len().saturating_sub(at));
            c.drain(at..at + len);
            c.into_iter().collect()
        }
        _ => {
            let mut lines: Vec<&str> = text.lines().collect();
            let (a, b) = (rng.below(lines.len()), rng.below(lines.len()));
            match rng.below(3) {
                0 => lines.insert(a, lines[b]),
                1 => {
                    lines.remove(a);
                }
                _ => lines.swap(a, b),
            }
            lines.join("\n")
        }
    }
}

#[test]
fn garbled_text_fails_cleanly() {
    let mut rng = Rng(0x5EED_0001);
    let mut parsed = 0;
    let mut total = 0;
    for (level, text) in corpus() {
        for _ in 0..400 {
            let mut t = text.clone();
            for _ in 0..=rng.below(3) {
                t = garble(&mut rng, &t);
            }
            if exercise(level, &t) {
                parsed += 1;
            }
            total += 1;
        }
    }
    assert!(total >= 4000);
    // Some edits (whitespace, comments, swapped declarations) keep the text valid.
    assert!(parsed > 0 && parsed < total, "{parsed} of {total} parsed");
}

const PROGRAM_WORDS: &[&str] = &[
    "program",
    "p",
    "{",
    "}",
    "param",
    "d",
    "=",
    "4",
    "mesh",
    "m",
    "[",
    "0",
    ",",
    "1",
    "]",
    "iota",
    "(",
    ")",
    "start",
    "input",
    "tensor",
    "x",
    ":",
    "f32",
    "r32",
    "r",
    "on",
    "output",
    "outer_split",
    "parallelize",
    "DIDx",
    "Stream",
    "swizzle1d",
    "reorder",
    "merge",
    "set",
    "linear",
    "sum",
    "axis",
    "+",
    "-",
    "*",
    "/",
    "%",
    "\n",
    "#c\n",
    "y",
    "bf16",
    "moe_dispatch",
];

const HOST_WORDS: &[&str] = &[
    "host",
    "h",
    "{",
    "}",
    "mesh",
    "m",
    "=",
    "[",
    "0",
    ",",
    "1",
    "]",
    "in",
    "out",
    "tensor",
    "x",
    "y",
    ":",
    "f32",
    "on",
    "allocate",
    "deallocate",
    "for",
    "i0",
    "..",
    "s0",
    "get_current_stream",
    "set_current_stream",
    "worker",
    "(",
    ")",
    "synchronize",
    "c0",
    "all_gather",
    "->",
    "team",
    "slice",
    "DIDx",
    "devices",
    "root",
    "op",
    "sum",
    "wait",
    "start_coalescing",
    "end_coalescing",
    "shard_by_stream",
    "axis",
    "chunks",
    "index",
    "collective_permute",
    "send",
    "recv",
    "moe_dispatch",
    "moe_combine",
    "linear",
    "perm",
    "call_kernel",
    "kernel",
    "\"k\\n\"",
    "args",
    "my",
    "rank",
    "-",
    "3",
    "%",
    "\n",
];

#[test]
fn token_soup_fails_cleanly() {
    let mut rng = Rng(0x5EED_0002);
    let sets: [(Level, &[&str], &str); 2] = [
        (Level::Program, PROGRAM_WORDS, "program p {\n"),
        (
            Level::Host,
            HOST_WORDS,
            "host h {\n  mesh m = [0, 1]\n  in x: f32[4] on m\n",
        ),
    ];
    for (level, words, header) in sets {
        for case in 0..2500 {
            let mut text = if case % 2 == 0 {
                header.to_string()
            } else {
                String::new()
            };
            for _ in 0..rng.below(40) {
                text.push_str(rng.pick::<&str>(words));
                text.push(' ');
            }
            if case % 3 == 0 {
                text.push('}');
            }
            exercise(level, &text);
        }
    }
}

#[test]
fn pathological_nesting_fails_cleanly() {
    let deep_paren = format!(
        "program p {{\n  mesh m = [{}0{}]\n}}\n",
        "(".repeat(100_000),
        ")".repeat(100_000)
    );
    assert!(!exercise(Level::Program, &deep_paren));
    let deep_minus = format!("program p {{\n  mesh m = [{}1]\n}}\n", "-(".repeat(50_000));
    assert!(!exercise(Level::Program, &deep_minus));
    let deep_list = format!(
        "program p {{\n  mesh m = {}0{}\n}}\n",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(!exercise(Level::Program, &deep_list));
    let long_chain = format!(
        "host h {{\n  set_current_stream worker({})\n}}\n",
        vec!["1"; 100_000].join(" - ")
    );
    assert!(!exercise(Level::Host, &long_chain));
    let deep_loops = format!("host h {{\n{}\n}}\n", "for i0 in 0..1 {\n".repeat(10_000));
    assert!(!exercise(Level::Host, &deep_loops));
    let huge_mesh = "program p {\n  mesh m = iota(100000, 100000)\n}\n";
    assert!(!exercise(Level::Program, huge_mesh));
    let huge_extent =
        "program p {\n  mesh m = [0]\n  input x: f32[18446744073709551615, 2] on m {merge(0)}\n}\n";
    assert!(exercise(Level::Program, huge_extent));
}
