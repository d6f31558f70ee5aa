//! The fused NVLink MoE kernels (`moe_fused.cu`): which kernel generation an NVLink engine
//! runs, the chunking both ranks agree on, and the launch code.
//!
//! - [`MoeKernels::Split`]: two kernels per phase (send, then receive after one all-rank flag),
//!   positions packed by atomics.
//! - [`MoeKernels::Fused`] (default): one kernel per phase. Token `t` lies in slot `t` of every
//!   receiver; tokens form chunks ([`fused_chunk`]) released one by one (the dispatch with a
//!   flag per token, so its chunk is a rank's own choice; the combine with a flag per chunk, the
//!   same on every rank), so a receiver fans out
//!   (dispatch) or sums (combine) chunk `c` while its peers still send later chunks. The fused
//!   dispatch runs in `dispatch_send` (`dispatch_recv` only zeroes padding), the fused combine
//!   in `combine_recv` (`combine_send` only moves late weights and records `expert_y`).
//!
//! `MESHFLOW_MOE_KERNELS=v1|split|v2|fused` picks the generation when an engine is made;
//! `MESHFLOW_MOE_CHUNK` (tokens per chunk; per phase `MESHFLOW_MOE_DISPATCH_CHUNK` /
//! `MESHFLOW_MOE_COMBINE_CHUNK`; the combine's must be the same on every rank) and `MESHFLOW_MOE_LAG`
//! (chunks between a chunk's producers and its consumers in the work order; local) tune the
//! fused kernels.
//!
//! Variants of the fused kernels ([`FusedOptions`], local to a rank, chosen when an engine is
//! made; results are bit-identical whichever runs):
//! - `MESHFLOW_MOE_FUSED_DISPATCH=auto|wire|generic|warp`: `auto` (default) runs the warp
//!   kernel for the native wire and the per-format kernel for FP8 (each the fastest measured
//!   for its wire on 2x H200, `bench/results/2026-11-26-h200x2.md`), but on an H100 the
//!   per-format kernel for the native wire too from [`H100_BLOCK_DISPATCH_FROM_TOKENS`] tokens
//!   per rank (the faster there, `bench/results/2026-11-26-h100x2.md`); `wire`: one dispatch
//!   kernel per wire format (no register spills); `generic`: the single kernel taking the
//!   format as an argument (spills at the 128-register bound); `warp`: the warp kernels
//!   (`moe_fused_warp.cu`, one per wire format): every warp of small blocks takes its own
//!   items, with no block-wide barrier per token, and loads the first part of a row before its
//!   routing round trips.
//! - `MESHFLOW_MOE_FUSED_COMBINE=auto|onepass|twopass|warp`: the combine's consumer computes
//!   this rank's own partials and sums in one pass (`onepass`: one write of `out` instead of
//!   two writes and a read, after waiting for the peers), or stores its own partials into
//!   `out` while the peers' arrive, then sums (`twopass`). `auto` (default) runs `twopass`
//!   below 512 tokens per rank and `onepass` from there, each the faster at the sizes measured
//!   on 2x H200 (`bench/results/2026-11-26-h200x2.md`, same runs: 4096 tokens 252.0 against
//!   260.3 µs, 2048 tokens 168.0 against 172.6 µs, 128 tokens 29.2 against 25.7 µs; the
//!   threshold lies between 128 and 2048, at their geometric mean); `warp`: the warp kernel (`moe_fused_warp_combine.cu`): every warp of
//!   small blocks takes its own items, reads a token's fan and weights once (one token ahead)
//!   and keeps the vectors of up to 4 expert rows in flight per lane; its consumer is one-pass.
//!   One warp per 14 KB row has too few loads in flight: 392 µs at 4096 tokens (257 µs with
//!   one token per chunk) and 61.5 µs at 128 tokens, against 25.9 µs for the block kernel.
//! - `MESHFLOW_MOE_COMBINE_BLOCK=auto|<shape>[p]` ([`CombineBlock`]): the block shape of the
//!   block combine kernels (`twopass`, `onepass`, and `auto`'s choice of them; the warp combine
//!   ignores it). `auto` (default, [`FusedOptions::block_for`]) runs the one-pass kernel in
//!   `128x8n1` and the two-pass kernel in `256x2`: on 2x H200 with one token per chunk the
//!   one-pass `128x8n1` measured 222.5 / 223.2 µs at 4096 tokens per rank (`256x2` with its
//!   best chunk of 4: 254.5-255.0 µs in the same call) and 135.0 µs at 2048 tokens (`256x2`:
//!   168-170 µs), while the two-pass `128x8n1` spills and measured 31.3 µs at 128 tokens
//!   (`256x2`: 25.5-26.1 µs). More blocks per SM won at the large sizes: `448x2n1` 248.6,
//!   `224x4n1` 237.3 (chunks of 2) and the one-block-per-SM shapes 289-299 µs at 4096 tokens
//!   (`bench/results/2026-11-26-h200x2.md`). A shape is threads per block x blocks per SM, each thread taking 2 16-byte
//!   vectors of a row per round, or 1 (`n1`); the grid keeps every block resident. A 7168-wide
//!   bf16 row is 896 vectors:
//!   - `256x2` (the two-pass default, the kernels before shapes): 256 threads, 2 blocks per SM (16 warps),
//!     2 vectors: two rounds per row, the second with 384 of its 512 slots busy.
//!   - `448x1`: 448 threads, 1 block per SM (14 warps), 2 vectors: one round per row.
//!   - `448x2n1`: 448 threads, 2 blocks per SM (28 warps, at most 72 registers), 1 vector: two
//!     full rounds per row.
//!   - `896x1n1`: 896 threads, 1 block per SM (28 warps, at most 72 registers), 1 vector: one
//!     round per row.
//!   - `512x1`: 512 threads, 1 block per SM (16 warps), 2 vectors: one round per row, 128 slots
//!     idle.
//!   - `224x4n1`: 224 threads, 4 blocks per SM (28 warps, at most 72 registers), 1 vector: four
//!     full rounds per row, four tokens in flight per SM.
//!   - `128x8n1`: 128 threads, 8 blocks per SM (32 warps, at most 64 registers), 1 vector: seven
//!     full rounds per row, eight tokens in flight per SM.
//!
//!   (`scripts/nvrtc-check.py --verbose`: no 72-register shape spills in bf16 or f32; the f16
//!   one-pass kernels of the 72-register `n1` shapes spill 16 bytes; at the 64-register bound
//!   of `128x8n1` the one-pass kernels do not spill, its two-pass kernels spill 44 bytes in
//!   bf16 and f16, 68 in f32.) A final `p`
//!   (`256x2p`, `448x1p`, `512x1p`; not for the `n1` shapes, whose one-pass kernel then
//!   spilled at 72 registers) makes the loops over a chunk's tokens read the next token's
//!   fan row and weights (producers and the two-pass consumer also its slot's token field)
//!   before they reduce this token's expert rows, overlapping that dependent round trip with
//!   this token's loads. Each shape (and `p`) is a kernel of its own with its launch bounds,
//!   compiled only when chosen; the producers (partials into the peers) and the consumer run
//!   the same shape. Results are bit-identical in every shape: each element is summed alone, in
//!   k order, then rank order, whichever thread holds it.

use super::combine_block::{CombineBlock, CombineShape};
use super::kernel_calls::{n, ptr, FlagWait, PeerRegions, SendInputs, SendState, NULL};
use super::{MoeShape, MoeWire, WireLayout};
use crate::buffer::DeviceBuffer;
use crate::error::{KernelError, Result};
use crate::fp8::Fp8Scales;
use crate::kernels::{moe_typed_name, Arg, Kernels, Source};
use crate::stream::Stream;

/// Threads per block of the fused kernels (their `ROW_KERNEL` launch bounds).
const FUSED_BLOCK: u32 = 256;

/// Threads per block of the warp kernels (dispatch and combine; their `WARP_KERNEL` launch
/// bounds: `WARP_THREADS` in `moe_fused_warp.cu`, at most 8 blocks per SM).
const FUSED_WARP_BLOCK: u32 = 64;

/// The environment variable choosing the kernel generation.
pub const MOE_KERNELS_ENV: &str = "MESHFLOW_MOE_KERNELS";

/// Which NVLink kernels an engine runs (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeKernels {
    /// Send and receive kernels per phase, one all-rank flag between them.
    Split,
    /// One kernel per phase, per-chunk release flags.
    Fused,
}

impl MoeKernels {
    /// The generation named by `MESHFLOW_MOE_KERNELS` (default [`MoeKernels::Fused`]).
    pub fn from_env() -> Result<MoeKernels> {
        match std::env::var(MOE_KERNELS_ENV) {
            Err(_) => Ok(MoeKernels::Fused),
            Ok(v) => MoeKernels::parse(&v),
        }
    }

    /// Parses `v1`/`split` or `v2`/`fused`.
    pub fn parse(v: &str) -> Result<MoeKernels> {
        match v.trim() {
            "v1" | "split" => Ok(MoeKernels::Split),
            "v2" | "fused" | "" => Ok(MoeKernels::Fused),
            other => Err(KernelError::InvalidArgument(format!(
                "{MOE_KERNELS_ENV}={other}: expected v1 (split) or v2 (fused)"
            ))),
        }
    }

    /// `v1` or `v2`, for reports.
    pub fn name(self) -> &'static str {
        match self {
            MoeKernels::Split => "v1",
            MoeKernels::Fused => "v2",
        }
    }
}

/// A positive integer from the environment variable `var`, if set.
fn env_count(var: &str) -> Result<Option<usize>> {
    match std::env::var(var) {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(KernelError::InvalidArgument(format!(
                "{var}={v}: expected a positive integer"
            ))),
        },
    }
}

/// Which dispatch kernel the fused generation runs (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedDispatchKernel {
    /// `moe_nvl_dispatch_fused_<T>`: the wire format is an argument.
    Generic,
    /// `moe_nvl_dispatch_fused_{native,fp8t,fp8b}_<T>`: one kernel per wire format.
    PerWire,
    /// `moe_nvl_dispatch_fused_warp_{native,fp8t,fp8b}_<T>`: a warp per item.
    Warp,
    /// [`Warp`](FusedDispatchKernel::Warp) for the native wire, [`PerWire`](FusedDispatchKernel::PerWire)
    /// for FP8 (the warp kernel's FP8 dispatch was 2x slower at 128 tokens); on an H100
    /// ([`DispatchGpu::H100`]) `PerWire` for the native wire too from
    /// [`H100_BLOCK_DISPATCH_FROM_TOKENS`] tokens per rank.
    Auto,
}

/// Tokens per rank from which [`FusedDispatchKernel::Auto`] runs the per-wire (block) kernel
/// for the native wire on an H100, with two tokens per chunk ([`dispatch_default_chunk`]). On
/// 2x H100 (`bench/results/2026-11-26-h100x2.md`, seventh session) it measured 254.9-255.0
/// against 272.0-272.1 µs for the warp kernel at 4096 tokens per rank and 140.0-141.2 against
/// 151.1-151.8 µs at 2048 (one call), and, in an earlier call with a flag per chunk, 81.6
/// against 82.7 µs at 1024; at 128 the warp kernel was faster through the evaluator (29.2
/// against 30.2 µs). On 2x H200 the warp kernel is the faster at every size measured (225
/// against 249 µs for the block kernel at its best chunk, at 4096 tokens).
pub const H100_BLOCK_DISPATCH_FROM_TOKENS: usize = 1024;

/// The GPU [`FusedDispatchKernel::Auto`] chooses for: the kernels' speeds were measured to
/// rank differently on the two GPUs measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchGpu {
    /// An H100 (a device name containing `H100`).
    H100,
    /// Any other GPU (the choices measured on H200).
    Other,
}

impl DispatchGpu {
    /// The class of the device named `name` (as CUDA reports it, e.g. `NVIDIA H100 80GB HBM3`).
    pub fn of_name(name: &str) -> DispatchGpu {
        if name.contains("H100") {
            DispatchGpu::H100
        } else {
            DispatchGpu::Other
        }
    }
}

impl FusedDispatchKernel {
    /// The kernel that runs for `wire` at `tokens` tokens per rank on `gpu` (resolves
    /// [`Auto`](FusedDispatchKernel::Auto)).
    pub fn resolve(self, wire: MoeWire, tokens: usize, gpu: DispatchGpu) -> FusedDispatchKernel {
        match (self, wire) {
            (FusedDispatchKernel::Auto, MoeWire::Native)
                if gpu == DispatchGpu::H100 && tokens >= H100_BLOCK_DISPATCH_FROM_TOKENS =>
            {
                FusedDispatchKernel::PerWire
            }
            (FusedDispatchKernel::Auto, MoeWire::Native) => FusedDispatchKernel::Warp,
            (FusedDispatchKernel::Auto, MoeWire::Fp8E4m3(_)) => FusedDispatchKernel::PerWire,
            (k, _) => k,
        }
    }

    /// Threads per block and the most blocks per SM the kernel is launched with
    /// ([`Auto`](FusedDispatchKernel::Auto): as for the native wire at few tokens).
    fn block(self) -> (u32, usize) {
        match self.resolve(MoeWire::Native, 1, DispatchGpu::Other) {
            FusedDispatchKernel::Warp => (FUSED_WARP_BLOCK, 8),
            _ => (FUSED_BLOCK, 2),
        }
    }
}

/// Which combine kernel the fused generation runs (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedCombineKernel {
    /// `moe_nvl_combine_fused_<T>`: own partials through `out`, then the sum.
    TwoPass,
    /// `moe_nvl_combine_fused_onepass_<T>`: own partial and sum in one pass per token.
    OnePass,
    /// `moe_nvl_combine_fused_warp_<T>`: a warp per item, one-pass consumer.
    Warp,
    /// [`TwoPass`](FusedCombineKernel::TwoPass) below [`ONEPASS_FROM_TOKENS`] tokens per rank,
    /// [`OnePass`](FusedCombineKernel::OnePass) from there (each the faster measured at its
    /// size on 2x H200, see the module docs).
    Auto,
}

/// Tokens per rank from which [`FusedCombineKernel::Auto`] runs the one-pass combine.
pub const ONEPASS_FROM_TOKENS: usize = 512;

impl FusedCombineKernel {
    /// The kernel that runs for `tokens` tokens per rank (resolves
    /// [`Auto`](FusedCombineKernel::Auto)).
    pub fn for_tokens(self, tokens: usize) -> FusedCombineKernel {
        match self {
            FusedCombineKernel::Auto if tokens >= ONEPASS_FROM_TOKENS => {
                FusedCombineKernel::OnePass
            }
            FusedCombineKernel::Auto => FusedCombineKernel::TwoPass,
            k => k,
        }
    }

    /// Threads per block and the most blocks per SM the kernel is launched with, the block
    /// kernels in the shape `block`.
    fn block(self, block: CombineBlock) -> (u32, usize) {
        match self {
            FusedCombineKernel::Warp => (FUSED_WARP_BLOCK, 8),
            FusedCombineKernel::TwoPass
            | FusedCombineKernel::OnePass
            | FusedCombineKernel::Auto => block.launch(),
        }
    }

    /// Whether the kernel is a block combine (runs in a [`CombineBlock`] shape).
    pub fn is_block(self) -> bool {
        self != FusedCombineKernel::Warp
    }
}

/// The variants of the fused kernels an engine runs (each rank may choose its own: they
/// follow the same protocol and give the same results).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedOptions {
    /// The dispatch kernel.
    pub dispatch: FusedDispatchKernel,
    /// The combine kernel.
    pub combine: FusedCombineKernel,
    /// The block shape of the block combine kernels (two-pass, one-pass); the warp combine
    /// ignores it. `None` (default): [`FusedOptions::AUTO_ONEPASS_BLOCK`] for the one-pass
    /// kernel, [`CombineBlock::default`] for the two-pass one ([`FusedOptions::block_for`]).
    pub block: Option<CombineBlock>,
    /// The dispatch's tokens per chunk (a rank's own choice: the dispatch releases a flag per
    /// token). `None` (default): `MESHFLOW_MOE_DISPATCH_CHUNK`, else `MESHFLOW_MOE_CHUNK`, else
    /// [`dispatch_default_chunk`] ([`fused_chunk`]).
    pub dispatch_chunk: Option<usize>,
}

/// The environment variable choosing [`FusedOptions::dispatch`].
pub const FUSED_DISPATCH_ENV: &str = "MESHFLOW_MOE_FUSED_DISPATCH";
/// The environment variable choosing [`FusedOptions::combine`].
pub const FUSED_COMBINE_ENV: &str = "MESHFLOW_MOE_FUSED_COMBINE";

impl Default for FusedOptions {
    fn default() -> FusedOptions {
        FusedOptions {
            dispatch: FusedDispatchKernel::Auto,
            combine: FusedCombineKernel::Auto,
            block: None,
            dispatch_chunk: None,
        }
    }
}

impl FusedOptions {
    /// The one-pass combine's block shape unless one is chosen: `128x8n1`, with one token per
    /// chunk the fastest measured at 2048 and 4096 tokens per rank on 2x H200 (135.0 and
    /// 222.5 µs against 168-170 and 252-255 µs for `256x2`, chunks of 4 at 4096 tokens;
    /// `bench/results/2026-11-26-h200x2.md`). The two-pass kernel keeps `256x2`: at the
    /// 64-register bound of `128x8n1` it spills, and measured 31.3 against 25.8 µs at 128
    /// tokens.
    pub const AUTO_ONEPASS_BLOCK: CombineBlock = CombineBlock {
        shape: CombineShape::B128x8N1,
        prefetch: false,
    };

    /// The block shape the block combine `kernel` runs in (resolves `block: None`).
    pub fn block_for(self, kernel: FusedCombineKernel) -> CombineBlock {
        match (self.block, kernel) {
            (Some(b), _) => b,
            (None, FusedCombineKernel::OnePass) => FusedOptions::AUTO_ONEPASS_BLOCK,
            (None, _) => CombineBlock::default(),
        }
    }

    /// The dispatch kernels that differ ([`FusedDispatchKernel::Auto`] runs one of them).
    pub const DISPATCH_KERNELS: [FusedDispatchKernel; 3] = [
        FusedDispatchKernel::Generic,
        FusedDispatchKernel::PerWire,
        FusedDispatchKernel::Warp,
    ];

    /// The combine kernels that differ ([`FusedCombineKernel::Auto`] runs one of them).
    pub const COMBINE_KERNELS: [FusedCombineKernel; 3] = [
        FusedCombineKernel::TwoPass,
        FusedCombineKernel::OnePass,
        FusedCombineKernel::Warp,
    ];

    /// Every combination of kernels that differ: each dispatch kernel with each block combine
    /// in each [`CombineBlock`], and with the warp combine (which has no block shape), for
    /// tests (63 combinations).
    pub fn all() -> Vec<FusedOptions> {
        let mut v = Vec::new();
        for dispatch in FusedOptions::DISPATCH_KERNELS {
            for combine in FusedOptions::COMBINE_KERNELS {
                let blocks = if combine.is_block() {
                    CombineBlock::all()
                } else {
                    vec![CombineBlock::default()]
                };
                v.extend(blocks.into_iter().map(|block| FusedOptions {
                    dispatch,
                    combine,
                    block: Some(block),
                    dispatch_chunk: None,
                }));
            }
        }
        v
    }

    /// A few combinations that run every value of every option at least once: each dispatch
    /// kernel, each combine kernel, each block shape, with and without prefetch (the two-pass
    /// and the one-pass combine each with a one- and a two-vector shape and with and without
    /// prefetch), for tests that cannot afford [`FusedOptions::all`]. The default options run
    /// in the tests of the default engine.
    pub fn covering() -> Vec<FusedOptions> {
        use CombineShape::*;
        use FusedCombineKernel::{OnePass, TwoPass};
        use FusedDispatchKernel::{Generic, PerWire, Warp};
        let o = |dispatch, combine, shape, prefetch| FusedOptions {
            dispatch,
            combine,
            block: Some(CombineBlock { shape, prefetch }),
            dispatch_chunk: None,
        };
        vec![
            o(Generic, TwoPass, B256x2, false),
            o(PerWire, OnePass, B448x1, true),
            o(Warp, TwoPass, B448x2N1, false),
            o(Generic, OnePass, B896x1N1, false),
            o(PerWire, TwoPass, B512x1, true),
            o(Warp, FusedCombineKernel::Warp, B256x2, false),
            o(Generic, TwoPass, B224x4N1, false),
            o(Warp, OnePass, B128x8N1, false),
        ]
    }

    /// The options named by `MESHFLOW_MOE_FUSED_DISPATCH`, `MESHFLOW_MOE_FUSED_COMBINE` and
    /// `MESHFLOW_MOE_COMBINE_BLOCK` (unset: [`FusedOptions::default`]).
    pub fn from_env() -> Result<FusedOptions> {
        let mut o = FusedOptions::default();
        if let Ok(v) = std::env::var(FUSED_DISPATCH_ENV) {
            o.dispatch = FusedOptions::parse_dispatch(&v)?;
        }
        if let Ok(v) = std::env::var(FUSED_COMBINE_ENV) {
            o.combine = FusedOptions::parse_combine(&v)?;
        }
        o.block = CombineBlock::from_env()?;
        Ok(o)
    }

    /// Parses `auto`, `wire`, `generic` or `warp` (empty: the default, `auto`).
    pub fn parse_dispatch(v: &str) -> Result<FusedDispatchKernel> {
        match v.trim() {
            "auto" | "" => Ok(FusedDispatchKernel::Auto),
            "wire" => Ok(FusedDispatchKernel::PerWire),
            "generic" => Ok(FusedDispatchKernel::Generic),
            "warp" => Ok(FusedDispatchKernel::Warp),
            other => Err(KernelError::InvalidArgument(format!(
                "{FUSED_DISPATCH_ENV}={other}: expected wire, generic or warp"
            ))),
        }
    }

    /// Parses `auto`, `onepass`, `twopass` or `warp` (empty: the default, `auto`).
    pub fn parse_combine(v: &str) -> Result<FusedCombineKernel> {
        match v.trim() {
            "auto" | "" => Ok(FusedCombineKernel::Auto),
            "onepass" => Ok(FusedCombineKernel::OnePass),
            "twopass" => Ok(FusedCombineKernel::TwoPass),
            "warp" => Ok(FusedCombineKernel::Warp),
            other => Err(KernelError::InvalidArgument(format!(
                "{FUSED_COMBINE_ENV}={other}: expected auto, onepass, twopass or warp"
            ))),
        }
    }

    /// `dispatch[c<chunk>]-combine[-block]` names (`wire-twopass-256x2`, `warp-onepass-448x1p`,
    /// `wirec2-onepass-128x8n1`: two tokens per dispatch chunk, `generic-warp`: the warp
    /// combine has no block shape), for reports.
    pub fn name(self) -> String {
        let d = match self.dispatch {
            FusedDispatchKernel::Generic => "generic",
            FusedDispatchKernel::PerWire => "wire",
            FusedDispatchKernel::Warp => "warp",
            FusedDispatchKernel::Auto => "auto",
        };
        let c = match self.combine {
            FusedCombineKernel::TwoPass => "twopass",
            FusedCombineKernel::OnePass => "onepass",
            FusedCombineKernel::Warp => "warp",
            FusedCombineKernel::Auto => "auto",
        };
        let d = match self.dispatch_chunk {
            Some(n) => format!("{d}c{n}"),
            None => d.to_owned(),
        };
        if self.combine.is_block() {
            let b = self
                .block
                .map_or_else(|| "auto".to_owned(), CombineBlock::name);
            format!("{d}-{c}-{b}")
        } else {
            format!("{d}-{c}")
        }
    }

    /// The kind (`moe_<kind>_<dtype>`) of dispatch kernel `kernel` for `wire` (`Auto`: the
    /// generic kernel; callers resolve it first).
    fn dispatch_kind(kernel: FusedDispatchKernel, wire: MoeWire) -> &'static str {
        match (kernel, wire) {
            (FusedDispatchKernel::Generic | FusedDispatchKernel::Auto, _) => "nvl_dispatch_fused",
            (FusedDispatchKernel::PerWire, MoeWire::Native) => "nvl_dispatch_fused_native",
            (FusedDispatchKernel::PerWire, MoeWire::Fp8E4m3(Fp8Scales::PerToken)) => {
                "nvl_dispatch_fused_fp8t"
            }
            (FusedDispatchKernel::PerWire, MoeWire::Fp8E4m3(Fp8Scales::Block128)) => {
                "nvl_dispatch_fused_fp8b"
            }
            (FusedDispatchKernel::Warp, MoeWire::Native) => "nvl_dispatch_fused_warp_native",
            (FusedDispatchKernel::Warp, MoeWire::Fp8E4m3(Fp8Scales::PerToken)) => {
                "nvl_dispatch_fused_warp_fp8t"
            }
            (FusedDispatchKernel::Warp, MoeWire::Fp8E4m3(Fp8Scales::Block128)) => {
                "nvl_dispatch_fused_warp_fp8b"
            }
        }
    }

    /// The combine kernel's kind at `tokens` tokens per rank (a block combine's in its shape).
    fn combine_kind(self, tokens: usize) -> String {
        let kernel = self.combine.for_tokens(tokens);
        let suffix = self.block_for(kernel).kind_suffix();
        match kernel {
            FusedCombineKernel::TwoPass | FusedCombineKernel::Auto => {
                format!("nvl_combine_fused{suffix}")
            }
            FusedCombineKernel::OnePass => format!("nvl_combine_fused_onepass{suffix}"),
            FusedCombineKernel::Warp => "nvl_combine_fused_warp".to_owned(),
        }
    }

    /// Threads per block and the most blocks per SM of the combine kernel at `tokens` tokens
    /// per rank.
    fn combine_launch(self, tokens: usize) -> (u32, usize) {
        let kernel = self.combine.for_tokens(tokens);
        kernel.block(self.block_for(kernel))
    }
}

/// The phase a fused kernel runs (each has its own chunk size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedPhase {
    /// `moe_nvl_dispatch_fused`.
    Dispatch,
    /// `moe_nvl_combine_fused`.
    Combine,
}

impl FusedPhase {
    /// The environment variable overriding this phase's chunk (before `MESHFLOW_MOE_CHUNK`).
    pub fn chunk_env(self) -> &'static str {
        match self {
            FusedPhase::Dispatch => "MESHFLOW_MOE_DISPATCH_CHUNK",
            FusedPhase::Combine => "MESHFLOW_MOE_COMBINE_CHUNK",
        }
    }
}

/// The dispatch's default chunk for `kernel` (resolved) at `tokens` tokens per rank on `wire`:
/// one token, but two for the FP8 dispatch beyond 2048 tokens and for the block kernels'
/// native dispatch from [`H100_BLOCK_DISPATCH_FROM_TOKENS`]. On 2x H200 the warp kernel's
/// native dispatch measured 225 µs at 4096 tokens with one token per chunk against 254-258 µs
/// with two or four; on 2x H100 the per-wire block kernel's 251.6-252.5 µs with two against
/// 262.6 with one, 262.7 with three, 268.0 with four and 284.5 with eight (with a flag per
/// chunk, before the flags per token). The dispatch
/// releases one flag per token, so the chunk is a rank's own choice, like its kernel.
pub fn dispatch_default_chunk(kernel: FusedDispatchKernel, tokens: usize, wire: MoeWire) -> usize {
    match (kernel, wire) {
        (_, MoeWire::Fp8E4m3(_)) if tokens > 2048 => 2,
        (FusedDispatchKernel::PerWire | FusedDispatchKernel::Generic, MoeWire::Native)
            if tokens >= H100_BLOCK_DISPATCH_FROM_TOKENS =>
        {
            2
        }
        _ => 1,
    }
}

/// The combine's default chunk: one token. The default one-pass combine (`128x8n1`) measured
/// 222.5 µs at 4096 tokens per rank on 2x H200 with one token per chunk against 240.4 with two
/// and 292.2 with four (`256x2`, the shape before, was fastest with four). The combine
/// releases one flag per chunk, so the chunk depends on nothing a rank chooses alone: every
/// rank agrees.
pub const COMBINE_DEFAULT_CHUNK: usize = 1;

/// Tokens per chunk of the fused kernels of `phase`: the phase's variable
/// ([`FusedPhase::chunk_env`]), else `MESHFLOW_MOE_CHUNK` (both phases), else `default`
/// ([`dispatch_default_chunk`], [`COMBINE_DEFAULT_CHUNK`]). The combine's must be the same on
/// every rank (the environment and the shape decide it); the dispatch's may differ.
pub fn fused_chunk(phase: FusedPhase, default: usize) -> Result<usize> {
    Ok(match env_count(phase.chunk_env())? {
        Some(c) => c,
        None => env_count("MESHFLOW_MOE_CHUNK")?.unwrap_or(default),
    })
}

/// The grid and lag of a fused kernel with `items` work items, `per_chunk` of them per chunk,
/// run by blocks of `block` threads, at most `per_sm` of them per SM (all resident): one block
/// per item (one warp per item when `per_warp`: every warp takes its own items), and consumers
/// handed out about one grid of items after the producers of their chunk.
fn grid_and_lag(
    k: &Kernels,
    items: usize,
    per_chunk: usize,
    block: (u32, usize),
    per_warp: bool,
) -> Result<(u32, usize)> {
    let sms = k.device().sm_count() as usize;
    let lag = env_count("MESHFLOW_MOE_LAG")?;
    Ok(grid_and_lag_on(sms, items, per_chunk, block, per_warp, lag))
}

/// [`grid_and_lag`] on a device of `sms` SMs, `lag` the one asked for (else about one grid).
fn grid_and_lag_on(
    sms: usize,
    items: usize,
    per_chunk: usize,
    (block, per_sm): (u32, usize),
    per_warp: bool,
    lag: Option<usize>,
) -> (u32, usize) {
    let cap = (sms * per_sm).max(1);
    let workers_per_block = if per_warp { block as usize / 32 } else { 1 };
    let grid = items.div_ceil(workers_per_block).clamp(1, cap);
    let workers = grid * workers_per_block;
    let lag = lag.unwrap_or(workers.div_ceil(per_chunk.max(1)));
    (u32::try_from(grid).unwrap_or(1), lag)
}

/// What the fused dispatch writes besides [`SendState`]: the symmetric allocation of this rank
/// (its rows, counts and chunk flags) and the `[W]` i32 received-row counters.
pub(crate) struct FusedDispatch<'a> {
    pub sym: &'a DeviceBuffer,
    pub counts_off: usize,
    pub recv_cnt: &'a DeviceBuffer,
    pub expert_counts: &'a DeviceBuffer,
    pub timeout_ns: u64,
}

/// The fused NVLink dispatch (routing, sends, own and received fan-out, counts; `state` is the
/// engine's `[8]` u32 device state).
#[allow(clippy::too_many_arguments)]
pub(crate) fn nvl_dispatch_fused(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    wire: MoeWire,
    rank: usize,
    inp: &SendInputs<'_>,
    st: &SendState<'_>,
    peers: &PeerRegions<'_>,
    fused: &FusedDispatch<'_>,
    state: &DeviceBuffer,
    options: FusedOptions,
) -> Result<()> {
    let lay = WireLayout::of(shape, wire);
    let gpu = DispatchGpu::of_name(k.device().name());
    let kernel = options.dispatch.resolve(wire, shape.tokens, gpu);
    let default = dispatch_default_chunk(kernel, shape.tokens, wire);
    let chunk = match options.dispatch_chunk {
        Some(c) => c.max(1),
        None => fused_chunk(FusedPhase::Dispatch, default)?,
    };
    let chunks = shape.tokens.div_ceil(chunk);
    let block = kernel.block();
    let per_warp = kernel == FusedDispatchKernel::Warp;
    let (grid, lag) = grid_and_lag(k, chunks * shape.world, shape.world, block, per_warp)?;
    let mut args = [
        ptr(inp.x),
        ptr(inp.topk_idx),
        inp.weights.map_or(NULL, ptr),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.experts),
        n(shape.local_experts()),
        n(shape.world),
        n(rank),
        n(shape.hidden),
        Arg::U32(wire.code()),
        n(lay.stride),
        n(lay.scale_off),
        n(lay.meta_off),
        ptr(peers.peer_sym),
        n(peers.rows),
        n(peers.dispatch_token_flags),
        ptr(fused.sym),
        n(fused.counts_off),
        n(chunk),
        n(lag),
        Arg::U64(fused.timeout_ns),
        ptr(st.cnt),
        ptr(fused.recv_cnt),
        ptr(st.sent_pos),
        ptr(st.status),
        ptr(state),
        ptr(st.expert_x),
        ptr(st.routing),
        ptr(st.fan),
        ptr(st.ecnt),
        n(shape.capacity),
        ptr(fused.expert_counts),
    ];
    let name = moe_typed_name(FusedOptions::dispatch_kind(kernel, wire), shape.dtype);
    k.call(stream, Source::Moe, &name, grid, block.0, &mut args)
}

/// The inputs of a fused NVLink combine.
pub(crate) struct FusedCombine<'a> {
    /// This rank's symmetric allocation (rows, partials, chunk flags read locally).
    pub sym: &'a DeviceBuffer,
    pub expert_y: &'a DeviceBuffer,
    pub fan: &'a DeviceBuffer,
    pub sent_pos: &'a DeviceBuffer,
    pub out: &'a DeviceBuffer,
    /// The weights came with the combine (then they lie in the weight area after its flags).
    pub late: bool,
    pub status: &'a DeviceBuffer,
}

/// The fused NVLink combine: partials of received rows into their sources, own partials and
/// the rank-ordered sum into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nvl_combine_fused(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    wire: MoeWire,
    rank: usize,
    c: &FusedCombine<'_>,
    wait: &FlagWait<'_>,
    peers: &PeerRegions<'_>,
    options: FusedOptions,
) -> Result<()> {
    let lay = WireLayout::of(shape, wire);
    let chunk = fused_chunk(FusedPhase::Combine, COMBINE_DEFAULT_CHUNK)?;
    let chunks = shape.tokens.div_ceil(chunk);
    let block = options.combine_launch(shape.tokens);
    let per_warp = options.combine == FusedCombineKernel::Warp;
    let (grid, lag) = grid_and_lag(k, chunks * shape.world, shape.world, block, per_warp)?;
    let at = |off: usize| Arg::Ptr(c.sym.addr() + off as u64);
    let mut args = [
        ptr(wait.flags),
        ptr(wait.state),
        Arg::U64(wait.timeout_ns),
        at(peers.rows),
        at(peers.partials),
        at(peers.combine_chunks),
        n(rank),
        ptr(c.expert_y),
        ptr(c.fan),
        ptr(c.sent_pos),
        ptr(c.out),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.world),
        n(shape.out_hidden),
        n(lay.stride),
        n(lay.meta_off),
        Arg::U32(u32::from(c.late)),
        at(peers.weights),
        ptr(peers.peer_sym),
        n(peers.partials),
        n(peers.combine_chunks),
        n(chunk),
        n(lag),
        ptr(c.status),
    ];
    let name = moe_typed_name(&options.combine_kind(shape.tokens), shape.dtype);
    k.call(stream, Source::Moe, &name, grid, block.0, &mut args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_generations_parse() {
        assert_eq!(MoeKernels::parse("v1").unwrap(), MoeKernels::Split);
        assert_eq!(MoeKernels::parse("split").unwrap(), MoeKernels::Split);
        assert_eq!(MoeKernels::parse(" v2 ").unwrap(), MoeKernels::Fused);
        assert_eq!(MoeKernels::parse("fused").unwrap(), MoeKernels::Fused);
        assert!(MoeKernels::parse("v3").is_err());
        assert_eq!(MoeKernels::Split.name(), "v1");
    }

    #[test]
    fn fused_options_parse_and_name_their_kernels() {
        use FusedCombineKernel::{OnePass, TwoPass};
        use FusedDispatchKernel::{Auto, Generic, PerWire};
        assert_eq!(FusedOptions::parse_dispatch("wire").unwrap(), PerWire);
        assert_eq!(FusedOptions::parse_dispatch(" generic").unwrap(), Generic);
        assert_eq!(
            FusedOptions::parse_dispatch("warp").unwrap(),
            FusedDispatchKernel::Warp
        );
        assert!(FusedOptions::parse_dispatch("warps").is_err());
        assert_eq!(FusedOptions::parse_combine("onepass").unwrap(), OnePass);
        assert_eq!(
            FusedOptions::parse_combine(" warp").unwrap(),
            FusedCombineKernel::Warp
        );
        assert_eq!(FusedOptions::parse_combine("twopass").unwrap(), TwoPass);
        assert_eq!(
            FusedOptions::parse_combine("").unwrap(),
            FusedCombineKernel::Auto
        );
        assert!(FusedOptions::parse_combine("one").is_err());
        assert!(FusedOptions::parse_combine("warps").is_err());
        assert_eq!(FusedOptions::parse_dispatch("").unwrap(), Auto);
        let d = FusedOptions::default();
        assert_eq!(d.name(), "auto-auto-auto");
        // The default combine: two passes at 128 tokens, one pass at 512 and more.
        assert_eq!(d.combine_kind(128), "nvl_combine_fused");
        assert_eq!(d.combine_kind(511), "nvl_combine_fused");
        // ... each in its own default shape: 256x2 and 128x8n1.
        assert_eq!(d.combine_kind(512), "nvl_combine_fused_onepass_b128x8n1");
        assert_eq!(d.combine_kind(4096), "nvl_combine_fused_onepass_b128x8n1");
        assert_eq!(d.combine_launch(128), (FUSED_BLOCK, 2));
        assert_eq!(d.combine_launch(4096), (128, 8));
        assert_eq!(TwoPass.for_tokens(4096), TwoPass);
        let b448 = FusedOptions {
            combine: OnePass,
            block: Some(CombineBlock::parse("448x1").unwrap()),
            ..d
        };
        assert_eq!(b448.name(), "auto-onepass-448x1");
        assert_eq!(b448.combine_kind(1), "nvl_combine_fused_onepass_b448x1");
        assert_eq!(b448.combine_launch(1), (448, 1));
        let auto_p = FusedOptions {
            block: Some(CombineBlock::parse("256x2p").unwrap()),
            ..d
        };
        assert_eq!(auto_p.combine_kind(128), "nvl_combine_fused_b256x2p");
        assert_eq!(
            auto_p.combine_kind(4096),
            "nvl_combine_fused_onepass_b256x2p"
        );
        let w = FusedOptions {
            dispatch: FusedDispatchKernel::Warp,
            combine: FusedCombineKernel::Warp,
            block: Some(CombineBlock::parse("896x1n1").unwrap()),
            dispatch_chunk: None,
        };
        // The warp combine has no block shape: its name and kernel ignore it.
        assert_eq!(w.name(), "warp-warp");
        assert_eq!(w.combine_kind(1), "nvl_combine_fused_warp");
        assert_eq!(w.combine_launch(1), (FUSED_WARP_BLOCK, 8));
        let (h100, other) = (DispatchGpu::H100, DispatchGpu::Other);
        let fp8 = MoeWire::Fp8E4m3(Fp8Scales::Block128);
        assert_eq!(
            Auto.resolve(MoeWire::Native, 4096, other),
            FusedDispatchKernel::Warp
        );
        assert_eq!(
            Auto.resolve(MoeWire::Native, 1023, h100),
            FusedDispatchKernel::Warp
        );
        assert_eq!(Auto.resolve(MoeWire::Native, 1024, h100), PerWire);
        assert_eq!(Auto.resolve(fp8, 128, other), PerWire);
        assert_eq!(Auto.resolve(fp8, 4096, h100), PerWire);
        assert_eq!(Generic.resolve(MoeWire::Native, 4096, h100), Generic);
        assert_eq!(
            FusedDispatchKernel::Warp.resolve(MoeWire::Native, 4096, h100),
            FusedDispatchKernel::Warp
        );
        assert_eq!(DispatchGpu::of_name("NVIDIA H100 80GB HBM3"), h100);
        assert_eq!(DispatchGpu::of_name("NVIDIA H200"), other);
        let wires = [
            MoeWire::Native,
            MoeWire::Fp8E4m3(Fp8Scales::PerToken),
            MoeWire::Fp8E4m3(Fp8Scales::Block128),
        ];
        // Every kernel named exists in moe.cu, with the launch bounds of its block size, and is
        // in the list of the module's functions.
        let functions = Source::Moe.functions();
        let all = FusedOptions::all();
        assert_eq!(all.len(), 3 * (2 * CombineBlock::all().len() + 1));
        for o in &all {
            for w in wires {
                let bounds = match o.dispatch.block().0 {
                    FUSED_WARP_BLOCK => "WARP_KERNEL",
                    _ => "ROW_KERNEL",
                };
                let kind = FusedOptions::dispatch_kind(o.dispatch, w);
                let line = format!("{bounds} moe_{kind}_##T(");
                assert!(Source::Moe.text().contains(&line), "{line}");
                let name = moe_typed_name(kind, crate::dtype::DType::BF16);
                assert!(functions.contains(&name), "{name}");
            }
            let bounds = match o.combine {
                FusedCombineKernel::Warp => "WARP_KERNEL",
                k => o.block_for(k).shape.bounds(),
            };
            let line = format!("{bounds} moe_{}_##T(", o.combine_kind(1));
            assert!(Source::Moe.text().contains(&line), "{line}");
            let name = moe_typed_name(&o.combine_kind(1), crate::dtype::DType::BF16);
            assert!(functions.contains(&name), "{name}");
        }
        let names: std::collections::HashSet<String> = all.iter().map(|o| o.name()).collect();
        assert_eq!(names.len(), all.len());
    }

    /// The covering set runs every value of every option at least once, each combination one
    /// of [`FusedOptions::all`], each once.
    #[test]
    fn the_covering_set_covers_every_option_value() {
        let set = FusedOptions::covering();
        let all = FusedOptions::all();
        for o in &set {
            assert!(all.contains(o), "{}", o.name());
        }
        let names: std::collections::HashSet<String> = set.iter().map(|o| o.name()).collect();
        assert_eq!(names.len(), set.len());
        for d in FusedOptions::DISPATCH_KERNELS {
            assert!(set.iter().any(|o| o.dispatch == d), "{d:?}");
        }
        for c in FusedOptions::COMBINE_KERNELS {
            assert!(set.iter().any(|o| o.combine == c), "{c:?}");
        }
        let blocks: Vec<&FusedOptions> = set.iter().filter(|o| o.combine.is_block()).collect();
        for s in CombineShape::ALL {
            assert!(
                blocks.iter().any(|o| o.block.is_some_and(|b| b.shape == s)),
                "{s:?}"
            );
        }
        // Prefetch on and off, each with both block combines; both block combines with a one-
        // and a two-vector shape.
        for c in [FusedCombineKernel::TwoPass, FusedCombineKernel::OnePass] {
            for p in [false, true] {
                assert!(
                    blocks
                        .iter()
                        .any(|o| o.combine == c && o.block_for(c).prefetch == p),
                    "{c:?} prefetch {p}"
                );
            }
            for nv in [1, 2] {
                assert!(
                    blocks
                        .iter()
                        .any(|o| o.combine == c && o.block_for(c).shape.vectors() == nv),
                    "{c:?} NV {nv}"
                );
            }
        }
        assert!(set.len() <= 8);
    }

    /// Every block of a fused kernel's grid is resident: the grid is at most SMs x blocks per
    /// SM of the shape, and the consumers come about one grid after their producers.
    #[test]
    fn grid_and_lag_follow_the_combine_shape() {
        let (sms, world) = (132, 2);
        // 4096 tokens, chunks of 4: 1024 chunks, 2 items each.
        let items = 1024 * world;
        let expect = [
            ("256x2", 264),
            ("256x2p", 264),
            ("448x1", 132),
            ("448x1p", 132),
            ("448x2n1", 264),
            ("896x1n1", 132),
            ("512x1", 132),
            ("512x1p", 132),
            ("224x4n1", 528),
            ("128x8n1", 1056),
        ];
        assert_eq!(expect.len(), CombineBlock::all().len());
        for (name, grid) in expect {
            let o = FusedOptions {
                block: Some(CombineBlock::parse(name).unwrap()),
                ..FusedOptions::default()
            };
            let launch = o.combine_launch(4096);
            let (g, lag) = grid_and_lag_on(sms, items, world, launch, false, None);
            assert_eq!((g, lag), (grid, grid as usize / world), "{name}");
            // Fewer items than the device holds: one block per item.
            assert_eq!(grid_and_lag_on(sms, 6, world, launch, false, None), (6, 3));
            assert_eq!(
                grid_and_lag_on(sms, items, world, launch, false, Some(7)),
                (grid, 7)
            );
        }
        // The warp combine: 2 warps per block, 8 blocks per SM.
        let w = FusedOptions {
            combine: FusedCombineKernel::Warp,
            ..FusedOptions::default()
        };
        assert_eq!(
            grid_and_lag_on(sms, items, world, w.combine_launch(4096), true, None),
            (1024, 1024)
        );
    }

    #[test]
    fn default_chunks_per_phase() {
        use FusedDispatchKernel::{Generic, PerWire, Warp};
        let (native, fp8) = (MoeWire::Native, MoeWire::Fp8E4m3(Fp8Scales::PerToken));
        assert_eq!(dispatch_default_chunk(PerWire, 128, fp8), 1);
        assert_eq!(dispatch_default_chunk(PerWire, 4096, fp8), 2);
        assert_eq!(dispatch_default_chunk(Warp, 4096, fp8), 2);
        assert_eq!(dispatch_default_chunk(Warp, 4096, native), 1);
        assert_eq!(dispatch_default_chunk(PerWire, 1023, native), 1);
        assert_eq!(dispatch_default_chunk(PerWire, 1024, native), 2);
        assert_eq!(dispatch_default_chunk(Generic, 4096, native), 2);
        assert_eq!(COMBINE_DEFAULT_CHUNK, 1);
        assert_ne!(
            FusedPhase::Dispatch.chunk_env(),
            FusedPhase::Combine.chunk_env()
        );
    }

    #[test]
    fn fused_block_matches_the_kernels_launch_bounds() {
        let line = format!("#define ROW_THREADS {FUSED_BLOCK}\n");
        assert!(Source::Moe.text().contains(&line));
        let line = format!("#define WARP_THREADS {FUSED_WARP_BLOCK}\n");
        assert!(Source::Moe.text().contains(&line));
        assert!(Source::Moe
            .text()
            .contains("#define WARP_KERNEL __launch_bounds__(WARP_THREADS, 8)\n"));
        assert_eq!(FusedDispatchKernel::Warp.block(), (FUSED_WARP_BLOCK, 8));
        let d = CombineBlock::default();
        assert_eq!(FusedCombineKernel::Warp.block(d), (FUSED_WARP_BLOCK, 8));
        assert_eq!(FusedCombineKernel::OnePass.block(d), (FUSED_BLOCK, 2));
        assert!(Source::Moe
            .text()
            .contains("ROW_KERNEL moe_nvl_dispatch_fused_##T("));
        assert!(Source::Moe
            .text()
            .contains("ROW_KERNEL moe_nvl_combine_fused_##T("));
    }
}
