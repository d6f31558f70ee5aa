#line 1 "moe_fused_warp_combine.cu"
// moe_fused_warp_combine.cu: the warp-per-item fused NVLink combine (appended after
// moe_fused_warp.cu, whose warp helpers it uses; host side: kernels/src/moe/fused.rs,
// FusedCombineKernel::Warp).
//
// The protocol of nvl_combine_fused unchanged (the same items in the same ticket order, partials
// stored straight into the source rank's `partials`, one chunk flag released at that source per
// producer item, late weights waited for per source, the last block resetting the ticket
// counter), but every WARP takes tickets and runs its item alone, with no block-wide barrier:
// - a producer warp computes, per token of its chunk whose slot holds a row of its source, the
//   partial row (partial_row) into the source's partials, then releases the chunk there
//   (warp_release_chunk to that one rank);
// - a consumer warp waits for the chunk from every peer, then computes each of its tokens in one
//   pass (partial_sum_row): this rank's own partial in registers and the sum in ascending rank
//   order with the peers' partials (the first peer's loaded together with the own expert
//   rows), one write of out. One pass rather than two (own partials into out before the wait,
//   then the sum): a warp that waits cannot overlap anything of its own with the wait (the
//   other warps of the SM do), and two passes write out twice and read it once more.
// A warp reads a token's metadata (the slot's token field, lane k's fan and weight) while the
// previous token's rows are in flight, and each lane loads COMBINE_WARP_BATCH 16-byte vectors of
// up to 4 expert rows per round before accumulating (8 loads in flight per lane; the block
// kernel's warps get about 3.5 per round trip, with three metadata round trips per token).
// The sums are the block kernels' bit for bit: the same helpers (accumulate_experts: k order
// within a partial; partial_sum_row: ascending rank order), only with a warp sharing a row.
//
// Launched like the warp dispatch: WARP_THREADS threads per block (WARP_KERNEL, 128 registers),
// a grid of at most 8 blocks per SM with a warp per item (kernels/src/moe/fused.rs).

// 16-byte vectors per lane and round of a warp's partial row: 2 uses 121 registers; 3 or 4
// (ptxas -v through scripts/nvrtc-check.py --verbose) spill hundreds of bytes at 128.
#define COMBINE_WARP_BATCH 2

// A token of a combine item, read one token ahead: the slot's token field (producers: the slot
// holds a row of the source iff it equals the token; consumers: the token itself) and lane k's
// fan and weight.
struct CombineToken {
    int tok;
    KLane first;
};

__device__ __forceinline__ CombineToken combine_token(const char* rows, const i32* fan, i64 s,
                                                      i64 t, i64 tokens, i64 top_k, i64 stride,
                                                      i64 meta_off, unsigned late,
                                                      const float* w_area, bool producer) {
    const char* row = rows + (s * tokens + t) * stride;
    CombineToken c;
    c.tok = producer ? ld_cg_i32(row + meta_off) : (int)t;
    c.first = k_lane(fan + (s * tokens + t) * top_k,
                     combine_w_at(row, meta_off, top_k, late, w_area, s, t, tokens), top_k, 0);
    return c;
}

// nvl_combine_fused with a warp per item (see the top of this file); the same arguments.
template <typename T>
__device__ void nvl_combine_fused_warp(const unsigned* w_flags, unsigned* state, u64 timeout_ns,
                                       const char* rows, const char* partials,
                                       const unsigned* flags, i64 rank, const T* y,
                                       const i32* fan, const i32* sent_pos, T* out, i64 tokens,
                                       i64 top_k, i64 world, i64 width, i64 stride, i64 meta_off,
                                       unsigned late, const float* w_area, const u64* peer_sym,
                                       i64 partials_off, i64 chunk_flags_off, i64 chunk, i64 lag,
                                       unsigned* status) {
    const unsigned epoch = *(volatile unsigned*)state;
    const i64 n = (tokens + chunk - 1) / chunk;
    const i64 row_bytes = width * (i64)sizeof(T);
    const int lane = lane_id();
    for (;;) {
        const Item it = item_of(warp_ticket(state + 6), n, world - 1, 1, lag);
        if (!it.valid) break;
        const i64 t0 = it.chunk * chunk, t1 = t0 + chunk < tokens ? t0 + chunk : tokens;
        // Producer: partials of source s; consumer: this rank's own tokens.
        const i64 s = it.consumer ? rank : (rank + 1 + it.index) % world;
        const bool producer = !it.consumer;
        // Late weights: only source s's (this rank's own were raised earlier on this stream).
        if (late != 0)
            warp_wait_flag(w_flags + s, epoch, timeout_ns, status, MOE_GAVE_UP_COMBINE, s);
        if (it.consumer)
            warp_wait_strided(flags + it.chunk, world, n, rank, epoch, timeout_ns, status,
                              MOE_GAVE_UP_COMBINE, 0);
        CombineToken cur = combine_token(rows, fan, s, t0, tokens, top_k, stride, meta_off, late,
                                         w_area, producer);
        for (i64 t = t0; t < t1; ++t) {
            CombineToken next = cur;
            if (t + 1 < t1)
                next = combine_token(rows, fan, s, t + 1, tokens, top_k, stride, meta_off, late,
                                     w_area, producer);
            const i32* fan_row = fan + (s * tokens + t) * top_k;
            const char* w_at = combine_w_at(rows + (s * tokens + t) * stride, meta_off, top_k,
                                            late, w_area, s, t, tokens);
            if (it.consumer) {
                partial_sum_row<T, COMBINE_WARP_BATCH>(out + t * width, cur.first, fan_row, w_at,
                                                       y, top_k, width, partials, rank,
                                                       sent_pos + t * world, t, tokens, world,
                                                       lane, 32);
            } else if (cur.tok == t) {
                T* dst = (T*)((char*)peer_sym[s] + partials_off + (rank * tokens + t) * row_bytes);
                partial_row<T, COMBINE_WARP_BATCH>(dst, cur.first, fan_row, w_at, y, top_k, width,
                                                   lane, 32);
            }
            cur = next;
        }
        if (producer)
            warp_release_chunk(peer_sym, chunk_flags_off, world, rank, s, n, it.chunk, epoch);
    }
    if (grid_last_block<false>(state + 3)) {
        if (threadIdx.x == 0) state[6] = 0u;
    }
}

// ---- typed entry points: moe_nvl_combine_fused_warp_<T> ---------------------------------------

#define MF_KERNEL_moe_nvl_combine_fused_warp(T)                                                    \
    extern "C" __global__ void WARP_KERNEL moe_nvl_combine_fused_warp_##T(                         \
        MOE_FUSED_COMBINE_PARAMS(T)) {                                                             \
        nvl_combine_fused_warp<T>(w_flags, state, timeout_ns, rows, partials, flags, rank, y, fan, \
                                  sent_pos, out, tokens, top_k, world, width, stride, meta_off,    \
                                  late, w_area, peer_sym, partials_off, chunk_flags_off, chunk,    \
                                  lag, status);                                                    \
    }
