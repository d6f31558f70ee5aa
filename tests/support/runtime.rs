//! Helpers shared by the runtime integration tests.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use meshflow::ir::{parse_host, parse_program_with, HostProgram, Program};
use meshflow::runtime::data::TensorData;
use meshflow::runtime::{run_cpu, CpuConfig, CpuOptions, RunError, RunInputs, RunOutcome};

/// `tests/data/runtime/<name>`.
pub fn data_path(name: &str) -> PathBuf {
    super::root().join("tests/data/runtime").join(name)
}

/// Parses `tests/data/runtime/<name>` with integer parameters.
pub fn level1(name: &str, params: &[(&str, i64)]) -> Program {
    let text = std::fs::read_to_string(data_path(name)).expect("test data file exists");
    let params: BTreeMap<String, i64> = params.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    parse_program_with(&text, &params).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Parses host text after replacing every `$key` by its value (longest keys first).
pub fn host(template: &str, vars: &[(&str, i64)]) -> HostProgram {
    let mut vars = vars.to_vec();
    vars.sort_by_key(|(k, _)| std::cmp::Reverse(k.len()));
    let mut text = template.to_string();
    for (k, v) in vars {
        text = text.replace(&format!("${k}"), &v.to_string());
    }
    parse_host(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// Options with a short timeout (tests) and race checking on.
pub fn options() -> CpuOptions {
    CpuOptions {
        ranks: None,
        config: CpuConfig {
            timeout: Duration::from_secs(2),
            ..CpuConfig::default()
        },
        trace: false,
    }
}

/// Runs `host` on CPU ranks with the full (unsharded) `inputs` of `program`.
pub fn run_full(
    host: &HostProgram,
    program: &Program,
    inputs: &BTreeMap<String, TensorData>,
    options: &CpuOptions,
) -> Result<RunOutcome, RunError> {
    run_cpu(host, RunInputs::Full { program, inputs }, options)
}

/// `iota(d)` as mesh text.
pub fn iota(d: i64) -> String {
    let v: Vec<String> = (0..d).map(|i| i.to_string()).collect();
    format!("[{}]", v.join(", "))
}

/// Ring all-gather + linear on worker streams (what the lowering emits for `ring_linear.mf`).
pub fn ring_host(d: i64) -> HostProgram {
    gathered_linear_host(
        d,
        GatheredLinear {
            name: "ring_linear",
            dtype: "bf16",
            allocate_y: true,
            chunk: "(i0 + my(m0, DIDx)) % $d",
            gather: "collective_permute(x -> ag_chunk, team=slice(m0, DIDx), \
                     send=($d + my(m0, DIDx) - i0) % $d, recv=(i0 + my(m0, DIDx)) % $d)",
        },
    )
}

/// Stream-broadcast all-gather + linear (`broadcast_linear.mf`).
pub fn broadcast_host(d: i64) -> HostProgram {
    gathered_linear_host(
        d,
        GatheredLinear {
            name: "broadcast_linear",
            dtype: "f32",
            allocate_y: false,
            chunk: "i0",
            gather: "broadcast(x -> ag_chunk, team=slice(m0, DIDx), root=i0)",
        },
    )
}

/// What differs between [`ring_host`] and [`broadcast_host`].
struct GatheredLinear {
    name: &'static str,
    dtype: &'static str,
    /// Whether `y` is allocated explicitly at the start.
    allocate_y: bool,
    /// The index of the chunk worker stream `i0` gathers and multiplies.
    chunk: &'static str,
    /// The communication that fills `ag_chunk` (waited on as `c0`).
    gather: &'static str,
}

/// `x[16, 32]` of every rank gathered into `ag` chunk by chunk, each on worker stream `i0`,
/// and each gathered chunk multiplied by `w` into the matching rows of `y`.
fn gathered_linear_host(d: i64, g: GatheredLinear) -> HostProgram {
    let t = r#"
host $NAME {
  mesh m0 = $MESH
  in x: $DT[16, 32] on m0
  in w: $DT[12, 32] on m0
  out y: $DT[$rows, 12] on m0
  tensor ag: $DT[$rows, 32] on m0
  tensor ag_chunk: $DT[16, 32] on m0
  tensor y_chunk: $DT[16, 12] on m0
$ALLOCATE_Y  allocate ag
  s0 = get_current_stream
  for i0 in 0..$d {
    set_current_stream worker(i0)
    synchronize s0
    ag_chunk = shard_by_stream(ag, axis=0, chunks=$d, index=$CHUNK)
    c0 = $GATHER
    wait c0
    y_chunk = shard_by_stream(y, axis=0, chunks=$d, index=$CHUNK)
    linear(ag_chunk, w -> y_chunk)
  }
  set_current_stream s0
  for i1 in 0..$d {
    synchronize worker(i1)
  }
  deallocate ag
}
"#;
    let text = t
        .replace("$NAME", g.name)
        .replace("$MESH", &iota(d))
        .replace("$DT", g.dtype)
        .replace(
            "$ALLOCATE_Y",
            if g.allocate_y { "  allocate y\n" } else { "" },
        )
        .replace("$CHUNK", g.chunk)
        .replace("$GATHER", g.gather);
    host(&text, &[("d", d), ("rows", 16 * d)])
}

/// Chunked row-parallel linear: per chunk a partial GEMM and an all-reduce.
pub fn row_parallel_host(d: i64, s: i64) -> HostProgram {
    let t = r#"
host row_parallel_chunked {
  mesh m0 = $MESH
  in x: f32[$rows, 16] on m0
  in w: f32[24, 16] on m0
  out z: f32[$rows, 24] on m0
  tensor x_chunk: f32[8, 16] on m0
  tensor y: f32[$rows, 24] on m0
  tensor y_chunk: f32[8, 24] on m0
  tensor z_chunk: f32[8, 24] on m0
  allocate y
  s0 = get_current_stream
  for i0 in 0..$s {
    set_current_stream worker(i0)
    synchronize s0
    x_chunk = shard_by_stream(x, axis=0, chunks=$s, index=i0)
    y_chunk = shard_by_stream(y, axis=0, chunks=$s, index=i0)
    linear(x_chunk, w -> y_chunk)
    z_chunk = shard_by_stream(z, axis=0, chunks=$s, index=i0)
    c0 = all_reduce(y_chunk -> z_chunk, team=slice(m0, DIDx), op=sum)
    wait c0
  }
  set_current_stream s0
  for i1 in 0..$s {
    synchronize worker(i1)
  }
  deallocate y
}
"#;
    host(&t.replace("$MESH", &iota(d)), &[("s", s), ("rows", 8 * s)])
}

/// The MoE layer: dispatch, grouped GEMM, combine (`moe_layer.mf`).
pub fn moe_host(d: i64, t: i64, e: i64, k: i64, h: i64, f: i64) -> HostProgram {
    moe_host_cap(d, t, e, k, h, f, t * d)
}

/// [`moe_host`] with an explicit expert capacity.
pub fn moe_host_cap(d: i64, t: i64, e: i64, k: i64, h: i64, f: i64, cap: i64) -> HostProgram {
    let tpl = r#"
host moe_layer {
  mesh m0 = $MESH
  in x: f32[$t, $h] on m0
  in topk_idx: i32[$t, $k] on m0
  in topk_weights: f32[$t, $k] on m0
  in w_experts: f32[$e, $h, $f] on m0
  out y: f32[$t, $f] on m0
  out expert_x: f32[$e, $cap, $h] on m0
  out expert_counts: i32[$e] on m0
  out routing: i32[$e, $cap, 2] on m0
  tensor expert_y: f32[$e, $cap, $f] on m0
  c0 = moe_dispatch(x, topk_idx -> expert_x, expert_counts, routing, team=slice(m0, DIDx))
  wait c0
  allocate expert_y
  grouped_matmul(expert_x, expert_counts, w_experts -> expert_y)
  c1 = moe_combine(expert_y, expert_counts, routing, topk_weights -> y, team=slice(m0, DIDx))
  wait c1
  deallocate expert_y
}
"#;
    host(
        &tpl.replace("$MESH", &iota(d)),
        &[
            ("t", t),
            ("e", e),
            ("k", k),
            ("h", h),
            ("f", f),
            ("cap", cap),
        ],
    )
}
