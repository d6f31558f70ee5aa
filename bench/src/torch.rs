//! PyTorch baselines for the benchmark tables: the JSON that `bench/torch_baselines.py` writes
//! (`{"agmm_MxKxN": {"allgather_us": .., "gemm_us": .., "ag_then_gemm_us": ..,
//! "torch_async_tp_us": ..}, "rsmm_MxKxN": {..}, "sendrecv_64MiB": {"us": .., "GBps": ..}}`),
//! read with a small JSON reader (objects, numbers, strings, booleans, null, arrays).

use std::collections::BTreeMap;

use crate::programs::Gemm3;

/// A JSON value (numbers as f64).
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A number.
    Num(f64),
    /// A string.
    Str(String),
    /// An array.
    Arr(Vec<Json>),
    /// An object (keys sorted).
    Obj(BTreeMap<String, Json>),
}

/// Why a JSON text could not be read.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("torch baselines JSON, byte {at}: {what}")]
pub struct JsonError {
    /// Byte offset.
    pub at: usize,
    /// What was expected.
    pub what: String,
}

struct Reader<'a> {
    s: &'a [u8],
    i: usize,
}

impl Reader<'_> {
    fn err<T>(&self, what: &str) -> Result<T, JsonError> {
        Err(JsonError {
            at: self.i,
            what: what.to_owned(),
        })
    }

    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Result<(), JsonError> {
        self.ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            Ok(())
        } else {
            self.err(&format!("expected `{}`", c as char))
        }
    }

    fn word(&mut self, w: &str, v: Json) -> Result<Json, JsonError> {
        if self.s[self.i..].starts_with(w.as_bytes()) {
            self.i += w.len();
            Ok(v)
        } else {
            self.err("expected a value")
        }
    }

    fn string(&mut self) -> Result<String, JsonError> {
        self.eat(b'"')?;
        let mut out = Vec::new();
        loop {
            let Some(&c) = self.s.get(self.i) else {
                return self.err("unterminated string");
            };
            self.i += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let Some(&e) = self.s.get(self.i) else {
                        return self.err("unterminated escape");
                    };
                    self.i += 1;
                    match e {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        b'u' => {
                            // Non-ASCII escapes are kept as `?` (names and numbers are ASCII).
                            self.i = (self.i + 4).min(self.s.len());
                            out.push(b'?');
                        }
                        other => out.push(other),
                    }
                }
                c => out.push(c),
            }
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }

    fn value(&mut self, depth: usize) -> Result<Json, JsonError> {
        if depth > 64 {
            return self.err("nested too deeply");
        }
        self.ws();
        match self.s.get(self.i) {
            Some(b'{') => {
                self.i += 1;
                let mut m = BTreeMap::new();
                self.ws();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(m));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.eat(b':')?;
                    let v = self.value(depth + 1)?;
                    m.insert(k, v);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(m));
                        }
                        _ => return self.err("expected `,` or `}`"),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(Json::Arr(v));
                }
                loop {
                    v.push(self.value(depth + 1)?);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(v));
                        }
                        _ => return self.err("expected `,` or `]`"),
                    }
                }
            }
            Some(b'"') => self.string().map(Json::Str),
            Some(b't') => self.word("true", Json::Bool(true)),
            Some(b'f') => self.word("false", Json::Bool(false)),
            Some(b'n') => self.word("null", Json::Null),
            Some(_) => {
                let start = self.i;
                while self
                    .s
                    .get(self.i)
                    .is_some_and(|c| c.is_ascii_digit() || b"+-.eE".contains(c))
                {
                    self.i += 1;
                }
                std::str::from_utf8(&self.s[start..self.i])
                    .ok()
                    .and_then(|t| t.parse::<f64>().ok())
                    .map(Json::Num)
                    .map_or_else(|| self.err("expected a number"), Ok)
            }
            None => self.err("unexpected end"),
        }
    }
}

/// Parses a JSON text (one value, then only whitespace).
pub fn parse_json(text: &str) -> Result<Json, JsonError> {
    let mut r = Reader {
        s: text.as_bytes(),
        i: 0,
    };
    let v = r.value(0)?;
    r.ws();
    if r.i != r.s.len() {
        return r.err("text after the value");
    }
    Ok(v)
}

/// PyTorch figures of one GEMM case (µs).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TorchCase {
    /// The collective alone (all-gather or reduce-scatter).
    pub comm_us: Option<f64>,
    /// The GEMM alone.
    pub gemm_us: Option<f64>,
    /// Communication then GEMM (or GEMM then communication), no overlap.
    pub sequential_us: Option<f64>,
    /// `torch.ops.symm_mem.fused_*` (async TP).
    pub async_tp_us: Option<f64>,
}

/// The PyTorch baselines of one run of `torch_baselines.py`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TorchBaselines {
    /// The GPU name.
    pub device: Option<String>,
    /// Ranks.
    pub world: Option<usize>,
    /// `agmm_MxKxN` and `rsmm_MxKxN` entries by key.
    pub cases: BTreeMap<String, TorchCase>,
    /// Send/recv ring per size in MiB: (µs, GB/s).
    pub sendrecv: BTreeMap<u64, (f64, f64)>,
}

impl TorchBaselines {
    /// Reads the JSON of `torch_baselines.py` (its file, or its `BASELINES {...}` line).
    pub fn parse(text: &str) -> Result<TorchBaselines, JsonError> {
        let body = text
            .lines()
            .find_map(|l| l.strip_prefix("BASELINES "))
            .unwrap_or(text);
        let Json::Obj(top) = parse_json(body.trim())? else {
            return Err(JsonError {
                at: 0,
                what: "expected an object".into(),
            });
        };
        let num = |o: &BTreeMap<String, Json>, k: &str| match o.get(k) {
            Some(Json::Num(v)) => Some(*v),
            _ => None,
        };
        let mut out = TorchBaselines {
            device: match top.get("device") {
                Some(Json::Str(s)) => Some(s.clone()),
                _ => None,
            },
            world: num(&top, "world").map(|w| w as usize),
            ..TorchBaselines::default()
        };
        for (k, v) in &top {
            let Json::Obj(o) = v else { continue };
            if k.starts_with("agmm_") {
                out.cases.insert(
                    k.clone(),
                    TorchCase {
                        comm_us: num(o, "allgather_us"),
                        gemm_us: num(o, "gemm_us"),
                        sequential_us: num(o, "ag_then_gemm_us"),
                        async_tp_us: num(o, "torch_async_tp_us"),
                    },
                );
            } else if k.starts_with("rsmm_") {
                out.cases.insert(
                    k.clone(),
                    TorchCase {
                        comm_us: num(o, "reduce_scatter_us"),
                        gemm_us: num(o, "gemm_us"),
                        sequential_us: num(o, "gemm_then_rs_us"),
                        async_tp_us: num(o, "torch_async_tp_us"),
                    },
                );
            } else if let Some(mib) = k
                .strip_prefix("sendrecv_")
                .and_then(|r| r.strip_suffix("MiB"))
                .and_then(|m| m.parse::<u64>().ok())
            {
                if let (Some(us), Some(gbps)) = (num(o, "us"), num(o, "GBps")) {
                    out.sendrecv.insert(mib, (us, gbps));
                }
            }
        }
        Ok(out)
    }

    /// The figures of `bench` (`agmm` / `rsmm`) at `shape`.
    pub fn case(&self, bench: &str, shape: Gemm3) -> Option<&TorchCase> {
        self.cases
            .get(&format!("{bench}_{}x{}x{}", shape.m, shape.k, shape.n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_committed_baselines() {
        let text = include_str!("../../bench/results/2026-11-22-h200x2-torch.json");
        let t = TorchBaselines::parse(text).unwrap();
        assert_eq!(t.world, Some(2));
        assert_eq!(t.device.as_deref(), Some("NVIDIA H200"));
        let c = t
            .case(
                "agmm",
                Gemm3 {
                    m: 16384,
                    k: 8192,
                    n: 8192,
                },
            )
            .unwrap();
        assert_eq!(c.sequential_us, Some(2189.2));
        assert_eq!(c.async_tp_us, Some(1642.2));
        assert_eq!(t.sendrecv.get(&64), Some(&(290.2, 231.3)));
        let line = format!(
            "noise\nBASELINES {}\n",
            r#"{"world": 2, "agmm_1x2x3": {"gemm_us": 1e1}}"#
        );
        let t = TorchBaselines::parse(&line).unwrap();
        assert_eq!(t.cases["agmm_1x2x3"].gemm_us, Some(10.0));
    }

    #[test]
    fn bad_json_is_an_error() {
        for bad in ["", "{", "{\"a\": }", "[1, 2", "{\"a\": 1} x", "\"abc"] {
            assert!(parse_json(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_json("[true, null, \"a\\\"b\", -1.5e2]").unwrap(),
            Json::Arr(vec![
                Json::Bool(true),
                Json::Null,
                Json::Str("a\"b".into()),
                Json::Num(-150.0)
            ])
        );
    }
}
