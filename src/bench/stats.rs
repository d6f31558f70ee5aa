//! Statistics and reports of the GPU benchmarks: medians, the bound, tables and JSON.

use std::fmt::Write as _;

use super::programs::Gemm3;

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
    /// Timed iterations per rank.
    pub iterations: usize,
}

impl Timing {
    /// From `times_us[rank][iteration]`.
    pub fn from_times(times_us: &[Vec<f64>]) -> Timing {
        let per_rank: Vec<f64> = times_us.iter().map(|t| median(t)).collect();
        let us = per_rank.iter().copied().fold(f64::NAN, f64::max);
        Timing {
            iterations: times_us.iter().map(Vec::len).min().unwrap_or(0),
            per_rank_median_us: per_rank,
            us,
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
    /// max(comm, GEMM), µs.
    pub bound_us: f64,
    /// The variants.
    pub variants: Vec<VariantResult>,
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

    /// A markdown table: the parts alone, the bound, each variant and its ratio to the bound.
    pub fn table(&self) -> String {
        let mut s = format!("### {}\n\n| what | µs (max over ranks of per-rank median) | / bound |\n|---|---:|---:|\n", self.title());
        let _ = writeln!(s, "| {} alone | {:.1} | |", self.comm_name, self.comm.us);
        let _ = writeln!(s, "| GEMM alone | {:.1} | |", self.gemm.us);
        let _ = writeln!(s, "| bound max(comm, GEMM) | {:.1} | 1.00 |", self.bound_us);
        for v in &self.variants {
            let _ = writeln!(
                s,
                "| {} | {:.1} | {:.2} |",
                v.name, v.timing.us, v.ratio_to_bound
            );
        }
        s
    }
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
        "{{\"us\": {}, \"per_rank_median_us\": [{}], \"iterations\": {}}}",
        json_f(t.us),
        ranks.join(", "),
        t.iterations
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
                    "{{\"name\": {}, \"timing\": {}, \"ratio_to_bound\": {}, \"sampled_rel_err\": {}}}",
                    json_s(&v.name),
                    timing_json(&v.timing),
                    json_f(v.ratio_to_bound),
                    json_f(v.sampled_rel_err)
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "  {{\"bench\": {}, \"m\": {}, \"k\": {}, \"n\": {}, \"dtype\": {}, \"world\": {}, \"device\": {}, \"comm_name\": {}, \"comm\": {}, \"gemm\": {}, \"bound_us\": {}, \"variants\": [{}]}}{}",
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
            variants: vec![VariantResult {
                name: "ring".into(),
                timing: t,
                ratio_to_bound: 1.0,
                sampled_rel_err: f64::NAN,
            }],
        };
        let j = results_json(std::slice::from_ref(&c));
        assert!(j.contains("\"device\": \"GPU \\\"x\\\"\""), "{j}");
        assert!(j.contains("\"sampled_rel_err\": null"), "{j}");
        assert!(c.table().contains("| ring | 10.0 | 1.00 |"));
    }
}
