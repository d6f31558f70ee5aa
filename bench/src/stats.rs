//! Statistics and reports of the GPU benchmarks: medians, the bound, tables and JSON.

use std::fmt::Write as _;

use crate::programs::Gemm3;
use crate::torch::TorchCase;

/// The median of `v` (mean of the middle two for an even count; NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Timings of one program over ranks and iterations: each rank's median, and their maximum
/// (the figure reported, as `torch_baselines.py` does).
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    /// The median over iterations, per rank, µs.
    pub per_rank_median_us: Vec<f64>,
    /// The maximum over ranks of the per-rank medians, µs.
    pub us: f64,
    /// Timed iterations (rounds) per rank.
    pub iterations: usize,
    /// The fastest and the slowest iteration (round), each taken at its slowest rank, µs.
    pub min_us: f64,
    /// See [`Timing::min_us`].
    pub max_us: f64,
}

impl Timing {
    /// From `times_us[rank][iteration]`.
    pub fn from_times(times_us: &[Vec<f64>]) -> Timing {
        let per_rank: Vec<f64> = times_us.iter().map(|t| median(t)).collect();
        let us = per_rank.iter().copied().fold(f64::NAN, f64::max);
        let iterations = times_us.iter().map(Vec::len).min().unwrap_or(0);
        let slowest: Vec<f64> = (0..iterations)
            .map(|i| times_us.iter().map(|t| t[i]).fold(f64::NAN, f64::max))
            .collect();
        Timing {
            iterations,
            per_rank_median_us: per_rank,
            us,
            min_us: slowest.iter().copied().fold(f64::NAN, f64::min),
            max_us: slowest.iter().copied().fold(f64::NAN, f64::max),
        }
    }
}

/// One variant of a case.
#[derive(Clone, Debug, PartialEq)]
pub struct VariantResult {
    /// The variant (`ring`, `chunked s=4`, ...).
    pub name: String,
    /// Its timing.
    pub timing: Timing,
    /// `timing.us / bound`.
    pub ratio_to_bound: f64,
    /// Relative error of sampled outputs against an f32 CPU reference.
    pub sampled_rel_err: f64,
    /// Host time to issue one step, µs (max over ranks of the per-rank median).
    pub host_us: Option<f64>,
    /// Why the variant could not be measured (its time is then NaN).
    pub failure: Option<String>,
}

/// One benchmark case: a shape on `world` GPUs.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseResult {
    /// `agmm` or `rsmm`.
    pub bench: &'static str,
    /// Full problem sizes.
    pub shape: Gemm3,
    /// Element type name.
    pub dtype: &'static str,
    /// Ranks (GPUs).
    pub world: usize,
    /// GPU name.
    pub device: String,
    /// The communication timed alone (`all_gather` or `reduce_scatter`).
    pub comm_name: &'static str,
    /// The communication alone.
    pub comm: Timing,
    /// The GEMM alone.
    pub gemm: Timing,
    /// Other parts timed alone (e.g. a variant's communications alone), by name.
    pub parts: Vec<(String, Timing)>,
    /// PyTorch's figures for the same case, when given.
    pub torch: Option<TorchCase>,
    /// `max(comm, gemm)`, µs.
    pub bound_us: f64,
    /// The variants.
    pub variants: Vec<VariantResult>,
    /// The machine profile the default row was priced with and why (`h100x2: built-in
    /// profile of NVIDIA H100 80GB HBM3`); `None` without a default row.
    pub profile: Option<String>,
}

impl CaseResult {
    /// The case's title line.
    pub fn title(&self) -> String {
        let Gemm3 { m, k, n } = self.shape;
        format!(
            "{} {} M={m} K={k} N={n}, d={} ({})",
            self.bench, self.dtype, self.world, self.device
        )
    }

    /// The case as a markdown table: the parts alone, the bound, every variant with its ratio
    /// to the bound, to PyTorch's sequential time and to PyTorch's async TP (when given), and
    /// the host time per step; then PyTorch's own figures and their ratio to this bound.
    pub fn table(&self) -> String {
        let t = self.torch.clone().unwrap_or_default();
        let ratio = |us: f64, other: Option<f64>| {
            other.map_or_else(String::new, |o| format!("{:.2}", us / o))
        };
        let mut s = format!("### {}\n\n", self.title());
        if let Some(p) = &self.profile {
            let _ = writeln!(s, "The default row is priced with the profile {p}.\n");
        }
        s.push_str(
            "| what | µs | / bound | / torch sequential | / torch async-TP | host µs/step |\n|---|---:|---:|---:|---:|---:|\n",
        );
        let _ = writeln!(
            s,
            "| {} alone | {:.1} | | | | |",
            self.comm_name, self.comm.us
        );
        let _ = writeln!(s, "| GEMM alone | {:.1} | | | | |", self.gemm.us);
        for (name, timing) in &self.parts {
            let _ = writeln!(s, "| {name} | {:.1} | | | | |", timing.us);
        }
        let _ = writeln!(
            s,
            "| **bound** max(comm, GEMM) | {:.1} | 1.00 | | | |",
            self.bound_us
        );
        for v in &self.variants {
            if let Some(why) = &v.failure {
                let _ = writeln!(
                    s,
                    "| {} | failed: {} | | | | |",
                    v.name,
                    why.replace('|', "/")
                );
                continue;
            }
            let _ = writeln!(
                s,
                "| {} | {:.1} | {:.2} | {} | {} | {} |",
                v.name,
                v.timing.us,
                v.ratio_to_bound,
                ratio(v.timing.us, t.sequential_us),
                ratio(v.timing.us, t.async_tp_us),
                v.host_us.map_or_else(String::new, |h| format!("{h:.1}"))
            );
        }
        let torch = [
            ("torch comm alone", t.comm_us),
            ("torch GEMM alone", t.gemm_us),
            ("torch sequential", t.sequential_us),
            ("torch async-TP", t.async_tp_us),
        ];
        for (name, us) in torch {
            if let Some(us) = us {
                let _ = writeln!(s, "| {name} | {us:.1} | {:.2} | | | |", us / self.bound_us);
            }
        }
        s
    }
}

/// Collective-permute bandwidth at one size: NCCL send/recv against the copy engine.
#[derive(Clone, Debug, PartialEq)]
pub struct PermuteResult {
    /// Bytes each rank sends (and receives).
    pub bytes: u64,
    /// Ranks.
    pub world: usize,
    /// NCCL grouped send/recv.
    pub nccl: Timing,
    /// Copy-engine pull.
    pub copy_engine: Timing,
    /// PyTorch's send/recv ring at this size (µs), when given.
    pub torch_us: Option<f64>,
}

impl PermuteResult {
    /// GB/s per rank and direction for a time in µs.
    pub fn gb_s(&self, us: f64) -> f64 {
        self.bytes as f64 / us / 1e3
    }
}

/// The permute results as a markdown table.
pub fn permute_table(results: &[PermuteResult], device: &str) -> String {
    let mut s = format!(
        "### collective permute, ring (send to rank + 1), bf16 ({device})\n\n| MiB per rank | NCCL µs | NCCL GB/s | copy engine µs | copy engine GB/s | CE / NCCL bandwidth | torch send/recv µs | torch GB/s |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for r in results {
        let torch = r.torch_us.map_or_else(
            || " | ".to_string(),
            |t| format!("{t:.1} | {:.1}", r.gb_s(t)),
        );
        let _ = writeln!(
            s,
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {torch} |",
            r.bytes >> 20,
            r.nccl.us,
            r.gb_s(r.nccl.us),
            r.copy_engine.us,
            r.gb_s(r.copy_engine.us),
            r.nccl.us / r.copy_engine.us
        );
    }
    s
}

/// The permute results as JSON.
pub fn permute_json(results: &[PermuteResult]) -> String {
    let rows: Vec<String> = results
        .iter()
        .map(|r| {
            format!(
                "  {{\"bytes\": {}, \"world\": {}, \"nccl\": {}, \"nccl_gb_s\": {}, \"copy_engine\": {}, \"copy_engine_gb_s\": {}, \"ce_over_nccl\": {}, \"torch_us\": {}}}",
                r.bytes,
                r.world,
                timing_json(&r.nccl),
                json_f(r.gb_s(r.nccl.us)),
                timing_json(&r.copy_engine),
                json_f(r.gb_s(r.copy_engine.us)),
                json_f(r.nccl.us / r.copy_engine.us),
                r.torch_us.map_or_else(|| "null".to_string(), json_f)
            )
        })
        .collect();
    format!("{{\"permute\": [\n{}\n]}}\n", rows.join(",\n"))
}

fn torch_json(t: &TorchCase) -> String {
    let f = |v: Option<f64>| json_f(v.unwrap_or(f64::NAN));
    format!(
        "{{\"comm_us\": {}, \"gemm_us\": {}, \"sequential_us\": {}, \"async_tp_us\": {}}}",
        f(t.comm_us),
        f(t.gemm_us),
        f(t.sequential_us),
        f(t.async_tp_us)
    )
}

fn json_f(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.3}")
    } else {
        "null".into()
    }
}

fn json_s(v: &str) -> String {
    let mut out = String::from("\"");
    for c in v.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn timing_json(t: &Timing) -> String {
    let ranks: Vec<String> = t.per_rank_median_us.iter().map(|v| json_f(*v)).collect();
    format!(
        "{{\"us\": {}, \"per_rank_median_us\": [{}], \"iterations\": {}, \"min_us\": {}, \"max_us\": {}}}",
        json_f(t.us),
        ranks.join(", "),
        t.iterations,
        json_f(t.min_us),
        json_f(t.max_us)
    )
}

/// The cases as a JSON document.
pub fn results_json(cases: &[CaseResult]) -> String {
    let mut out = String::from("{\"cases\": [\n");
    for (i, c) in cases.iter().enumerate() {
        let variants: Vec<String> = c
            .variants
            .iter()
            .map(|v| {
                format!(
                    "{{\"name\": {}, \"timing\": {}, \"ratio_to_bound\": {}, \"sampled_rel_err\": {}, \"host_us\": {}, \"failure\": {}}}",
                    json_s(&v.name),
                    timing_json(&v.timing),
                    json_f(v.ratio_to_bound),
                    json_f(v.sampled_rel_err),
                    json_f(v.host_us.unwrap_or(f64::NAN)),
                    v.failure.as_deref().map_or_else(|| "null".to_string(), json_s)
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "  {{\"bench\": {}, \"m\": {}, \"k\": {}, \"n\": {}, \"dtype\": {}, \"world\": {}, \"device\": {}, \"comm_name\": {}, \"comm\": {}, \"gemm\": {}, \"bound_us\": {}, \"parts\": {{{}}}, \"torch\": {}, \"variants\": [{}]}}{}",
            json_s(c.bench),
            c.shape.m,
            c.shape.k,
            c.shape.n,
            json_s(c.dtype),
            c.world,
            json_s(&c.device),
            json_s(c.comm_name),
            timing_json(&c.comm),
            timing_json(&c.gemm),
            json_f(c.bound_us),
            c.parts
                .iter()
                .map(|(n, t)| format!("{}: {}", json_s(n), timing_json(t)))
                .collect::<Vec<_>>()
                .join(", "),
            c.torch.as_ref().map_or_else(|| "null".to_string(), torch_json),
            variants.join(", "),
            if i + 1 < cases.len() { "," } else { "" }
        );
    }
    out.push_str("]}\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_max_over_ranks() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let t = Timing::from_times(&[vec![1.0, 5.0, 3.0], vec![2.0, 2.0, 9.0]]);
        assert_eq!(t.per_rank_median_us, vec![3.0, 2.0]);
        assert_eq!((t.us, t.iterations), (3.0, 3));
        // Per round the slowest rank: 2, 5, 9.
        assert_eq!((t.min_us, t.max_us), (2.0, 9.0));
    }

    #[test]
    fn json_is_well_formed_enough() {
        let t = Timing::from_times(&[vec![10.0]]);
        let c = CaseResult {
            bench: "agmm",
            shape: Gemm3 { m: 8, k: 8, n: 8 },
            dtype: "bf16",
            world: 1,
            device: "GPU \"x\"".into(),
            comm_name: "all_gather",
            comm: t.clone(),
            gemm: t.clone(),
            bound_us: 10.0,
            parts: vec![("ring permutes alone".into(), t.clone())],
            torch: Some(TorchCase {
                sequential_us: Some(20.0),
                ..TorchCase::default()
            }),
            profile: Some("h100x2: built-in profile of GPU".into()),
            variants: vec![VariantResult {
                name: "ring".into(),
                timing: t,
                ratio_to_bound: 1.0,
                sampled_rel_err: f64::NAN,
                host_us: Some(3.0),
                failure: None,
            }],
        };
        let j = results_json(std::slice::from_ref(&c));
        assert!(j.contains("\"device\": \"GPU \\\"x\\\"\""), "{j}");
        assert!(j.contains("\"sampled_rel_err\": null"), "{j}");
        assert!(
            c.table().contains("| ring | 10.0 | 1.00 | 0.50 |  | 3.0 |"),
            "{}",
            c.table()
        );
        assert!(j.contains("\"sequential_us\": 20.000"), "{j}");
        assert!(
            c.table().contains(
                "\n\nThe default row is priced with the profile h100x2: built-in profile of \
                 GPU.\n\n| what |"
            ),
            "{}",
            c.table()
        );
        let p = PermuteResult {
            bytes: 64 << 20,
            world: 2,
            nccl: Timing::from_times(&[vec![300.0]]),
            copy_engine: Timing::from_times(&[vec![200.0]]),
            torch_us: None,
        };
        let table = permute_table(std::slice::from_ref(&p), "GPU");
        assert!(
            table.contains("| 64 | 300.0 | 223.7 | 200.0 | 335.5 | 1.50 |"),
            "{table}"
        );
        assert!(permute_json(&[p]).contains("\"ce_over_nccl\": 1.500"));
    }
}
