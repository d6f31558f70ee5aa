//! Calls of the `moe.cu` kernels. Callers (the transports) check every buffer extent
//! against the shape before calling; these functions only marshal arguments and pick grids.

use super::{MoeShape, MoeWire, WireLayout};
use crate::buffer::DeviceBuffer;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{moe_typed_name, Arg, Kernels, Source};
use crate::stream::Stream;

/// Threads per block of the MoE kernels that are not row kernels (8 warps).
const BLOCK: u32 = 256;

/// Threads per block of the row kernels (dispatch send / receive, combine send): a whole block
/// moves one row at a time. Must equal `ROW_THREADS` in `moe.cu` (their launch bounds).
const ROW_BLOCK: u32 = 256;

/// How long a receiver waits for a peer's flag before raising `TIMEOUT`, by default.
pub(crate) const FLAG_TIMEOUT_NS: u64 = 10_000_000_000;

/// `v` as a kernel `i64` (sizes are validated to fit i32 long before this).
pub(crate) fn n(v: usize) -> Arg {
    Arg::I64(i64::try_from(v).unwrap_or(i64::MAX))
}

pub(crate) fn ptr(b: &DeviceBuffer) -> Arg {
    Arg::Ptr(b.addr())
}

/// A null pointer argument.
pub(crate) const NULL: Arg = Arg::Ptr(0);

fn opt(b: Option<&DeviceBuffer>) -> Arg {
    b.map_or(NULL, ptr)
}

/// Blocks for one warp per item, capped for grid-stride loops (8 blocks of 8 warps per SM).
pub(crate) fn warp_grid(k: &Kernels, items: usize) -> u32 {
    let cap = k.device().sm_count() as usize * 8;
    u32::try_from(items.div_ceil(8).clamp(1, cap.max(1))).unwrap_or(1)
}

/// Blocks for one block per row (a grid-stride loop over `rows`), at most the two blocks per
/// SM that stay resident.
pub(crate) fn row_grid(k: &Kernels, rows: usize) -> u32 {
    let cap = k.device().sm_count() as usize * 2;
    u32::try_from(rows.clamp(1, cap.max(1))).unwrap_or(1)
}

/// Blocks for one thread per item, capped for grid-stride loops.
pub(crate) fn thread_grid(k: &Kernels, items: usize) -> u32 {
    let cap = k.device().sm_count() as usize * 8;
    u32::try_from(items.div_ceil(BLOCK as usize).clamp(1, cap.max(1))).unwrap_or(1)
}

/// Threads of the final sum: one per 16 bytes of `out` (or per element).
pub(crate) fn sum_items(shape: &MoeShape) -> usize {
    let vec = 16 / shape.dtype.size_bytes();
    let per_token = if shape.out_hidden.is_multiple_of(vec) {
        shape.out_hidden / vec
    } else {
        shape.out_hidden
    };
    shape.tokens * per_token
}

fn typed(kind: &str, dtype: DType) -> String {
    moe_typed_name(kind, dtype)
}

/// The wire arguments every kernel that reads or writes wire rows takes after `hidden`:
/// `wire, stride, scale_off, meta_off`.
fn wire_args(wire: MoeWire, lay: &WireLayout) -> [Arg; 4] {
    [
        Arg::U32(wire.code()),
        n(lay.stride),
        n(lay.scale_off),
        n(lay.meta_off),
    ]
}

/// The inputs of a dispatch send.
pub(crate) struct SendInputs<'a> {
    pub x: &'a DeviceBuffer,
    pub topk_idx: &'a DeviceBuffer,
    pub weights: Option<&'a DeviceBuffer>,
}

/// Sender workspace: `cnt[W]` (zeroed between launches by the kernel) and `sent_pos[T, W]`;
/// and where the sender fans its own tokens out to this rank's local experts (the receive
/// kernel handles only other ranks' rows): `expert_x`, `routing`, `fan` and the expert row
/// counters `ecnt` of [`RecvOutputs`].
pub(crate) struct SendState<'a> {
    pub cnt: &'a DeviceBuffer,
    pub sent_pos: &'a DeviceBuffer,
    pub status: &'a DeviceBuffer,
    pub expert_x: &'a DeviceBuffer,
    pub routing: &'a DeviceBuffer,
    pub fan: &'a DeviceBuffer,
    pub ecnt: &'a DeviceBuffer,
}

/// The own fan-out arguments every dispatch send takes last:
/// `expert_x, routing, fan, ecnt, capacity`.
fn own_fan_out_args(shape: &MoeShape, st: &SendState<'_>) -> [Arg; 5] {
    [
        ptr(st.expert_x),
        ptr(st.routing),
        ptr(st.fan),
        ptr(st.ecnt),
        n(shape.capacity),
    ]
}

/// NCCL dispatch send: route and pack into `send` (`[W]` blocks of `block_bytes`), headers by
/// the last block (`done`: a zeroed u32); this rank's own tokens straight to its experts.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nccl_dispatch_send(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    wire: MoeWire,
    rank: usize,
    inp: &SendInputs<'_>,
    st: &SendState<'_>,
    send: &DeviceBuffer,
    block_bytes: usize,
    done: &DeviceBuffer,
) -> Result<()> {
    let lay = WireLayout::of(shape, wire);
    let [wc, stride, so, mo] = wire_args(wire, &lay);
    let [ox, ort, ofan, oecnt, ocap] = own_fan_out_args(shape, st);
    let mut args = [
        ptr(inp.x),
        ptr(inp.topk_idx),
        opt(inp.weights),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.experts),
        n(shape.local_experts()),
        n(shape.world),
        n(shape.hidden),
        wc,
        stride,
        so,
        mo,
        ptr(send),
        n(block_bytes),
        ptr(st.cnt),
        ptr(st.sent_pos),
        ptr(st.status),
        ptr(done),
        n(rank),
        ox,
        ort,
        ofan,
        oecnt,
        ocap,
    ];
    let grid = row_grid(k, shape.tokens);
    let name = typed("nccl_dispatch_send", shape.dtype);
    k.call(stream, Source::Moe, &name, grid, ROW_BLOCK, &mut args)
}

/// The NVLink symmetric regions a kernel addresses in its peers.
pub(crate) struct PeerRegions<'a> {
    /// `[W]` u64: every rank's symmetric base address.
    pub peer_sym: &'a DeviceBuffer,
    /// Offsets inside a symmetric allocation.
    pub rows: usize,
    pub counts: usize,
    pub dispatch_flags: usize,
    pub partials: usize,
    pub combine_flags: usize,
    pub weights: usize,
    pub weight_flags: usize,
    pub dispatch_token_flags: usize,
    pub combine_chunks: usize,
}

/// NVLink dispatch send: route, store rows and counts in the receivers, raise their flags;
/// this rank's own tokens straight to its experts.
/// `state` is the transport's `[8]` u32 device state (epoch and grid counters).
#[allow(clippy::too_many_arguments)]
pub(crate) fn nvl_dispatch_send(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    wire: MoeWire,
    rank: usize,
    inp: &SendInputs<'_>,
    st: &SendState<'_>,
    peers: &PeerRegions<'_>,
    state: &DeviceBuffer,
) -> Result<()> {
    let lay = WireLayout::of(shape, wire);
    let [wc, stride, so, mo] = wire_args(wire, &lay);
    let [ox, ort, ofan, oecnt, ocap] = own_fan_out_args(shape, st);
    let mut args = [
        ptr(inp.x),
        ptr(inp.topk_idx),
        opt(inp.weights),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.experts),
        n(shape.local_experts()),
        n(shape.world),
        n(rank),
        n(shape.hidden),
        wc,
        stride,
        so,
        mo,
        ptr(peers.peer_sym),
        n(peers.rows),
        n(peers.counts),
        n(peers.dispatch_flags),
        ptr(st.cnt),
        ptr(st.sent_pos),
        ptr(st.status),
        ptr(state),
        ox,
        ort,
        ofan,
        oecnt,
        ocap,
    ];
    let grid = row_grid(k, shape.tokens);
    let name = typed("nvl_dispatch_send", shape.dtype);
    k.call(stream, Source::Moe, &name, grid, ROW_BLOCK, &mut args)
}

/// Where a receiver finds the rows and counts of every source (see `Sources` in
/// `moe_dispatch.cu`): source `s`'s rows start at `(s == rank ? own : other) + s * block_bytes +
/// row_off`, its count at `(s == rank ? own_cnt : other_cnt) + s * cnt_stride`.
pub(crate) struct SourceRows<'a> {
    pub own: &'a DeviceBuffer,
    pub other: &'a DeviceBuffer,
    pub block_bytes: usize,
    pub row_off: usize,
    pub own_cnt: &'a DeviceBuffer,
    pub other_cnt: &'a DeviceBuffer,
    pub cnt_stride: usize,
}

/// Receiver outputs and workspace of a dispatch.
pub(crate) struct RecvOutputs<'a> {
    pub expert_x: &'a DeviceBuffer,
    pub routing: &'a DeviceBuffer,
    /// `[W, T, K]` i32: the expert row each received row went to for each k, or -1.
    pub fan: &'a DeviceBuffer,
    /// `[L]` i32 row counters (zeroed between launches by the kernel).
    pub ecnt: &'a DeviceBuffer,
    pub counts: &'a DeviceBuffer,
    pub status: &'a DeviceBuffer,
    /// A zeroed u32 grid counter.
    pub done: &'a DeviceBuffer,
}

/// The flag wait of an NVLink receive: `flags[W]` (this rank's), the state word holding the
/// epoch, the timeout.
pub(crate) struct FlagWait<'a> {
    pub flags: &'a DeviceBuffer,
    pub state: &'a DeviceBuffer,
    pub timeout_ns: u64,
}

/// Dispatch receive (both transports): optional flag wait, fan-out, counts.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dispatch_recv(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    wire: MoeWire,
    rank: usize,
    wait: Option<&FlagWait<'_>>,
    src: &SourceRows<'_>,
    out: &RecvOutputs<'_>,
) -> Result<()> {
    let lay = WireLayout::of(shape, wire);
    let [wc, stride, so, mo] = wire_args(wire, &lay);
    let mut args = [
        opt(wait.map(|w| w.flags)),
        opt(wait.map(|w| w.state)),
        Arg::U64(wait.map_or(0, |w| w.timeout_ns)),
        ptr(src.own),
        ptr(src.other),
        n(src.block_bytes),
        n(src.row_off),
        ptr(src.own_cnt),
        ptr(src.other_cnt),
        n(src.cnt_stride),
        n(rank),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.experts),
        n(shape.local_experts()),
        n(shape.world),
        n(shape.capacity),
        n(shape.hidden),
        wc,
        stride,
        so,
        mo,
        ptr(out.expert_x),
        ptr(out.routing),
        ptr(out.fan),
        ptr(out.ecnt),
        ptr(out.counts),
        ptr(out.status),
        ptr(out.done),
    ];
    let grid = row_grid(k, shape.world * shape.tokens);
    let name = typed("dispatch_recv", shape.dtype);
    k.call(stream, Source::Moe, &name, grid, ROW_BLOCK, &mut args)
}

/// Zeroes padding rows of `expert_x` / `routing`: `[counts, prev)` per expert, or `[counts, C)`
/// without `prev`.
pub(crate) fn zero_padding(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    out: &RecvOutputs<'_>,
    prev: Option<&DeviceBuffer>,
) -> Result<()> {
    let mut args = [
        ptr(out.expert_x),
        n(shape.x_row_bytes()),
        ptr(out.routing),
        ptr(out.counts),
        opt(prev),
        n(shape.local_experts()),
        n(shape.capacity),
    ];
    let grid = warp_grid(k, shape.local_experts() * shape.capacity);
    k.call(
        stream,
        Source::Moe,
        "moe_zero_padding",
        grid,
        BLOCK,
        &mut args,
    )
}

/// Where a combine reads its weights when they were not given at dispatch: `w_self`
/// (`[T, K]`, this rank's) and `w_peers` (`[W, T, K]`, slot `s` from rank `s`).
pub(crate) struct LateWeights<'a> {
    pub w_self: &'a DeviceBuffer,
    pub w_peers: &'a DeviceBuffer,
}

/// NCCL combine send: partials of every received row into `send` (`[W, T]` rows of `F`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn nccl_combine_send(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    wire: MoeWire,
    rank: usize,
    src: &SourceRows<'_>,
    y: &DeviceBuffer,
    fan: &DeviceBuffer,
    late: Option<&LateWeights<'_>>,
    send: &DeviceBuffer,
    status: &DeviceBuffer,
) -> Result<()> {
    let lay = WireLayout::of(shape, wire);
    let mut args = [
        ptr(src.own),
        ptr(src.other),
        n(src.block_bytes),
        n(src.row_off),
        ptr(src.own_cnt),
        ptr(src.other_cnt),
        n(src.cnt_stride),
        n(rank),
        ptr(y),
        ptr(fan),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.world),
        n(shape.out_hidden),
        n(lay.stride),
        n(lay.meta_off),
        Arg::U32(u32::from(late.is_some())),
        opt(late.map(|l| l.w_self)),
        opt(late.map(|l| l.w_peers)),
        ptr(send),
        ptr(status),
    ];
    let grid = row_grid(k, shape.world * shape.tokens);
    let name = typed("nccl_combine_send", shape.dtype);
    k.call(stream, Source::Moe, &name, grid, ROW_BLOCK, &mut args)
}

/// NVLink late weights: this rank's `weights[T, K]` into every peer's weight area, flags.
pub(crate) fn nvl_weights_send(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    rank: usize,
    weights: &DeviceBuffer,
    peers: &PeerRegions<'_>,
    state: &DeviceBuffer,
) -> Result<()> {
    let tk = shape.tokens * shape.top_k;
    let mut args = [
        ptr(weights),
        n(tk),
        n(shape.world),
        n(rank),
        ptr(peers.peer_sym),
        n(peers.weights),
        n(peers.weight_flags),
        ptr(state),
    ];
    let grid = thread_grid(k, shape.world * tk);
    k.call(
        stream,
        Source::Moe,
        "moe_nvl_weights_send",
        grid,
        BLOCK,
        &mut args,
    )
}

/// This rank's own NVLink regions a combine send reads.
pub(crate) struct NvlLocal<'a> {
    /// `[W]` u32 weight flags.
    pub weight_flags: &'a DeviceBuffer,
    /// `[W, T]` received rows.
    pub rows: &'a DeviceBuffer,
    /// `[W]` i32 received counts.
    pub counts: &'a DeviceBuffer,
    /// `[W, T, K]` f32 weight area.
    pub weights: &'a DeviceBuffer,
}

/// NVLink combine send: (late: wait for the weights) partials straight into the sources'
/// partial areas, then their combine flags.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nvl_combine_send(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    wire: MoeWire,
    rank: usize,
    local: &NvlLocal<'_>,
    y: &DeviceBuffer,
    fan: &DeviceBuffer,
    late: bool,
    peers: &PeerRegions<'_>,
    state: &DeviceBuffer,
    timeout_ns: u64,
    status: &DeviceBuffer,
) -> Result<()> {
    let lay = WireLayout::of(shape, wire);
    let mut args = [
        ptr(local.weight_flags),
        ptr(state),
        Arg::U64(timeout_ns),
        ptr(local.rows),
        ptr(local.counts),
        n(rank),
        ptr(y),
        ptr(fan),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.world),
        n(shape.out_hidden),
        n(lay.stride),
        n(lay.meta_off),
        Arg::U32(u32::from(late)),
        ptr(local.weights),
        ptr(peers.peer_sym),
        n(peers.partials),
        n(peers.combine_flags),
        ptr(status),
    ];
    let grid = row_grid(k, shape.world * shape.tokens);
    let name = typed("nvl_combine_send", shape.dtype);
    k.call(stream, Source::Moe, &name, grid, ROW_BLOCK, &mut args)
}

/// Combine receive (both transports): optional flag wait, then `out[t] = Σ_r partial` with the
/// partial of rank `r` at `(r == rank ? own : other) + (r * T + sent_pos[t, r]) * F`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn combine_recv(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    rank: usize,
    wait: Option<&FlagWait<'_>>,
    own: &DeviceBuffer,
    other: &DeviceBuffer,
    sent_pos: &DeviceBuffer,
    out: &DeviceBuffer,
    status: &DeviceBuffer,
) -> Result<()> {
    let mut args = [
        opt(wait.map(|w| w.flags)),
        opt(wait.map(|w| w.state)),
        Arg::U64(wait.map_or(0, |w| w.timeout_ns)),
        ptr(status),
        ptr(own),
        ptr(other),
        n(rank),
        ptr(sent_pos),
        ptr(out),
        n(shape.tokens),
        n(shape.world),
        n(shape.out_hidden),
    ];
    let grid = thread_grid(k, sum_items(shape));
    let name = typed("combine_recv", shape.dtype);
    k.call(stream, Source::Moe, &name, grid, BLOCK, &mut args)
}

/// Uploads device addresses as a `[n]` u64 table (stored as i64 bits).
pub(crate) fn address_table(stream: &Stream, addrs: &[u64]) -> Result<DeviceBuffer> {
    let bits: Vec<i64> = addrs.iter().map(|a| *a as i64).collect();
    DeviceBuffer::from_slice(stream, &bits)
}

#[cfg(test)]
mod tests {
    use super::ROW_BLOCK;
    use crate::kernels::Source;

    #[test]
    fn row_block_matches_the_kernels_launch_bounds() {
        let line = format!("#define ROW_THREADS {ROW_BLOCK}\n");
        assert!(
            Source::Moe.text().contains(&line),
            "moe.cu must define ROW_THREADS as {ROW_BLOCK}"
        );
    }
}
