//! Calls of the `moe.cu` kernels. Callers (the transports) check every buffer extent
//! against the shape before calling; these functions only marshal arguments.

use super::MoeShape;
use crate::buffer::DeviceBuffer;
use crate::dtype::DType;
use crate::error::Result;
use crate::kernels::{moe_reduce_name, Arg, Kernels, Source};
use crate::stream::Stream;

/// Threads of the single-block kernels (route, scan).
const ONE_BLOCK: u32 = 1024;
/// Threads of the grid kernels (8 warps).
const BLOCK: u32 = 256;

/// How long a receiver waits for a peer's flag before raising `TIMEOUT`, by default.
pub(crate) const FLAG_TIMEOUT_NS: u64 = 10_000_000_000;

/// `v` as a kernel `i64` (sizes are validated to fit i32 long before this).
fn n(v: usize) -> Arg {
    Arg::I64(i64::try_from(v).unwrap_or(i64::MAX))
}

fn ptr(b: &DeviceBuffer) -> Arg {
    Arg::Ptr(b.addr())
}

/// Blocks for one warp per item, capped for grid-stride loops.
fn warp_grid(k: &Kernels, items: usize) -> u32 {
    let cap = k.device().sm_count() as usize * 8;
    u32::try_from(items.div_ceil(8).clamp(1, cap.max(1))).unwrap_or(1)
}

/// Blocks for one thread per item, capped for grid-stride loops.
fn thread_grid(k: &Kernels, items: usize) -> u32 {
    let cap = k.device().sm_count() as usize * 16;
    u32::try_from(items.div_ceil(BLOCK as usize).clamp(1, cap.max(1))).unwrap_or(1)
}

/// NCCL: histogram of `topk_idx`, rank of each row in its expert, offset of each expert in its
/// destination's send block.
#[allow(clippy::too_many_arguments)]
pub(crate) fn route(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    topk_idx: &DeviceBuffer,
    cnt: &DeviceBuffer,
    pos: &DeviceBuffer,
    base: &DeviceBuffer,
    status: &DeviceBuffer,
) -> Result<()> {
    let mut args = [
        ptr(topk_idx),
        n(shape.tokens * shape.top_k),
        n(shape.experts),
        n(shape.local_experts()),
        ptr(cnt),
        ptr(pos),
        ptr(base),
        ptr(status),
    ];
    k.call(stream, Source::Moe, "moe_route", 1, ONE_BLOCK, &mut args)
}

/// NCCL: rows into the padded per-destination send blocks (`[W, P]` rows and `(token, k)`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn nccl_dispatch_pack(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    rank: usize,
    x: &DeviceBuffer,
    topk_idx: &DeviceBuffer,
    pos: &DeviceBuffer,
    base: &DeviceBuffer,
    send_x: &DeviceBuffer,
    send_meta: &DeviceBuffer,
) -> Result<()> {
    let mut args = [
        ptr(x),
        n(shape.x_row_bytes()),
        ptr(topk_idx),
        ptr(pos),
        ptr(base),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.local_experts()),
        n(rank),
        n(shape.pair_rows()),
        ptr(send_x),
        ptr(send_meta),
    ];
    let grid = warp_grid(k, shape.tokens * shape.top_k);
    k.call(
        stream,
        Source::Moe,
        "moe_nccl_dispatch_pack",
        grid,
        BLOCK,
        &mut args,
    )
}

/// Byte offsets of the NVLink symmetric regions a dispatch sender writes.
pub(crate) struct NvlTargets<'a> {
    /// `[W]` u64 symmetric base address of every rank.
    pub peer_sym: &'a DeviceBuffer,
    pub x_off: usize,
    pub routing_off: usize,
    /// This step's counters (by epoch parity).
    pub counter_off: usize,
    /// `[W]` u64 addresses of this rank's dispatch flag in every rank.
    pub flag_ptrs: &'a DeviceBuffer,
    /// The grid-completion counter of the send kernel.
    pub done: &'a DeviceBuffer,
}

/// NVLink: reserve a row per `(t, k)` in its receiver, store it there, raise the flags.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nvl_dispatch_send(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    rank: usize,
    x: &DeviceBuffer,
    topk_idx: &DeviceBuffer,
    targets: &NvlTargets<'_>,
    status: &DeviceBuffer,
    epoch: u32,
) -> Result<()> {
    let mut args = [
        ptr(x),
        n(shape.x_row_bytes()),
        ptr(topk_idx),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.experts),
        n(shape.local_experts()),
        n(shape.capacity),
        n(rank),
        ptr(targets.peer_sym),
        n(targets.x_off),
        n(targets.routing_off),
        n(targets.counter_off),
        ptr(status),
        ptr(targets.done),
        ptr(targets.flag_ptrs),
        n(shape.world),
        Arg::U32(epoch),
    ];
    let grid = warp_grid(k, shape.tokens * shape.top_k);
    k.call(
        stream,
        Source::Moe,
        "moe_nvl_dispatch_send",
        grid,
        BLOCK,
        &mut args,
    )
}

/// NVLink dispatch receive: wait for the flags, counts, padding.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nvl_dispatch_recv(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    flags: &DeviceBuffer,
    epoch: u32,
    timeout_ns: u64,
    counters: &DeviceBuffer,
    counters_next: &DeviceBuffer,
    counts: &DeviceBuffer,
    expert_x: &DeviceBuffer,
    routing: &DeviceBuffer,
    status: &DeviceBuffer,
) -> Result<()> {
    let mut args = [
        ptr(flags),
        n(shape.world),
        Arg::U32(epoch),
        Arg::U64(timeout_ns),
        ptr(counters),
        ptr(counters_next),
        ptr(counts),
        n(shape.local_experts()),
        n(shape.capacity),
        ptr(expert_x),
        n(shape.x_row_bytes()),
        ptr(routing),
        ptr(status),
    ];
    let grid = warp_grid(k, shape.local_experts() * shape.capacity);
    k.call(
        stream,
        Source::Moe,
        "moe_nvl_dispatch_recv",
        grid,
        BLOCK,
        &mut args,
    )
}

/// The NCCL receive-side buffers of a dispatch.
pub(crate) struct NcclRecv<'a> {
    pub send_x: &'a DeviceBuffer,
    pub recv_x: &'a DeviceBuffer,
    pub send_meta: &'a DeviceBuffer,
    pub recv_meta: &'a DeviceBuffer,
    /// `[W, L]` counts received from every peer.
    pub recv_cnt: &'a DeviceBuffer,
    /// `[W, L]`, `[W, L]`, `[W]` scan results.
    pub src_off: &'a DeviceBuffer,
    pub dst_off: &'a DeviceBuffer,
    pub src_total: &'a DeviceBuffer,
}

/// NCCL dispatch receive: scan the counts, then unpack rows and zero the padding.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nccl_dispatch_recv(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    rank: usize,
    own_cnt: &DeviceBuffer,
    bufs: &NcclRecv<'_>,
    counts: &DeviceBuffer,
    expert_x: &DeviceBuffer,
    routing: &DeviceBuffer,
    status: &DeviceBuffer,
) -> Result<()> {
    let l = shape.local_experts();
    let self_cnt = own_cnt.view(rank * l * 4, l * 4)?;
    let mut args = [
        ptr(&self_cnt),
        ptr(bufs.recv_cnt),
        n(rank),
        n(shape.world),
        n(l),
        n(shape.capacity),
        ptr(bufs.src_off),
        ptr(bufs.dst_off),
        ptr(bufs.src_total),
        ptr(counts),
        ptr(status),
    ];
    k.call(
        stream,
        Source::Moe,
        "moe_nccl_dispatch_scan",
        1,
        ONE_BLOCK,
        &mut args,
    )?;
    let pair = shape.pair_rows();
    let mut args = [
        ptr(bufs.recv_x),
        ptr(bufs.send_x),
        ptr(bufs.recv_meta),
        ptr(bufs.send_meta),
        n(rank),
        n(shape.world),
        n(pair),
        n(l),
        n(shape.capacity),
        n(shape.x_row_bytes()),
        ptr(bufs.src_off),
        ptr(bufs.dst_off),
        ptr(bufs.src_total),
        ptr(counts),
        ptr(expert_x),
        ptr(routing),
    ];
    let grid = warp_grid(k, (shape.world * pair).max(l * shape.capacity));
    k.call(
        stream,
        Source::Moe,
        "moe_nccl_dispatch_unpack",
        grid,
        BLOCK,
        &mut args,
    )
}

/// The expert-side inputs of a combine.
pub(crate) struct ExpertRows<'a> {
    pub y: &'a DeviceBuffer,
    pub counts: &'a DeviceBuffer,
    pub routing: &'a DeviceBuffer,
}

/// NVLink combine send: rows into the sources' slots, marks, flags.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nvl_combine_send(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    rows: &ExpertRows<'_>,
    peer_sym: &DeviceBuffer,
    slots_off: usize,
    marks_off: usize,
    epoch: u32,
    status: &DeviceBuffer,
    done: &DeviceBuffer,
    flag_ptrs: &DeviceBuffer,
) -> Result<()> {
    let mut args = [
        ptr(rows.y),
        n(shape.y_row_bytes()),
        ptr(rows.counts),
        ptr(rows.routing),
        n(shape.local_experts()),
        n(shape.capacity),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.world),
        ptr(peer_sym),
        n(slots_off),
        n(marks_off),
        Arg::U32(epoch),
        ptr(status),
        ptr(done),
        ptr(flag_ptrs),
    ];
    let grid = warp_grid(k, shape.local_experts() * shape.capacity);
    k.call(
        stream,
        Source::Moe,
        "moe_nvl_combine_send",
        grid,
        BLOCK,
        &mut args,
    )
}

/// NVLink combine receive: wait for the flags, weighted sum of the marked slots.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nvl_combine_recv(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    flags: &DeviceBuffer,
    epoch: u32,
    timeout_ns: u64,
    status: &DeviceBuffer,
    slots: &DeviceBuffer,
    marks: &DeviceBuffer,
    weights: &DeviceBuffer,
    out: &DeviceBuffer,
) -> Result<()> {
    let mut args = [
        ptr(flags),
        n(shape.world),
        Arg::U32(epoch),
        Arg::U64(timeout_ns),
        ptr(status),
        ptr(slots),
        ptr(marks),
        ptr(weights),
        ptr(out),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.out_hidden),
    ];
    let name = moe_reduce_name("nvl_combine_recv", shape.dtype);
    let grid = thread_grid(k, reduce_items(shape));
    k.call(stream, Source::Moe, &name, grid, BLOCK, &mut args)
}

/// Threads of a combine reduction: one per 16 bytes of `out` (or per element).
fn reduce_items(shape: &MoeShape) -> usize {
    let vec = 16 / shape.dtype.size_bytes();
    let per_token = if shape.out_hidden.is_multiple_of(vec) {
        shape.out_hidden / vec
    } else {
        shape.out_hidden
    };
    shape.tokens * per_token
}

/// NCCL combine pack: rows into per-source send blocks (send_cnt must be zeroed).
#[allow(clippy::too_many_arguments)]
pub(crate) fn nccl_combine_pack(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    rows: &ExpertRows<'_>,
    send_cnt: &DeviceBuffer,
    send_x: &DeviceBuffer,
    send_meta: &DeviceBuffer,
    status: &DeviceBuffer,
) -> Result<()> {
    let mut args = [
        ptr(rows.y),
        n(shape.y_row_bytes()),
        ptr(rows.counts),
        ptr(rows.routing),
        n(shape.local_experts()),
        n(shape.capacity),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.world),
        n(shape.combine_pair_rows()),
        ptr(send_cnt),
        ptr(send_x),
        ptr(send_meta),
        ptr(status),
    ];
    let grid = warp_grid(k, shape.local_experts() * shape.capacity);
    k.call(
        stream,
        Source::Moe,
        "moe_nccl_combine_pack",
        grid,
        BLOCK,
        &mut args,
    )
}

/// The token-side buffers of an NCCL combine.
pub(crate) struct NcclCombineRecv<'a> {
    pub send_cnt: &'a DeviceBuffer,
    pub recv_cnt: &'a DeviceBuffer,
    pub send_x: &'a DeviceBuffer,
    pub recv_x: &'a DeviceBuffer,
    pub send_meta: &'a DeviceBuffer,
    pub recv_meta: &'a DeviceBuffer,
    /// `[T * K]` i32, set to -1 here before indexing.
    pub slot_idx: &'a DeviceBuffer,
}

/// NCCL combine receive: index the `(t, k)` slots, then the weighted sum.
#[allow(clippy::too_many_arguments)]
pub(crate) fn nccl_combine_recv(
    k: &Kernels,
    stream: &Stream,
    shape: &MoeShape,
    rank: usize,
    bufs: &NcclCombineRecv<'_>,
    weights: &DeviceBuffer,
    out: &DeviceBuffer,
    status: &DeviceBuffer,
) -> Result<()> {
    let pair = shape.combine_pair_rows();
    bufs.slot_idx.memset(stream, 0xFF)?;
    let mut args = [
        ptr(bufs.send_cnt),
        ptr(bufs.recv_cnt),
        ptr(bufs.send_meta),
        ptr(bufs.recv_meta),
        n(rank),
        n(shape.world),
        n(pair),
        n(shape.tokens),
        n(shape.top_k),
        ptr(bufs.slot_idx),
        ptr(status),
    ];
    let grid = thread_grid(k, shape.world * pair);
    k.call(
        stream,
        Source::Moe,
        "moe_nccl_combine_index",
        grid,
        BLOCK,
        &mut args,
    )?;
    let mut args = [
        ptr(bufs.recv_x),
        ptr(bufs.send_x),
        ptr(bufs.slot_idx),
        n(rank),
        n(pair),
        ptr(weights),
        ptr(out),
        n(shape.tokens),
        n(shape.top_k),
        n(shape.out_hidden),
    ];
    let name = moe_reduce_name("nccl_combine_reduce", shape.dtype);
    let grid = thread_grid(k, reduce_items(shape));
    k.call(stream, Source::Moe, &name, grid, BLOCK, &mut args)
}

/// Uploads device addresses as a `[n]` u64 table (stored as i64 bits).
pub(crate) fn address_table(stream: &Stream, addrs: &[u64]) -> Result<DeviceBuffer> {
    let bits: Vec<i64> = addrs.iter().map(|a| *a as i64).collect();
    DeviceBuffer::from_slice(stream, &bits)
}

/// A zeroed `[n]` i32 buffer.
pub(crate) fn zeroed_i32(stream: &Stream, n: usize) -> Result<DeviceBuffer> {
    let b = DeviceBuffer::alloc_elems(stream.device(), DType::I32, n)?;
    b.zero(stream)?;
    Ok(b)
}
