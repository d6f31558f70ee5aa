//! Flat JSON rows of the benchmarks, one object per measured variant, the form the results in
//! `bench/results/` are kept in:
//!
//! - [`schedule_rows`]: every AG+GEMM and GEMM+RS variant (`meshflow bench schedule`) with
//!   the keys `case` (`agmm_MxKxN`, `rsmm_MxKxN`), `world`, `variant`, `procs` (1: ranks as
//!   threads of one process; `world`: one process per GPU), `default` (true for the row of the
//!   plan plain `meshflow lower` chooses), `us`, `bound_us`, `torch_async_tp_us`, `device`;
//! - [`moe_row`]: one MoE case with the keys `path` (`kernels`: the kernels alone; `evaluator`:
//!   the lowered `moe_layer` program's instructions run by the evaluator), `transport`,
//!   `dtype`, `world`, `tokens`, `dispatch_us`, `combine_us`, `dispatch_gbps`,
//!   `combine_gbps`, `torch_dispatch_us`, `torch_combine_us`, `device` (and extra keys the
//!   caller adds).
//!
//! Schedule rows also carry `min_us` and `max_us` (the fastest and slowest timed round) and
//! `rounds`.
//!
//! Times that were not measured (a failed variant, no PyTorch figures) are `null`.

use serde_json::{json, Map, Value};

use crate::stats::CaseResult;

/// The name every default row's variant starts with (`default: <plan>`).
pub const DEFAULT_PREFIX: &str = "default";

/// A finite number, or `null`.
pub fn num(v: f64) -> Value {
    if v.is_finite() {
        json!((v * 100.0).round() / 100.0)
    } else {
        Value::Null
    }
}

/// The rows of `cases`, measured with `procs` processes.
pub fn schedule_rows(cases: &[CaseResult], procs: usize) -> Vec<Value> {
    let mut rows = Vec::new();
    for c in cases {
        let case = format!("{}_{}x{}x{}", c.bench, c.shape.m, c.shape.k, c.shape.n);
        let torch = c
            .torch
            .as_ref()
            .and_then(|t| t.async_tp_us)
            .map_or(Value::Null, num);
        for v in &c.variants {
            rows.push(json!({
                "case": case,
                "world": c.world,
                "variant": v.name,
                "procs": procs,
                "default": v.name.starts_with(DEFAULT_PREFIX),
                "us": num(v.timing.us),
                "bound_us": num(c.bound_us),
                "torch_async_tp_us": torch,
                "device": c.device,
                "min_us": num(v.timing.min_us),
                "max_us": num(v.timing.max_us),
                "rounds": v.timing.iterations,
            }));
        }
    }
    rows
}

/// One MoE row (see the module docs); `extra` keys are appended.
#[allow(clippy::too_many_arguments)]
pub fn moe_row(
    path: &str,
    transport: &str,
    dtype: &str,
    world: usize,
    tokens: usize,
    (dispatch_us, combine_us): (f64, f64),
    (dispatch_gbps, combine_gbps): (f64, f64),
    torch: Option<(f64, f64)>,
    device: &str,
    extra: Map<String, Value>,
) -> Value {
    let mut row = json!({
        "path": path,
        "transport": transport,
        "dtype": dtype,
        "world": world,
        "tokens": tokens,
        "dispatch_us": num(dispatch_us),
        "combine_us": num(combine_us),
        "dispatch_gbps": num(dispatch_gbps),
        "combine_gbps": num(combine_gbps),
        "torch_dispatch_us": torch.map_or(Value::Null, |t| num(t.0)),
        "torch_combine_us": torch.map_or(Value::Null, |t| num(t.1)),
        "device": device,
    });
    if let Value::Object(m) = &mut row {
        m.extend(extra);
    }
    row
}

/// Rows as a pretty-printed JSON list.
pub fn rows_json(rows: &[Value]) -> String {
    let mut s = serde_json::to_string_pretty(rows).unwrap_or_else(|_| "[]".into());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::programs::Gemm3;
    use crate::stats::{Timing, VariantResult};
    use crate::torch::TorchCase;

    fn variant(name: &str, us: f64) -> VariantResult {
        VariantResult {
            name: name.into(),
            timing: Timing::from_times(&[vec![us]]),
            ratio_to_bound: us / 10.0,
            sampled_rel_err: 0.0,
            host_us: None,
            failure: None,
        }
    }

    #[test]
    fn schedule_rows_have_the_documented_keys() {
        let t = Timing::from_times(&[vec![10.0]]);
        let c = CaseResult {
            bench: "rsmm",
            shape: Gemm3 { m: 8, k: 4, n: 2 },
            dtype: "bf16",
            world: 2,
            device: "GPU".into(),
            profile: None,
            comm_name: "reduce_scatter",
            comm: t.clone(),
            gemm: t,
            bound_us: 10.0,
            parts: vec![],
            torch: Some(TorchCase {
                async_tp_us: Some(20.0),
                ..TorchCase::default()
            }),
            variants: vec![
                variant("ring (copy engine)", 11.0),
                variant("default: ring_forward", 12.0),
                variant("failed", f64::NAN),
            ],
        };
        let rows = schedule_rows(&[c], 2);
        assert_eq!(rows.len(), 3);
        let keys: Vec<&str> = rows[0]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        for k in [
            "case",
            "world",
            "variant",
            "procs",
            "default",
            "us",
            "bound_us",
            "torch_async_tp_us",
            "device",
        ] {
            assert!(keys.contains(&k), "{k} in {keys:?}");
        }
        assert_eq!(rows[0]["case"], "rsmm_8x4x2");
        assert_eq!(rows[0]["procs"], 2);
        assert_eq!(rows[0]["default"], false);
        assert_eq!(rows[1]["default"], true);
        assert_eq!(rows[1]["us"], 12.0);
        assert_eq!(rows[1]["torch_async_tp_us"], 20.0);
        assert!(rows[2]["us"].is_null());
        let back: Value = serde_json::from_str(&rows_json(&rows)).unwrap();
        assert_eq!(back.as_array().unwrap().len(), 3);
    }

    #[test]
    fn moe_rows_have_the_documented_keys() {
        let mut extra = Map::new();
        extra.insert("wire".into(), json!("native"));
        let r = moe_row(
            "evaluator",
            "nvlink",
            "bf16",
            2,
            128,
            (30.0, f64::NAN),
            (100.0, 0.0),
            None,
            "GPU",
            extra,
        );
        assert_eq!(r["path"], "evaluator");
        assert_eq!(r["dispatch_us"], 30.0);
        assert!(r["combine_us"].is_null() && r["torch_dispatch_us"].is_null());
        assert_eq!(r["wire"], "native");
        assert_eq!(r.as_object().unwrap().len(), 13);
    }
}
