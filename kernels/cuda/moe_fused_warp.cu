#line 1 "moe_fused_warp.cu"
// moe_fused_warp.cu: the warp-per-item fused NVLink dispatch (appended after moe_fused.cu, whose
// protocol and helpers it uses; host side: kernels/src/moe/fused.rs, FusedDispatchKernel::Warp).
//
// The protocol of nvl_dispatch_fused unchanged (fixed slots, -1 markers, per-chunk release
// flags, the same items in the same ticket order, the same last-block epilogue), but every WARP
// takes tickets and runs its item alone: a producer warp routes its chunk's tokens, writes them
// (wire rows at the peers, its own fan-out) and releases the chunk; a consumer warp waits for
// the chunk of its source and fans its rows out. There is no block-wide barrier in the loop:
// while one warp waits for a load (routing, atomics, the row), the other warps of the SM have
// theirs in flight.
//
// Within a token the warp loads its first WARP_BATCH 16-byte vectors per lane of the row before
// it routes (sender, native rows) or reads the metadata (receiver), and a receiver reads the
// token field and the expert ids in one round trip: a token costs about one dependent memory
// round trip fewer on each side than in the block kernels. The values written are the block
// kernels' bit for bit (the same quantize16 / dequantize16 / fp8_scale, per-token amax over the
// whole row, per-128-channel amax over 8 lanes of consecutive chunks).
//
// Launched with WARP_THREADS threads per block (small blocks spread a small T over many SMs);
// kernels/src/moe/fused.rs picks the grid.

#define WARP_THREADS 64
#define WARP_KERNEL __launch_bounds__(WARP_THREADS, 8)
#define WARPS_PER_BLOCK (WARP_THREADS / 32)
// 16-byte vectors per lane and round of loads of a warp row copy (8 spills at 128 registers).
#define WARP_BATCH 4

// The shared destinations of one warp's current row.
struct WarpSlots {
    RowTargets to;
    char* meta_rows[32];
};

// A ticket for the warp (every lane gets the same value).
__device__ __forceinline__ i64 warp_ticket(unsigned* counter) {
    unsigned q = 0u;
    if (lane_id() == 0) q = atomicAdd(counter, 1u);
    return (i64)__shfl_sync(FULL_MASK, q, 0);
}

// block_wait_strided for a warp: lane 0 waits (wait_strided), then the warp proceeds.
__device__ void warp_wait_strided(const unsigned* flags, i64 n, i64 stride, i64 skip,
                                  unsigned epoch, u64 timeout_ns, unsigned* status,
                                  unsigned phase, i64 peer0) {
    if (lane_id() == 0)
        wait_strided(flags, n, stride, skip, epoch, timeout_ns, status, phase, peer0);
    __syncwarp();
}

// Lane 0 waits until *flag (team rank peer's) reaches `epoch`, then the warp proceeds.
__device__ void warp_wait_flag(const unsigned* flag, unsigned epoch, u64 timeout_ns,
                               unsigned* status, unsigned phase, i64 peer) {
    warp_wait_strided(flag, 1, 0, -1, epoch, timeout_ns, status, phase, peer);
}

// release_chunk for a warp: release_chunk_flags after the warp's stores of chunk c (peer == -1:
// at every other rank, else at that one).
__device__ void warp_release_chunk(const u64* peer_sym, i64 flags_off, i64 world, i64 rank,
                                   i64 peer, i64 n, i64 c, unsigned epoch) {
    __syncwarp();
    if (lane_id() == 0) release_chunk_flags(peer_sym, flags_off, world, rank, peer, n, c, epoch);
    __syncwarp();
}

// The lane's vectors base + lane + 32 u (u < WARP_BATCH, below nv) of src.
template <bool SHARED>
__device__ __forceinline__ void warp_load_batch(const char* src, i64 nv, i64 base, U128* v) {
#pragma unroll
    for (int u = 0; u < WARP_BATCH; ++u) {
        const i64 i = base + lane_id() + 32 * u;
        if (i < nv) v[u] = ld_v4<SHARED>(src + 16 * i);
    }
}

// The lane's FP8 chunks base + lane + 32 u of the wire row at src, and their scales.
__device__ __forceinline__ void warp_load_fp8(const char* src, i64 chunks, i64 base,
                                              unsigned wire, i64 scale_off, U128* c, float* s) {
#pragma unroll
    for (int u = 0; u < WARP_BATCH; ++u) {
        const i64 i = base + lane_id() + 32 * u;
        if (i < chunks) {
            c[u] = ld_cg_v4(src + 16 * i);
            s[u] = ld_cg_f32(src + scale_off + 4 * (wire == WIRE_FP8_TOKEN ? 0 : i >> 3));
        }
    }
}

// The lane's vectors base + lane + 32 u of v stored to the n rows dst[0..n).
__device__ __forceinline__ void warp_store_batch(const U128* v, i64 nv, i64 base,
                                                 char* const* dst, int n) {
    for (int d = 0; d < n; ++d) {
        char* o = dst[d];
#pragma unroll
        for (int u = 0; u < WARP_BATCH; ++u) {
            const i64 i = base + lane_id() + 32 * u;
            if (i < nv) st_v4(o + 16 * i, v[u]);
        }
    }
}

// The warp copies `bytes` from src to the n rows dst[0..n) (block_copy_multi for one warp).
// pre: the first batch (warp_load_batch at base 0) when `have` (src aligned, bytes % 16 == 0).
template <bool SHARED>
__device__ __forceinline__ void warp_copy_multi(const char* src, i64 bytes, char* const* dst,
                                                int n, const U128* pre, bool have) {
    if (n == 0) return;
    if (rows_aligned(src, bytes, dst, n)) {
        const i64 nv = bytes >> 4;
        i64 base = 0;
        if (have) {
            warp_store_batch(pre, nv, 0, dst, n);
            base = 32 * WARP_BATCH;
        }
        for (; base < nv; base += 32 * WARP_BATCH) {
            U128 v[WARP_BATCH];
            warp_load_batch<SHARED>(src, nv, base, v);
            warp_store_batch(v, nv, base, dst, n);
        }
    } else {
        for (i64 i = lane_id(); i < (bytes >> 1); i += 32) {
            const unsigned short v =
                SHARED ? ld_cg_u16(src + 2 * i) : ((const unsigned short*)src)[i];
            for (int d = 0; d < n; ++d) ((unsigned short*)dst[d])[i] = v;
        }
    }
}

// block_quantize_multi for one warp: lane l handles the 16-element chunks l + 32 m, QB of them
// per round of loads; with block scales the lanes 8g .. 8g + 7 share one 128-channel block.
template <typename T, int QB>
__device__ void warp_quantize_multi(const T* x_row, i64 h, unsigned wire, i64 scale_off,
                                    const RowTargets& to) {
    const int lane = lane_id();
    const i64 chunks = h >> 4;
    const int n = to.n, nw = to.n_wire;
    float row_scale = 1.0f;
    if (wire == WIRE_FP8_TOKEN) {
        float amax = 0.0f;
        for (i64 base = lane; base < chunks; base += 32 * QB) {
            float v[QB][16];
#pragma unroll
            for (int u = 0; u < QB; ++u)
                if (base + 32 * u < chunks) load16(x_row + 16 * (base + 32 * u), v[u]);
#pragma unroll
            for (int u = 0; u < QB; ++u)
                if (base + 32 * u < chunks) {
#pragma unroll
                    for (int j = 0; j < 16; ++j) amax = amax_finite(amax, v[u][j]);
                }
        }
        row_scale = fp8_scale(group_max(amax, 32));
        for (int d = lane; d < nw; d += 32) *(float*)(to.row[d] + scale_off) = row_scale;
    }
    for (i64 base = 0; base < chunks; base += 32 * QB) {
        float v[QB][16];
#pragma unroll
        for (int u = 0; u < QB; ++u) {
            const i64 c = base + lane + 32 * u;
            if (c < chunks) load16(x_row + 16 * c, v[u]);
        }
#pragma unroll
        for (int u = 0; u < QB; ++u) {
            const i64 c = base + lane + 32 * u;
            const bool active = c < chunks;
            float scale = row_scale;
            if (wire == WIRE_FP8_BLOCK) {
                float amax = 0.0f;
                if (active) {
#pragma unroll
                    for (int j = 0; j < 16; ++j) amax = amax_finite(amax, v[u][j]);
                }
                scale = fp8_scale(group_max(amax, 8));
            }
            if (active) {
                const U128 codes = quantize16(v[u], scale);
                for (int d = 0; d < nw; ++d) {
                    st_v4(to.row[d] + 16 * c, codes);
                    if (wire == WIRE_FP8_BLOCK && (c & 7) == 0)
                        ((float*)(to.row[d] + scale_off))[c >> 3] = scale;
                }
                if (n > nw) {
                    Pack16<T> o;
                    dequantize16<T>(codes, scale, o.v);
                    for (int d = nw; d < n; ++d) *(Pack16<T>*)((T*)to.row[d] + 16 * c) = o;
                }
            }
        }
    }
}

// The lane's FP8 chunks base + lane + 32 u (codes c, scales s) dequantized into every row of `to`.
template <typename T>
__device__ __forceinline__ void warp_dequant_batch(const U128* c, const float* s, i64 chunks,
                                                   i64 base, const RowTargets& to) {
#pragma unroll
    for (int u = 0; u < WARP_BATCH; ++u) {
        const i64 i = base + lane_id() + 32 * u;
        if (i < chunks) {
            Pack16<T> o;
            dequantize16<T>(c[u], s[u], o.v);
            for (int d = 0; d < to.n; ++d) *(Pack16<T>*)((T*)to.row[d] + 16 * i) = o;
        }
    }
}

// The warp writes the payload of the wire row at src into every expert row of `to`
// (block_read_payload for one warp); pre: the first batch of a native row when `have`.
template <typename T>
__device__ __forceinline__ void warp_read_payload(const char* src, i64 h, unsigned wire,
                                                  i64 scale_off, const RowTargets& to,
                                                  const U128* pre, bool have) {
    const int n = to.n;
    if (n == 0) return;
    if (wire == WIRE_NATIVE) {
        warp_copy_multi<true>(src, h * (i64)sizeof(T), to.row, n, pre, have);
        return;
    }
    const i64 chunks = h >> 4;
    for (i64 base = 0; base < chunks; base += 32 * WARP_BATCH) {
        U128 c[WARP_BATCH];
        float s[WARP_BATCH];
        warp_load_fp8(src, chunks, base, wire, scale_off, c, s);
        warp_dequant_batch<T>(c, s, chunks, base, to);
    }
}

// The warp writes token row x_row into the wire and expert rows of `to`
// (block_write_payload for one warp); pre: the first batch of a native row when `have`.
template <typename T, int QB>
__device__ __forceinline__ void warp_write_payload(const T* x_row, i64 h, unsigned wire,
                                                   i64 scale_off, const RowTargets& to,
                                                   const U128* pre, bool have) {
    if (wire == WIRE_NATIVE)
        warp_copy_multi<false>((const char*)x_row, h * (i64)sizeof(T), to.row, to.n, pre, have);
    else
        warp_quantize_multi<T, QB>(x_row, h, wire, scale_off, to);
}

// route_and_send_token<T, true> (fixed positions) for one warp: the same atomics, positions,
// -1 markers, metadata, wire payloads and own fan-out, in the warp's slots `ws`.
template <typename T, int QB>
__device__ void warp_send_token(i64 t, const PeerRowAt& row_at, const T* x, const i32* topk_idx,
                                const float* weights, i64 tokens, i64 top_k, i64 experts,
                                i64 local_experts, i64 world, i64 rank, i64 hidden,
                                unsigned wire, i64 scale_off, i64 meta_off, i32* cnt,
                                i32* sent_pos, unsigned* status, const OwnFanOut& own,
                                WarpSlots& ws) {
    const int lane = lane_id();
    const i64 row_bytes = hidden * (i64)sizeof(T);
    const i32* idx = topk_idx + t * top_k;
    const T* x_row = x + t * hidden;
    RowTargets& to = ws.to;
    // The token's first expert ids and the first batch of its row (native), in one round trip.
    const int e_lane = lane < top_k ? idx[lane] : -1;
    const bool have = wire == WIRE_NATIVE && aligned16(x_row) && (row_bytes & 15) == 0;
    U128 pre[WARP_BATCH];
    if (have) warp_load_batch<false>((const char*)x_row, row_bytes >> 4, 0, pre);
    bool own_sent = false;
    for (i64 r0 = 0; r0 < world; r0 += 32) {
        const bool own_chunk = rank >= r0 && rank < r0 + 32;
        unsigned bits = 0u;
        bool bad = false;
        for (i64 k = lane; k < top_k; k += 32) {
            const int e = k == lane ? e_lane : idx[k];
            if (e < 0 || e >= experts) {
                bad = true;
            } else {
                const i64 r = e / local_experts;
                if (r >= r0 && r < r0 + 32) bits |= 1u << (r - r0);
            }
        }
        bits = warp_or(bits);
        if (__any_sync(FULL_MASK, bad) && r0 == 0 && lane == 0) atomicOr(status, MOE_BAD_EXPERT);
        const i64 r = r0 + lane;
        const bool hit = r < world && ((bits >> lane) & 1u) != 0u;
        char* row = 0;
        if (hit) {
            atomicAdd(cnt + r, 1);
            row = row_at(r, t);
        } else if (r < world) {
            *(i32*)(row_at(r, t) + meta_off) = -1;
        }
        if (r < world) sent_pos[t * world + r] = hit ? (i32)t : -1;
        const unsigned m = __ballot_sync(FULL_MASK, hit);
        if (hit) ws.meta_rows[__popc(m & lanes_below())] = row;
        const unsigned mr = __ballot_sync(FULL_MASK, hit && r != rank);
        if (hit && r != rank) to.row[__popc(mr & lanes_below())] = row;
        const int n_wire = __popc(mr);
        int n_own = 0;
        if (own_chunk && ((bits >> (rank - r0)) & 1u) != 0u) {
            n_own = take_expert_rows(e_lane, 0, top_k, experts, local_experts, rank, own.capacity,
                                     (i32)(rank * tokens + t), own.expert_x, row_bytes,
                                     own.routing, own.fan + (rank * tokens + t) * top_k, own.ecnt,
                                     status, to, n_wire);
            own_sent = true;
        }
        if (lane == 0) {
            to.n_wire = n_wire;
            to.n = n_wire + n_own;
        }
        __syncwarp();
        if (n_wire + n_own > 0)
            warp_write_payload<T, QB>(x_row, hidden, wire, scale_off, to, pre, have && r0 == 0);
        const int nm = __popc(m);
        const float* w = weights != 0 ? weights + t * top_k : 0;
        const i64 words = 1 + 2 * top_k;
        for (i64 q = lane; q < nm * words; q += 32) {
            const i64 d = q / words, o = q - d * words;
            char* meta = ws.meta_rows[d] + meta_off;
            if (o == 0) {
                *(i32*)meta = (i32)t;
            } else if (o <= top_k) {
                ((i32*)meta)[o] = idx[o - 1];
            } else {
                ((float*)meta)[o] = w != 0 ? w[o - 1 - top_k] : 0.0f;
            }
        }
        __syncwarp();
    }
    // The own fan-out of k past the first 32 (K > 32).
    for (i64 k0 = 32; own_sent && k0 < top_k; k0 += 32) {
        const int e = k0 + lane < top_k ? idx[k0 + lane] : -1;
        const int n_own = take_expert_rows(e, k0, top_k, experts, local_experts, rank,
                                           own.capacity, (i32)(rank * tokens + t), own.expert_x,
                                           row_bytes, own.routing,
                                           own.fan + (rank * tokens + t) * top_k, own.ecnt,
                                           status, to, 0);
        if (lane == 0) {
            to.n_wire = 0;
            to.n = n_own;
        }
        __syncwarp();
        if (n_own > 0) warp_write_payload<T, QB>(x_row, hidden, wire, scale_off, to, pre, false);
        __syncwarp();
    }
}

// fan_out_slot for one warp: the row in slot t of source s to the local experts; returns
// whether the slot held a row (the same in every lane). The token field, the first 32 expert
// ids and the first batch of a native row are read together, before the slot is known to hold
// a row (holding an FP8 batch and its scales across the routing spills registers).
template <typename T>
__device__ bool warp_fan_out_slot(const char* rows, i64 s, i64 t, i64 tokens, i64 top_k,
                                  i64 experts, i64 local_experts, i64 rank, i64 capacity,
                                  i64 hidden, unsigned wire, i64 stride, i64 scale_off,
                                  i64 meta_off, T* expert_x, i32* routing, i32* fan, i32* ecnt,
                                  unsigned* status, RowTargets& to) {
    const int lane = lane_id();
    const char* row = rows + (s * tokens + t) * stride;
    const i64 row_bytes = hidden * (i64)sizeof(T);
    const bool have = wire == WIRE_NATIVE && aligned16(row) && (row_bytes & 15) == 0;
    U128 pre[WARP_BATCH];
    if (have) warp_load_batch<true>(row, row_bytes >> 4, 0, pre);
    const int tok = ld_cg_i32(row + meta_off);
    int e = lane < top_k ? ld_cg_i32(row + meta_off + 4 + 4 * lane) : -1;
    if (tok != t) {
        if (tok != -1 && lane == 0) atomicOr(status, MOE_BAD_ROUTING);
        return false;
    }
    for (i64 k0 = 0; k0 < top_k; k0 += 32) {
        if (k0 > 0) e = k0 + lane < top_k ? ld_cg_i32(row + meta_off + 4 + 4 * (k0 + lane)) : -1;
        const int n = take_expert_rows(e, k0, top_k, experts, local_experts, rank, capacity,
                                       (i32)(s * tokens + t), (char*)expert_x, row_bytes, routing,
                                       fan + (s * tokens + t) * top_k, ecnt, status, to, 0);
        if (lane == 0) {
            to.n_wire = 0;
            to.n = n;
        }
        __syncwarp();
        warp_read_payload<T>(row, hidden, wire, scale_off, to, pre, have && k0 == 0);
        __syncwarp();
    }
    return true;
}

// nvl_dispatch_fused with a warp per item (see the top of this file); the same arguments.
template <typename T, int QB>
__device__ void nvl_dispatch_fused_warp(const T* x, const i32* topk_idx, const float* weights,
                                        i64 tokens, i64 top_k, i64 experts, i64 local_experts,
                                        i64 world, i64 rank, i64 hidden, unsigned wire,
                                        i64 stride, i64 scale_off, i64 meta_off,
                                        const u64* peer_sym, i64 rows_off, i64 token_flags_off,
                                        char* sym, i64 counts_off, i64 chunk, i64 lag,
                                        u64 timeout_ns, i32* cnt, i32* recv_cnt, i32* sent_pos,
                                        unsigned* status, unsigned* state, const OwnFanOut& own,
                                        i32* expert_counts) {
    __shared__ WarpSlots slots[WARPS_PER_BLOCK];
    WarpSlots& ws = slots[threadIdx.x >> 5];
    const unsigned epoch = *(volatile unsigned*)state + 1u;
    const i64 n = (tokens + chunk - 1) / chunk;
    PeerRowAt at = {peer_sym, rows_off, rank, tokens, stride};
    const char* rows = sym + rows_off;
    const unsigned* flags = (const unsigned*)(sym + token_flags_off);
    for (;;) {
        const Item it = item_of(warp_ticket(state + 5), n, 1, world - 1, lag);
        if (!it.valid) break;
        const i64 t0 = it.chunk * chunk, t1 = t0 + chunk < tokens ? t0 + chunk : tokens;
        if (!it.consumer) {
            for (i64 t = t0; t < t1; ++t)
                warp_send_token<T, QB>(t, at, x, topk_idx, weights, tokens, top_k, experts,
                                       local_experts, world, rank, hidden, wire, scale_off,
                                       meta_off, cnt, sent_pos, status, own, ws);
            __syncwarp();
            if (lane_id() == 0)
                release_token_flags(peer_sym, token_flags_off, world, rank, tokens, t0, t1, epoch);
            __syncwarp();
        } else {
            const i64 s = (rank + 1 + it.index) % world;
            if (lane_id() == 0)
                wait_run(flags + s * tokens + t0, t1 - t0, epoch, timeout_ns, status,
                         MOE_GAVE_UP_DISPATCH, s);
            __syncwarp();
            int got = 0;
            for (i64 t = t0; t < t1; ++t)
                got += warp_fan_out_slot<T>(rows, s, t, tokens, top_k, experts, local_experts,
                                            rank, own.capacity, hidden, wire, stride, scale_off,
                                            meta_off, (T*)own.expert_x, own.routing, own.fan,
                                            own.ecnt, status, ws.to);
            if (lane_id() == 0 && got > 0) atomicAdd(recv_cnt + s, got);
        }
    }
    dispatch_fused_finish(local_experts, world, rank, sym, counts_off, cnt, recv_cnt, state, own,
                          expert_counts, epoch);
}

// ---- typed entry points: moe_nvl_dispatch_fused_warp_{native,fp8t,fp8b}_<T> -------------------

#define MOE_FUSED_WARP_BODY(T, WIRE, QB)                                                           \
    {                                                                                              \
        OwnFanOut own = {(char*)expert_x, routing, fan, ecnt, capacity};                           \
        nvl_dispatch_fused_warp<T, QB>(x, topk_idx, weights, tokens, top_k, experts,               \
                                       local_experts, world, rank, hidden, WIRE, stride,           \
                                       scale_off, meta_off, peer_sym, rows_off, token_flags_off,   \
                                       sym, counts_off, chunk, lag, timeout_ns, cnt, recv_cnt,     \
                                       sent_pos, status, state, own, expert_counts);               \
    }

#define MF_KERNEL_moe_nvl_dispatch_fused_warp_native(T)                                            \
    extern "C" __global__ void WARP_KERNEL moe_nvl_dispatch_fused_warp_native_##T(                 \
        MOE_FUSED_DISPATCH_PARAMS(T)) MOE_FUSED_WARP_BODY(T, WIRE_NATIVE, FP8_BATCH)
#define MF_KERNEL_moe_nvl_dispatch_fused_warp_fp8t(T)                                              \
    extern "C" __global__ void WARP_KERNEL moe_nvl_dispatch_fused_warp_fp8t_##T(                   \
        MOE_FUSED_DISPATCH_PARAMS(T)) MOE_FUSED_WARP_BODY(T, WIRE_FP8_TOKEN, 1)
#define MF_KERNEL_moe_nvl_dispatch_fused_warp_fp8b(T)                                              \
    extern "C" __global__ void WARP_KERNEL moe_nvl_dispatch_fused_warp_fp8b_##T(                   \
        MOE_FUSED_DISPATCH_PARAMS(T)) MOE_FUSED_WARP_BODY(T, WIRE_FP8_BLOCK, FP8_BATCH)
