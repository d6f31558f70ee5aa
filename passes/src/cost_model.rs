//! The cost model of `choose_decompositions`: the alpha-beta formulas of
//! `reference/overlap-and-egg.md` §3.2.
//!
//! For an all-gather of `S` bytes over a team of `d` feeding a compute op that takes `C` µs
//! unsplit, cut into `s` chunks:
//!
//! | variant | cost |
//! |---|---|
//! | collective | `λ + (d-1)/d · S/B + C` |
//! | ring (collective permute), overlapped | `c + (s-1) · max(c', m)` |
//! | stream broadcast, overlapped | `m + (s-1) · max(c', m) + c` |
//! | ring / broadcast without a consumer in the loop | `(s-1)·m + C` / `s·m + C` |
//!
//! plus `s · loop_step` of host overhead for the decomposed variants,
//! with `m = λ + (S/s)/B` per chunk, `c` the compute time of one chunk (its own launch
//! overhead included) and `c' = c / (1 - κ)` the compute slowed by the transport's use of
//! SMs. `λ`, `B` and `κ` come from the transport table below; compute time is
//! `launch + max(flops / P, bytes / HBM)`.
//!
//! The transport rows are calibrated on 2× H200 (NV18) with `meshflow bench permute` (a ring
//! permute of 64 and 256 MiB per rank, many steps back to back; `λ` and `B` from the line
//! through the two sizes) and `κ` from the GEMM of the ring's first chunk next to the transfer
//! of the second (bench results of 2026-11-22, `bench/results/`). The compute constants are
//! rough H200 figures (a bf16 GEMM of 8192³ runs at about 800 TFLOP/s alone).

use meshflow_ir::DType;

pub use crate::transport::Transport;

/// Alpha-beta parameters of a transport.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct TransportParams {
    /// Per-message latency `λ` in µs.
    pub latency_us: f64,
    /// Bandwidth `B` in GB/s (per direction).
    pub bandwidth_gb_s: f64,
    /// Fraction `κ` of compute throughput lost while the transport runs.
    pub sm_contention: f64,
}

/// The transport table, measured on 2× H200 (NVLink 4, NV18) on 2026-11-22: NCCL grouped
/// send/recv moves 64 MiB in 254 µs and 256 MiB in 899 µs per rank (both directions at once,
/// steps back to back); a copy-engine pull 64 MiB in 212 µs and 256 MiB in 719 µs. Next to a
/// cuBLAS GEMM, an NCCL kernel slows the GEMM by about a fifth (and is itself starved of SMs:
/// 630 µs instead of 295 for 64 MiB); a copy-engine pull slows it by about an eighth (its HBM
/// traffic) and leaves the SMs alone.
pub const TRANSPORTS: [(Transport, TransportParams); 2] = [
    (
        Transport::Nccl,
        TransportParams {
            latency_us: 39.0,
            bandwidth_gb_s: 312.0,
            sm_contention: 0.2,
        },
    ),
    (
        Transport::CopyEngine,
        TransportParams {
            latency_us: 43.0,
            bandwidth_gb_s: 398.0,
            sm_contention: 0.12,
        },
    ),
];

/// Compute and transport constants.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// The transport decomposed communications use (the GPU runtime uses the same one when a
    /// program is compiled with it, see `CudaConfig::transport` in the root crate).
    pub transport: Transport,
    /// Dense GEMM throughput for 16-bit types, TFLOP/s.
    pub gemm_tflops_16bit: f64,
    /// Dense GEMM throughput for f32 and integers, TFLOP/s.
    pub gemm_tflops_32bit: f64,
    /// Memory bandwidth, GB/s.
    pub hbm_gb_s: f64,
    /// Launch overhead of one compute op, µs.
    pub launch_us: f64,
    /// Host overhead of one stream-loop iteration (stream switch, event, views), µs.
    pub loop_step_us: f64,
}

impl Default for CostModel {
    fn default() -> CostModel {
        CostModel {
            transport: Transport::Nccl,
            gemm_tflops_16bit: 800.0,
            gemm_tflops_32bit: 50.0,
            hbm_gb_s: 4000.0,
            launch_us: 5.0,
            loop_step_us: 1.0,
        }
    }
}

/// An all-gather feeding a compute op, as the cost model sees it.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct GatherCase {
    /// Team size `d`.
    pub team: u64,
    /// Bytes of the gathered tensor on one device (`S`).
    pub gathered_bytes: f64,
    /// FLOPs of the consumer on one device.
    pub consumer_flops: f64,
    /// Bytes the consumer reads and writes on one device.
    pub consumer_bytes: f64,
    /// Element type of the consumer.
    pub dtype: DType,
    /// True when the consumer can run in the same stream loop as the chunks arrive.
    pub overlappable: bool,
}

impl CostModel {
    /// The parameters of the configured transport (transports without a row of their own,
    /// the host proxy and NVLink, are priced as NCCL: the decompositions this model chooses
    /// between move their bytes over NCCL or the copy engine).
    pub fn params(&self) -> TransportParams {
        TRANSPORTS
            .iter()
            .find(|(t, _)| *t == self.transport)
            .map_or(TRANSPORTS[0].1, |(_, p)| *p)
    }

    /// Time of a compute op doing `flops` and touching `bytes`, µs.
    pub fn compute_us(&self, flops: f64, bytes: f64, dtype: DType) -> f64 {
        let tflops = match dtype {
            DType::BF16 | DType::F16 => self.gemm_tflops_16bit,
            _ => self.gemm_tflops_32bit,
        };
        self.launch_us + (flops / (tflops * 1e6)).max(bytes / (self.hbm_gb_s * 1e3))
    }

    /// Time of one message of `bytes`, µs.
    pub fn message_us(&self, bytes: f64) -> f64 {
        let p = self.params();
        p.latency_us + bytes / (p.bandwidth_gb_s * 1e3)
    }

    /// One collective all-gather, then the consumer.
    pub fn collective(&self, g: &GatherCase) -> f64 {
        let d = g.team.max(1) as f64;
        let p = self.params();
        let ag = p.latency_us + (d - 1.0) / d * g.gathered_bytes / (p.bandwidth_gb_s * 1e3);
        ag + self.compute_us(g.consumer_flops, g.consumer_bytes, g.dtype)
    }

    fn chunked(&self, g: &GatherCase, s: u64, first_step_transfers: bool) -> f64 {
        let s = s.max(1) as f64;
        let m = self.message_us(g.gathered_bytes / s);
        let whole = self.compute_us(g.consumer_flops, g.consumer_bytes, g.dtype);
        if !g.overlappable {
            let steps = if first_step_transfers { s } else { s - 1.0 };
            return steps * m + whole + s * self.loop_step_us;
        }
        let c = self.compute_us(g.consumer_flops / s, g.consumer_bytes / s, g.dtype);
        let slowed = c / (1.0 - self.params().sm_contention).max(0.05);
        let head = if first_step_transfers { m } else { 0.0 };
        head + c + (s - 1.0) * slowed.max(m) + s * self.loop_step_us
    }

    /// A ring of `s` collective permutes (step 0 is a local copy).
    pub fn ring(&self, g: &GatherCase, s: u64) -> f64 {
        self.chunked(g, s, false)
    }

    /// `s` broadcasts rooted at the loop index.
    pub fn stream_broadcast(&self, g: &GatherCase, s: u64) -> f64 {
        self.chunked(g, s, true)
    }
}
