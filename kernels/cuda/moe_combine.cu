#line 1 "moe_combine.cu"
// moe_combine.cu: the combine side of the MoE kernels of moe.cu (appended to it after
// moe_dispatch.cu, whose helpers it uses, Sources and valid_rows among them; moe_fused.cu and the
// warp kernels, appended after this file, use the helpers here): the partial rows of the expert
// side (one per received row: the weighted sum of its local expert rows in k order), the token
// side's rank-ordered sum of the partials, the NVLink late weights, and the entry points of the
// split combine kernels (NCCL and NVLink). Host side: kernels/src/moe/kernel_calls.rs.

// ---- combine, expert side ------------------------------------------------------------------
//
// A partial row is the sum over k (ascending) with fan_row[k] >= 0 of w[k] * y[fan_row[k]], in
// f32 with separate multiply and add from +0, rounded once to T. The threads sharing a row (a
// block, or one warp: tid < nt) split it into 16-byte vectors: in each round a thread takes the
// NV vectors base + tid + u * nt (u < NV) and loads them from up to 4 expert rows before it
// accumulates any (accumulate_experts). Every warp reads the row's fan and weights itself
// (lane l holds k = k0 + l, KLane) once per row, not once per round. The block kernels here run
// NV = 2 (the vectors of a round spread over the block), the fused block combine (moe_fused.cu)
// the NV of its block shape (1 or 2), the warp combine (moe_fused_warp_combine.cu)
// COMBINE_WARP_BATCH over 32 lanes. Which thread handles a vector never changes a sum: each
// element is summed in k order alone.

// Lane l's expert row (-1: none) and weight for k = k0 + l of one row.
struct KLane {
    int f;
    float w;
};

// The warp's k = k0 + lane of fan_row and the weights (f32 at w_at), both read in one round
// trip (the weight whatever the expert row: every k < top_k has one).
__device__ __forceinline__ KLane k_lane(const i32* fan_row, const char* w_at, i64 top_k, i64 k0) {
    const i64 k = k0 + lane_id();
    KLane r = {-1, 0.0f};
    if (k < top_k) {
        r.f = fan_row[k];
        r.w = ld_cg_f32(w_at + 4 * k);
    }
    return r;
}

// The 16-byte vectors v0 + u * nt (u < NV) of a row that one thread handles in a round: their
// byte offsets off + u * step, and which lie in the row (ok[u]: below nv).
template <int NV>
struct RowVecs {
    i64 off, step;
    bool ok[NV];
};

template <int NV>
__device__ __forceinline__ RowVecs<NV> row_vecs(i64 v0, i64 nt, i64 nv) {
    RowVecs<NV> r;
    r.off = 16 * v0;
    r.step = 16 * nt;
#pragma unroll
    for (int u = 0; u < NV; ++u) r.ok[u] = v0 + u * nt < nv;
    return r;
}

// acc[u] += w_k * y[f_k] at the thread's vectors `at` (acc[u] is garbage where !at.ok[u]) for
// every k of one 32-k chunk (kl: lane l's k) with f_k >= 0, in ascending k: up to 4 k per round,
// the vectors of every expert row of a round loaded before any is accumulated. Every lane of
// the warp calls it (shuffles).
template <typename T, int NV>
__device__ __forceinline__ void accumulate_experts(float (&acc)[NV][16 / sizeof(T)],
                                                   const RowVecs<NV>& at, KLane kl, const T* y,
                                                   i64 width) {
    const int VEC = 16 / (int)sizeof(T);
    unsigned m = __ballot_sync(FULL_MASK, kl.f >= 0);
    while (m != 0u) {
        int fs[4];
        float ws[4];
        int cnt = 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int l = m != 0u ? __ffs(m) - 1 : 0;
            fs[q] = __shfl_sync(FULL_MASK, kl.f, l);
            ws[q] = __shfl_sync(FULL_MASK, kl.w, l);
            if (m != 0u) {
                ++cnt;
                m &= m - 1u;
            }
        }
        U128 yv[4][NV];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (q < cnt) {
                const char* yr = (const char*)(y + (i64)fs[q] * width) + at.off;
#pragma unroll
                for (int u = 0; u < NV; ++u)
                    if (at.ok[u]) yv[q][u] = ld_nc_v4(yr + u * at.step);
            }
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (q < cnt) {
#pragma unroll
                for (int u = 0; u < NV; ++u) {
                    const Vec16<T> yy = *(const Vec16<T>*)&yv[q][u];
#pragma unroll
                    for (int e = 0; e < VEC; ++e)
                        acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(ws[q], to_f32(yy.v[e])));
                }
            }
        }
    }
}

// acc = the partial row (not rounded) at the thread's vectors `at`; first: the warp's
// k_lane(fan_row, w_at, top_k, 0) (later chunks of k, K > 32, are read here).
template <typename T, int NV>
__device__ __forceinline__ void weighted_sum(float (&acc)[NV][16 / sizeof(T)],
                                             const RowVecs<NV>& at, KLane first,
                                             const i32* fan_row, const char* w_at, const T* y,
                                             i64 top_k, i64 width) {
#pragma unroll
    for (int u = 0; u < NV; ++u) {
#pragma unroll
        for (int e = 0; e < 16 / (int)sizeof(T); ++e) acc[u][e] = 0.0f;
    }
    for (i64 k0 = 0; k0 < top_k; k0 += 32)
        accumulate_experts<T, NV>(acc, at, k0 == 0 ? first : k_lane(fan_row, w_at, top_k, k0), y,
                                  width);
}

// Column c of the partial row (not rounded), one element at a time (rows not 16-byte aligned).
template <typename T>
__device__ __forceinline__ float weighted_column(const i32* fan_row, const char* w_at, const T* y,
                                                 i64 top_k, i64 width, i64 c) {
    float acc = 0.0f;
    for (i64 k = 0; k < top_k; ++k) {
        const int f = fan_row[k];
        if (f < 0) continue;
        acc = __fadd_rn(acc, __fmul_rn(ld_cg_f32(w_at + 4 * k), to_f32(y[(i64)f * width + c])));
    }
    return acc;
}

// The 16-byte vector at dst: a rounded to T.
template <typename T>
__device__ __forceinline__ void store_rounded(char* dst, const float (&a)[16 / sizeof(T)]) {
    Vec16<T> o;
#pragma unroll
    for (int e = 0; e < 16 / (int)sizeof(T); ++e) o.v[e] = from_f32<T>(a[e]);
    st_v4(dst, *(const U128*)&o);
}

// The threads tid < nt sharing a row (every lane of their warps calls it) compute the partial
// row whose expert rows are fan_row[k] (or -1) and weights f32 at w_at into dst, rounded to T;
// first: the warp's k_lane(fan_row, w_at, top_k, 0).
template <typename T, int NV>
__device__ __forceinline__ void partial_row(T* dst, KLane first, const i32* fan_row,
                                            const char* w_at, const T* y, i64 top_k, i64 width,
                                            i64 tid, i64 nt) {
    const int VEC = 16 / (int)sizeof(T);
    if ((width % VEC) == 0 && aligned16(y) && aligned16(dst)) {
        const i64 nv = width / VEC;
        for (i64 base = 0; base < nv; base += NV * nt) {
            const RowVecs<NV> at = row_vecs<NV>(base + tid, nt, nv);
            float acc[NV][16 / sizeof(T)];
            weighted_sum<T, NV>(acc, at, first, fan_row, w_at, y, top_k, width);
#pragma unroll
            for (int u = 0; u < NV; ++u)
                if (at.ok[u]) store_rounded<T>((char*)dst + at.off + u * at.step, acc[u]);
        }
    } else {
        for (i64 c = tid; c < width; c += nt)
            dst[c] = from_f32<T>(weighted_column<T>(fan_row, w_at, y, top_k, width, c));
    }
}

// The block computes one partial row into dst (partial_row, NV vectors per thread and round).
template <typename T, int NV = 2>
__device__ void reduce_row(T* dst, const i32* fan_row, const char* w_at, const T* y, i64 top_k,
                           i64 width) {
    partial_row<T, NV>(dst, k_lane(fan_row, w_at, top_k, 0), fan_row, w_at, y, top_k, width,
                       threadIdx.x, blockDim.x);
}

// One block per received row (s, j): its partial row (reduce_row) stored at dst_at(s, j).
// Weights come from the wire row (given at dispatch) or, when `late`, from w_self (s == rank)
// / w_peers + s * T * K.
template <typename T, typename DstAt>
__device__ void reduce_partials(DstAt dst_at, const Sources& src, const T* y, const i32* fan,
                                i64 tokens, i64 top_k, i64 world, i64 width, i64 stride,
                                i64 meta_off, bool late, const float* w_self,
                                const float* w_peers, unsigned* status) {
    const i64 rank = src.rank;
    for (i64 item = blockIdx.x; item < world * tokens; item += gridDim.x) {
        const i64 s = item / tokens, j = item - s * tokens;
        if (j >= valid_rows(src, s, tokens, status, false)) continue;
        const char* row = src.rows(s) + j * stride;
        const i64 t = ld_cg_i32(row + meta_off);
        if (t < 0 || t >= tokens) continue;
        const char* w_at = late ? (const char*)((s == rank ? w_self : w_peers + s * tokens * top_k) +
                                                t * top_k)
                                : row + meta_off + 4 + 4 * top_k;
        reduce_row<T>((T*)dst_at(s, j), fan + item * top_k, w_at, y, top_k, width);
    }
}

struct LocalDstAt {
    char* send;
    i64 tokens, row_bytes;
    __device__ char* operator()(i64 s, i64 j) const { return send + (s * tokens + j) * row_bytes; }
};

struct PeerDstAt {
    const u64* peer_sym;
    i64 off, rank, tokens, row_bytes;
    __device__ char* operator()(i64 s, i64 j) const {
        return (char*)peer_sym[s] + off + (rank * tokens + j) * row_bytes;
    }
};

// ---- combine, token side -------------------------------------------------------------------

// out[t] = sum over r in ascending order with p = sent_pos[t * W + r] >= 0 of the partial at
// partial_at(r, p), in f32 from +0, rounded once to T.
template <typename T>
__device__ void sum_partials(const char* own, const char* other, i64 rank, const i32* sent_pos,
                             T* out, i64 tokens, i64 world, i64 width) {
    const int VEC = 16 / (int)sizeof(T);
    const bool vec = (width % VEC) == 0 && aligned16(out);
    const i64 per_token = vec ? width / VEC : width;
    const i64 row_bytes = width * (i64)sizeof(T);
    for (i64 c = thread_index(); c < tokens * per_token; c += thread_count()) {
        const i64 t = c / per_token, f0 = (c - t * per_token) * (vec ? VEC : 1);
        float acc[16 / sizeof(T)];
        for (int q = 0; q < VEC; ++q) acc[q] = 0.0f;
        for (i64 r = 0; r < world; ++r) {
            const i64 p = sent_pos[t * world + r];
            if (p < 0) continue;
            const char* row = (r == rank ? own : other) + (r * tokens + p) * row_bytes;
            if (vec) {
                const U128 raw = ld_cg_v4(row + f0 * (i64)sizeof(T));
                const Vec16<T> pv = *(const Vec16<T>*)&raw;
#pragma unroll
                for (int q = 0; q < VEC; ++q) acc[q] = __fadd_rn(acc[q], to_f32(pv.v[q]));
            } else {
                acc[0] = __fadd_rn(acc[0], to_f32(load_cg<T>(row + f0 * (i64)sizeof(T))));
            }
        }
        if (vec) {
            Vec16<T> o;
#pragma unroll
            for (int q = 0; q < VEC; ++q) o.v[q] = from_f32<T>(acc[q]);
            *(Vec16<T>*)(out + t * width + f0) = o;
        } else {
            out[t * width + f0] = from_f32<T>(acc[0]);
        }
    }
}

// ---- NVLink late weights ---------------------------------------------------------------------

// Copies this rank's weights [n = T * K] into slot [rank] of every peer's weight area; the last
// block raises the peers' weight flags [rank] = this step's epoch.
extern "C" __global__ void moe_nvl_weights_send(const float* weights, i64 n, i64 world, i64 rank,
                                                const u64* peer_sym, i64 w_off, i64 w_flags_off,
                                                unsigned* state) {
    const unsigned epoch = *(volatile unsigned*)state;
    for (i64 i = thread_index(); i < world * n; i += thread_count()) {
        const i64 r = i / n, q = i - r * n;
        ((float*)((char*)peer_sym[r] + w_off))[rank * n + q] = weights[q];
    }
    if (grid_last_block(state + 2)) raise_peer_flags(peer_sym, w_flags_off, world, rank, epoch);
}

// ---- typed entry points ----------------------------------------------------------------------
//
// As in moe.cu: MF_KERNEL_<name>(T) defines the kernel <name>_<T>, instantiated by the host one
// compile unit at a time (kernels/src/kernels/units.rs).

#define MF_KERNEL_moe_nccl_combine_send(T)                                                         \
    extern "C" __global__ void ROW_KERNEL moe_nccl_combine_send_##T(                                          \
        const char* own_rows, const char* other_rows, i64 block_bytes, i64 row_off,                \
        const char* own_cnt, const char* other_cnt, i64 cnt_stride, i64 rank, const T* y,          \
        const i32* fan, i64 tokens, i64 top_k, i64 world, i64 width, i64 stride, i64 meta_off,     \
        unsigned late, const float* w_self, const float* w_peers, char* send, unsigned* status) {  \
        Sources src = {own_rows, other_rows, block_bytes, row_off, own_cnt, other_cnt,             \
                       cnt_stride, rank};                                                          \
        LocalDstAt at = {send, tokens, width * (i64)sizeof(T)};                                    \
        reduce_partials<T>(at, src, y, fan, tokens, top_k, world, width, stride, meta_off,         \
                           late != 0, w_self, w_peers, status);                                    \
    }
#define MF_KERNEL_moe_nvl_combine_send(T)                                                          \
    /* late != 0: wait for the weight flags (>= state[0]) first. The last block raises the */      \
    /* sources' combine flags. */                                                                  \
    extern "C" __global__ void ROW_KERNEL moe_nvl_combine_send_##T(                                           \
        const unsigned* w_flags, unsigned* state, u64 timeout_ns, const char* rows,                \
        const char* cnts, i64 rank, const T* y, const i32* fan, i64 tokens, i64 top_k, i64 world,  \
        i64 width, i64 stride, i64 meta_off, unsigned late, const float* w_area,                   \
        const u64* peer_sym, i64 partials_off, i64 flags_off, unsigned* status) {                  \
        const unsigned epoch = *(volatile unsigned*)state;                                         \
        if (late != 0)                                                                             \
            block_wait_flags(w_flags, world, epoch, timeout_ns, status, MOE_GAVE_UP_COMBINE);      \
        Sources src = {rows, rows, tokens * stride, 0, cnts, cnts, 4, rank};                       \
        PeerDstAt at = {peer_sym, partials_off, rank, tokens, width * (i64)sizeof(T)};             \
        reduce_partials<T>(at, src, y, fan, tokens, top_k, world, width, stride, meta_off,         \
                           late != 0, w_area + rank * tokens * top_k, w_area, status);             \
        if (grid_last_block(state + 3)) raise_peer_flags(peer_sym, flags_off, world, rank, epoch); \
    }
#define MF_KERNEL_moe_combine_recv(T)                                                              \
    /* flags == 0: no wait (NCCL); else wait for flags[W] >= state[0] first (NVLink). */           \
    extern "C" __global__ void moe_combine_recv_##T(                                               \
        const unsigned* flags, const unsigned* state, u64 timeout_ns, unsigned* status,            \
        const char* own, const char* other, i64 rank, const i32* sent_pos, T* out, i64 tokens,     \
        i64 world, i64 width) {                                                                    \
        if (flags != 0)                                                                            \
            block_wait_flags(flags, world, *state, timeout_ns, status, MOE_GAVE_UP_COMBINE);       \
        sum_partials<T>(own, other, rank, sent_pos, out, tokens, world, width);                    \
    }
