#line 1 "moe_dispatch.cu"
// moe_dispatch.cu: the dispatch side of the MoE kernels of moe.cu (appended to it, whose helpers
// it uses; moe_combine.cu and the fused kernels, appended after this file, use the helpers here):
// the fan-out of a row to the local experts, the sender side (routing, wire rows, the own
// fan-out) and the receiver side (fan-out of the received rows, padding rows zeroed), and the
// entry points of the split dispatch kernels (NCCL and NVLink). Host side:
// kernels/src/moe/kernel_calls.rs.

// ---- fan-out to local experts (warp 0 of a row kernel) ----------------------------------------

// Lane l of warp 0 considers k = k0 + l (when k < K) of a row of token g (team-global: source
// * T + t) whose expert id is e (-1: none): if expert e lives on this rank, the lane takes a
// row of it (atomic counter ecnt[le]; past C: MOE_OVERFLOW, dropped) and writes routing (g, k).
// fan_row[k] = that row or -1. The taken rows are appended to to.row[first ..]; returns their
// number (the same in every lane).
__device__ int take_expert_rows(int e, i64 k0, i64 top_k, i64 experts, i64 local_experts,
                                i64 rank, i64 capacity, i32 g, char* expert_x, i64 row_bytes,
                                i32* routing, i32* fan_row, i32* ecnt, unsigned* status,
                                RowTargets& to, int first) {
    const int lane = lane_id();
    const i64 k = k0 + lane;
    int f = -1;
    char* dst = 0;
    if (k < top_k) {
        if (e >= 0 && e < experts && e / local_experts == rank) {
            const i64 le = e - rank * local_experts;
            const int slot = atomicAdd(ecnt + le, 1);
            if (slot < capacity) {
                const i64 r = le * capacity + slot;
                store_pair(routing + r * 2, g, (i32)k);
                dst = expert_x + r * row_bytes;
                f = (int)r;
            } else {
                atomicOr(status, MOE_OVERFLOW);
            }
        }
        fan_row[k] = f;
    }
    const unsigned m = __ballot_sync(FULL_MASK, f >= 0);
    if (f >= 0) to.row[first + __popc(m & lanes_below())] = dst;
    return __popc(m);
}

// ---- dispatch, sender side ------------------------------------------------------------------

// Where the sender fans its own tokens out: this rank's local experts (the receiver side of
// the dispatch never sees this rank's own rows).
struct OwnFanOut {
    char* expert_x;
    i32* routing;
    i32* fan;
    i32* ecnt;
    i64 capacity;
};

// One block per token t: for every destination r hosting any valid expert of t, warp 0
// reserves position `pos` in r's rows (atomic on the local counter cnt[r]; sent_pos[t * W + r]
// = pos or -1) and the block writes the metadata of the wire row at row_at(r, pos) (token, K
// expert ids, K weights or zeros). Wire rows of other ranks also get the payload (scales);
// this rank's own row gets none: the block fans the token out to the local experts itself
// (expert_x, routing, fan[(rank * T + pos) * K + k], as a receiver would), reading the token
// once for all of them. Invalid expert ids raise MOE_BAD_EXPERT and are skipped.
//
// FIXED (the fused NVLink kernels, moe_fused.cu): the position of token t is t itself (cnt[r]
// only counts the rows), and every destination the token does not go to gets the token field
// -1 in its row t, so that a receiver can tell an empty slot from a stale one. QB: see
// block_write_payload.
template <typename T, bool FIXED, typename RowAt, int QB = FP8_BATCH>
__device__ void route_and_send_token(i64 t, RowAt row_at, const T* x, const i32* topk_idx,
                                     const float* weights, i64 tokens, i64 top_k, i64 experts,
                                     i64 local_experts, i64 world, i64 rank, i64 hidden,
                                     unsigned wire, i64 scale_off, i64 meta_off, i32* cnt,
                                     i32* sent_pos, unsigned* status, const OwnFanOut& own) {
    __shared__ RowTargets to;
    __shared__ char* meta_rows[32];
    // own_pos: this rank's position of the token (or -1), written by warp 0 in the chunk of
    // ranks holding this rank and read by every thread after that chunk's first barrier (the
    // next write follows the chunk's second barrier).
    __shared__ int n_meta, own_pos;
    const int lane = lane_id();
    const i64 row_bytes = hidden * (i64)sizeof(T);
    {
        const i32* idx = topk_idx + t * top_k;
        const T* x_row = x + t * hidden;
        int p_own = -1;
        for (i64 r0 = 0; r0 < world; r0 += 32) {
            const bool own_chunk = rank >= r0 && rank < r0 + 32;
            if (threadIdx.x < 32) {
                unsigned bits = 0u;
                bool bad = false;
                for (i64 k = lane; k < top_k; k += 32) {
                    const int e = idx[k];
                    if (e < 0 || e >= experts) {
                        bad = true;
                    } else {
                        const i64 r = e / local_experts;
                        if (r >= r0 && r < r0 + 32) bits |= 1u << (r - r0);
                    }
                }
                bits = warp_or(bits);
                if (__any_sync(FULL_MASK, bad) && r0 == 0 && lane == 0)
                    atomicOr(status, MOE_BAD_EXPERT);
                const i64 r = r0 + lane;
                const bool hit = r < world && ((bits >> lane) & 1u) != 0u;
                int pos = -1;
                char* row = 0;
                if (hit) {
                    pos = FIXED ? (atomicAdd(cnt + r, 1), (int)t) : atomicAdd(cnt + r, 1);
                    row = row_at(r, pos);
                } else if (FIXED && r < world) {
                    *(i32*)(row_at(r, t) + meta_off) = -1;
                }
                if (r < world) sent_pos[t * world + r] = pos;
                const unsigned m = __ballot_sync(FULL_MASK, hit);
                if (hit) meta_rows[__popc(m & lanes_below())] = row;
                const unsigned mr = __ballot_sync(FULL_MASK, hit && r != rank);
                if (hit && r != rank) to.row[__popc(mr & lanes_below())] = row;
                const int n_wire = __popc(mr);
                int n_own = 0;
                const bool own_here = own_chunk && ((bits >> (rank - r0)) & 1u) != 0u;
                if (own_chunk && lane == 0) own_pos = -1;
                if (own_here) {
                    const int p = __shfl_sync(FULL_MASK, pos, (int)(rank - r0));
                    const int e = lane < top_k ? idx[lane] : -1;
                    n_own = take_expert_rows(e, 0, top_k, experts, local_experts, rank,
                                             own.capacity, (i32)(rank * tokens + t), own.expert_x,
                                             row_bytes, own.routing, own.fan + (rank * tokens + p) * top_k,
                                             own.ecnt, status, to, n_wire);
                    if (lane == 0) own_pos = p;
                }
                if (lane == 0) {
                    n_meta = __popc(m);
                    to.n_wire = n_wire;
                    to.n = n_wire + n_own;
                }
            }
            __syncthreads();
            if (own_chunk) p_own = own_pos;
            if (to.n > 0) block_write_payload<T, QB>(x_row, hidden, wire, scale_off, to);
            const int n = n_meta;
            const float* w = weights != 0 ? weights + t * top_k : 0;
            const i64 words = 1 + 2 * top_k;
            for (i64 q = threadIdx.x; q < n * words; q += blockDim.x) {
                const i64 d = q / words, o = q - d * words;
                char* meta = meta_rows[d] + meta_off;
                if (o == 0) {
                    *(i32*)meta = (i32)t;
                } else if (o <= top_k) {
                    ((i32*)meta)[o] = idx[o - 1];
                } else {
                    ((float*)meta)[o] = w != 0 ? w[o - 1 - top_k] : 0.0f;
                }
            }
            __syncthreads();
        }
        // The own fan-out of k past the first 32 (K > 32).
        const int p = p_own;
        for (i64 k0 = 32; p >= 0 && k0 < top_k; k0 += 32) {
            if (threadIdx.x < 32) {
                const int e = k0 + lane < top_k ? idx[k0 + lane] : -1;
                const int n_own = take_expert_rows(e, k0, top_k, experts, local_experts, rank,
                                                   own.capacity, (i32)(rank * tokens + t),
                                                   own.expert_x, row_bytes, own.routing,
                                                   own.fan + (rank * tokens + p) * top_k, own.ecnt,
                                                   status, to, 0);
                if (lane == 0) {
                    to.n_wire = 0;
                    to.n = n_own;
                }
            }
            __syncthreads();
            if (to.n > 0) block_write_payload<T, QB>(x_row, hidden, wire, scale_off, to);
            __syncthreads();
        }
    }
}

template <typename T, typename RowAt>
__device__ void route_and_send(RowAt row_at, const T* x, const i32* topk_idx, const float* weights,
                               i64 tokens, i64 top_k, i64 experts, i64 local_experts, i64 world,
                               i64 rank, i64 hidden, unsigned wire, i64 scale_off, i64 meta_off,
                               i32* cnt, i32* sent_pos, unsigned* status, const OwnFanOut& own) {
    for (i64 t = blockIdx.x; t < tokens; t += gridDim.x)
        route_and_send_token<T, false>(t, row_at, x, topk_idx, weights, tokens, top_k, experts,
                                       local_experts, world, rank, hidden, wire, scale_off,
                                       meta_off, cnt, sent_pos, status, own);
}

struct BlockRowAt {
    char* send;
    i64 block_bytes, stride;
    __device__ char* operator()(i64 r, i64 pos) const { return send + r * block_bytes + 16 + pos * stride; }
};

struct PeerRowAt {
    const u64* peer_sym;
    i64 rows_off, rank, tokens, stride;
    __device__ char* operator()(i64 r, i64 pos) const {
        return (char*)peer_sym[r] + rows_off + (rank * tokens + pos) * stride;
    }
};

// NCCL: rows into per-destination blocks [16-byte header: count][T rows]; the last block writes
// the headers and zeroes the counters.
template <typename T>
__device__ void nccl_dispatch_send(const T* x, const i32* topk_idx, const float* weights,
                                   i64 tokens, i64 top_k, i64 experts, i64 local_experts,
                                   i64 world, i64 hidden, unsigned wire, i64 stride, i64 scale_off,
                                   i64 meta_off, char* send, i64 block_bytes, i32* cnt,
                                   i32* sent_pos, unsigned* status, unsigned* done, i64 rank,
                                   const OwnFanOut& own) {
    BlockRowAt at = {send, block_bytes, stride};
    route_and_send<T>(at, x, topk_idx, weights, tokens, top_k, experts, local_experts, world, rank,
                      hidden, wire, scale_off, meta_off, cnt, sent_pos, status, own);
    if (grid_last_block(done)) {
        for (i64 r = threadIdx.x; r < world; r += blockDim.x) {
            *(i32*)(send + r * block_bytes) = ld_relaxed_gpu(cnt + r);
            cnt[r] = 0;
        }
    }
}

// NVLink: rows straight into every receiver's area rows[W][T] (slot [rank][pos]); the last block
// writes each receiver's count slot [rank], zeroes the counters, raises the receivers' dispatch
// flags [rank] = epoch and stores the epoch for the later phases of this step.
template <typename T>
__device__ void nvl_dispatch_send(const T* x, const i32* topk_idx, const float* weights,
                                  i64 tokens, i64 top_k, i64 experts, i64 local_experts, i64 world,
                                  i64 rank, i64 hidden, unsigned wire, i64 stride, i64 scale_off,
                                  i64 meta_off, const u64* peer_sym, i64 rows_off, i64 counts_off,
                                  i64 flags_off, i32* cnt, i32* sent_pos, unsigned* status,
                                  unsigned* state, const OwnFanOut& own) {
    const unsigned epoch = *(volatile unsigned*)state + 1u;
    PeerRowAt at = {peer_sym, rows_off, rank, tokens, stride};
    route_and_send<T>(at, x, topk_idx, weights, tokens, top_k, experts, local_experts, world, rank,
                      hidden, wire, scale_off, meta_off, cnt, sent_pos, status, own);
    if (grid_last_block(state + 1)) {
        for (i64 r = threadIdx.x; r < world; r += blockDim.x) {
            ((i32*)((char*)peer_sym[r] + counts_off))[rank] = ld_relaxed_gpu(cnt + r);
            cnt[r] = 0;
        }
        __threadfence_system();
        raise_peer_flags(peer_sym, flags_off, world, rank, epoch);
        if (threadIdx.x == 0) *(volatile unsigned*)state = epoch;
    }
}

// ---- dispatch, receiver side (both transports) ------------------------------------------------

// Where the rows and the count of source s lie: for s == rank in `own`, else in `other`; rows of
// s start at base + s * block_bytes + row_off, its count (i32) at cnt_base + s * cnt_stride.
struct Sources {
    const char* own_rows;
    const char* other_rows;
    i64 block_bytes, row_off;
    const char* own_cnt;
    const char* other_cnt;
    i64 cnt_stride;
    i64 rank;
    __device__ const char* rows(i64 s) const {
        return (s == rank ? own_rows : other_rows) + s * block_bytes + row_off;
    }
    __device__ int count(i64 s) const {
        return ld_cg_i32((s == rank ? own_cnt : other_cnt) + s * cnt_stride);
    }
};

// The number of valid rows of source s (out-of-range counts raise MOE_BAD_ROUTING, clamped).
__device__ __forceinline__ i64 valid_rows(const Sources& src, i64 s, i64 tokens, unsigned* status,
                                          bool report) {
    int n = src.count(s);
    if (n < 0 || n > tokens) {
        if (report) atomicOr(status, MOE_BAD_ROUTING);
        n = n < 0 ? 0 : (int)tokens;
    }
    return n;
}

// One block per row (s, j) received from another rank s (this rank's own rows carry no payload:
// the sender fanned them out already): for the k (in chunks of 32, lane k of warp 0) whose
// expert lives here, a row of that local expert (atomic counter ecnt[le]; dropped past C with
// MOE_OVERFLOW) gets the routing (s * T + t, k); fan[(s * T + j) * K + k] = that expert row, or
// -1. The block then reads the row's payload once and writes it to all those expert rows. The
// last block writes counts[le] = min(ecnt[le], C) and zeroes ecnt.
template <typename T>
__device__ void fan_out(const Sources& src, i64 tokens, i64 top_k, i64 experts, i64 local_experts,
                        i64 world, i64 capacity, i64 hidden, unsigned wire, i64 stride,
                        i64 scale_off, i64 meta_off, T* expert_x, i32* routing, i32* fan, i32* ecnt,
                        i32* counts, unsigned* status, unsigned* done) {
    __shared__ RowTargets to;
    const int lane = lane_id();
    const i64 rank = src.rank;
    const i64 row_bytes = hidden * (i64)sizeof(T);
    for (i64 item = blockIdx.x; item < world * tokens; item += gridDim.x) {
        const i64 s = item / tokens, j = item - s * tokens;
        if (s == rank) continue;  // the sender fanned its own tokens out
        if (j >= valid_rows(src, s, tokens, status, threadIdx.x == 0 && j == 0)) continue;
        const char* row = src.rows(s) + j * stride;
        for (i64 k0 = 0; k0 < top_k; k0 += 32) {
            if (threadIdx.x < 32) {
                const i64 t = ld_cg_i32(row + meta_off);
                const bool token_ok = t >= 0 && t < tokens;
                if (!token_ok && lane == 0 && k0 == 0) atomicOr(status, MOE_BAD_ROUTING);
                const int e = token_ok && k0 + lane < top_k
                                  ? ld_cg_i32(row + meta_off + 4 + 4 * (k0 + lane))
                                  : -1;
                const int n = take_expert_rows(e, k0, top_k, experts, local_experts, rank, capacity,
                                               (i32)(s * tokens + t), (char*)expert_x, row_bytes,
                                               routing, fan + item * top_k, ecnt, status, to, 0);
                if (lane == 0) {
                    to.n_wire = 0;
                    to.n = n;
                }
            }
            __syncthreads();
            block_read_payload<T>(row, hidden, wire, scale_off, to);
            __syncthreads();
        }
    }
    if (grid_last_block(done)) {
        for (i64 le = threadIdx.x; le < local_experts; le += blockDim.x) {
            const int total = ld_relaxed_gpu(ecnt + le);
            counts[le] = total < capacity ? total : (i32)capacity;
            ecnt[le] = 0;
        }
    }
}

// Zeroes the padding rows [counts[le], hi) of every local expert, hi = prev[le] (rows past the
// previous step's count are already zero) or C when prev is null; routing alike.
extern "C" __global__ void moe_zero_padding(char* expert_x, i64 row_bytes, i32* routing,
                                            const i32* counts, const i32* prev, i64 local_experts,
                                            i64 capacity) {
    const int lane = lane_id();
    for (i64 r = warp_id(); r < local_experts * capacity; r += warp_count()) {
        const i64 le = r / capacity, j = r - le * capacity;
        const i64 hi = prev != 0 ? prev[le] : capacity;
        if (j < counts[le] || j >= hi) continue;
        warp_zero_row(expert_x + r * row_bytes, row_bytes, lane);
        if (lane == 0) store_pair(routing + r * 2, 0, 0);
    }
}

// ---- typed entry points ----------------------------------------------------------------------
//
// As in moe.cu: MF_KERNEL_<name>(T) defines the kernel <name>_<T>, instantiated by the host one
// compile unit at a time (kernels/src/kernels/units.rs).

#define MF_KERNEL_moe_nccl_dispatch_send(T)                                                        \
    extern "C" __global__ void ROW_KERNEL moe_nccl_dispatch_send_##T(                                         \
        const T* x, const i32* topk_idx, const float* weights, i64 tokens, i64 top_k,              \
        i64 experts, i64 local_experts, i64 world, i64 hidden, unsigned wire, i64 stride,           \
        i64 scale_off, i64 meta_off, char* send, i64 block_bytes, i32* cnt, i32* sent_pos,         \
        unsigned* status, unsigned* done, i64 rank, T* expert_x, i32* routing, i32* fan,          \
        i32* ecnt, i64 capacity) {                                                                 \
        OwnFanOut own = {(char*)expert_x, routing, fan, ecnt, capacity};                           \
        nccl_dispatch_send<T>(x, topk_idx, weights, tokens, top_k, experts, local_experts, world,  \
                              hidden, wire, stride, scale_off, meta_off, send, block_bytes, cnt,   \
                              sent_pos, status, done, rank, own);                                  \
    }
#define MF_KERNEL_moe_nvl_dispatch_send(T)                                                         \
    extern "C" __global__ void ROW_KERNEL moe_nvl_dispatch_send_##T(                                          \
        const T* x, const i32* topk_idx, const float* weights, i64 tokens, i64 top_k,              \
        i64 experts, i64 local_experts, i64 world, i64 rank, i64 hidden, unsigned wire,            \
        i64 stride, i64 scale_off, i64 meta_off, const u64* peer_sym, i64 rows_off,                \
        i64 counts_off, i64 flags_off, i32* cnt, i32* sent_pos, unsigned* status,                  \
        unsigned* state, T* expert_x, i32* routing, i32* fan, i32* ecnt, i64 capacity) {          \
        OwnFanOut own = {(char*)expert_x, routing, fan, ecnt, capacity};                           \
        nvl_dispatch_send<T>(x, topk_idx, weights, tokens, top_k, experts, local_experts, world,   \
                             rank, hidden, wire, stride, scale_off, meta_off, peer_sym, rows_off,  \
                             counts_off, flags_off, cnt, sent_pos, status, state, own);            \
    }
#define MF_KERNEL_moe_dispatch_recv(T)                                                             \
    /* flags == 0: no wait (NCCL); else wait for flags[W] >= state[0] first (NVLink). */           \
    extern "C" __global__ void ROW_KERNEL moe_dispatch_recv_##T(                                              \
        const unsigned* flags, const unsigned* state, u64 timeout_ns, const char* own_rows,        \
        const char* other_rows, i64 block_bytes, i64 row_off, const char* own_cnt,                 \
        const char* other_cnt, i64 cnt_stride, i64 rank, i64 tokens, i64 top_k, i64 experts,       \
        i64 local_experts, i64 world, i64 capacity, i64 hidden, unsigned wire, i64 stride,         \
        i64 scale_off, i64 meta_off, T* expert_x, i32* routing, i32* fan, i32* ecnt, i32* counts,  \
        unsigned* status, unsigned* done) {                                                        \
        if (flags != 0)                                                                            \
            block_wait_flags(flags, world, *state, timeout_ns, status, MOE_GAVE_UP_DISPATCH);      \
        Sources src = {own_rows, other_rows, block_bytes, row_off, own_cnt, other_cnt,             \
                       cnt_stride, rank};                                                          \
        fan_out<T>(src, tokens, top_k, experts, local_experts, world, capacity, hidden, wire,      \
                   stride, scale_off, meta_off, expert_x, routing, fan, ecnt, counts, status,      \
                   done);                                                                          \
    }
