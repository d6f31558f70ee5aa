// moe.cu: MoE expert-parallel dispatch / combine kernels (host side: kernels/src/moe/).
//
// Two transports share these kernels:
// - NCCL: route (histogram + per-destination offsets, one block) -> pack into padded
//   per-destination send blocks -> NCCL grouped send/recv (host) -> scan received counts ->
//   unpack into expert_x.
//   Combine: pack expert rows per source rank -> NCCL -> index (t, k) slots -> weighted reduce.
// - NVLink: per row, reserve a slot in the receiver's per-expert counter (system-scope atomic)
//   and store the row straight into the peer's expert_x (16-byte stores) -> release flags (epoch);
//   receivers acquire the flags, read the counters, zero the padding. Combine: copy expert rows
//   straight into the sources' [T, K, F] slots with an epoch mark -> flags -> weighted reduce.
//
// Row order inside an expert is unspecified (atomics); counts and the combine result are exact
// (the combine sums over k in order, in f32, without contraction, and rounds once).

#define MOE_OVERFLOW 1u
#define MOE_BAD_EXPERT 2u
#define MOE_BAD_ROUTING 4u
#define MOE_TIMEOUT 8u

// ---- memory-model helpers -------------------------------------------------------------------

__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int atomic_add_sys(int* p, int v) {
    int old;
    asm volatile("atom.relaxed.sys.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}
__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Thread 0 of the block waits until every flags[i] (i < n) has reached `epoch` (acquire, system
// scope), then the block proceeds. A wait longer than `timeout_ns` raises MOE_TIMEOUT and gives up
// (results are then garbage, but the GPU never hangs on a dead peer); once MOE_TIMEOUT is set,
// later waits give up at once, so a dead team fails fast until the status is cleared.
__device__ void block_wait_flags(const unsigned* flags, i64 n, unsigned epoch, u64 timeout_ns,
                                 unsigned* status) {
    if (threadIdx.x == 0) {
        u64 start = global_timer_ns();
        bool timed_out = (*(volatile unsigned*)status & MOE_TIMEOUT) != 0;
        for (i64 i = 0; i < n && !timed_out; ++i) {
            while ((int)(ld_acquire_sys(flags + i) - epoch) < 0) {
                if (global_timer_ns() - start > timeout_ns) {
                    atomicOr(status, MOE_TIMEOUT);
                    timed_out = true;
                    break;
                }
            }
        }
    }
    __syncthreads();
}

// Called by every block at the end of a send kernel: the last block to finish raises
// `*flag_ptrs[d] = epoch` (release, system scope) for every destination d, after all blocks'
// stores (local and peer) are visible system-wide. `done` is a zeroed counter, reset here.
__device__ void grid_done_signal(unsigned* done, const u64* flag_ptrs, i64 world, unsigned epoch) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        if (atomicAdd(done, 1u) == gridDim.x - 1) {
            __threadfence_system();
            *done = 0u;
            for (i64 d = 0; d < world; ++d) st_release_sys((unsigned*)flag_ptrs[d], epoch);
        }
    }
}

// ---- row copies (one warp per row) ------------------------------------------------------------

struct alignas(16) U128 { unsigned a, b, c, d; };

__device__ __forceinline__ U128 ld_v4(const U128* p) {
    U128 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
    return v;
}
__device__ __forceinline__ void st_v4(U128* p, U128 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.a), "r"(v.b), "r"(v.c),
                 "r"(v.d) : "memory");
}

// Copies `bytes` (a multiple of 2) from src to dst with the 32 lanes of a warp: 16-byte vectors
// when both rows are 16-byte aligned and the length is a multiple of 16, else 2-byte elements.
__device__ __forceinline__ void warp_copy_row(char* dst, const char* src, i64 bytes, int lane) {
    if ((((u64)dst | (u64)src | (u64)bytes) & 15u) == 0) {
        const U128* s = (const U128*)src;
        U128* d = (U128*)dst;
        i64 n = bytes >> 4;
        i64 i = lane;
        for (; i + 96 < n; i += 128) {
            U128 a = ld_v4(s + i), b = ld_v4(s + i + 32), c = ld_v4(s + i + 64), e = ld_v4(s + i + 96);
            st_v4(d + i, a);
            st_v4(d + i + 32, b);
            st_v4(d + i + 64, c);
            st_v4(d + i + 96, e);
        }
        for (; i < n; i += 32) st_v4(d + i, ld_v4(s + i));
    } else {
        const unsigned short* s = (const unsigned short*)src;
        unsigned short* d = (unsigned short*)dst;
        for (i64 i = lane; i < (bytes >> 1); i += 32) d[i] = s[i];
    }
}

__device__ __forceinline__ void warp_zero_row(char* dst, i64 bytes, int lane) {
    if ((((u64)dst | (u64)bytes) & 15u) == 0) {
        U128* d = (U128*)dst;
        U128 z = {0u, 0u, 0u, 0u};
        for (i64 i = lane; i < (bytes >> 4); i += 32) st_v4(d + i, z);
    } else {
        unsigned short* d = (unsigned short*)dst;
        for (i64 i = lane; i < (bytes >> 1); i += 32) d[i] = 0;
    }
}

__device__ __forceinline__ void store_pair(i32* p, i32 a, i32 b) {
    asm volatile("st.global.v2.s32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ i64 warp_id() { return thread_index() >> 5; }
__device__ __forceinline__ i64 warp_count() { return thread_count() >> 5; }
__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// ---- block-wide exclusive scan over any length ------------------------------------------------

// out[i] = in[0] + ... + in[i-1] for i < n, processed in chunks of blockDim.x (a multiple of 32);
// returns the total to every thread. `in` is read with relaxed gpu-scope loads (it may have been
// built with atomics). The barrier between reading the running total and advancing it is the one
// pplx-garden PR #9 is missing.
__device__ int block_exclusive_scan(const int* in, int* out, i64 n) {
    __shared__ int warp_sums[32];
    __shared__ int running;
    const int lane = lane_id(), warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    __syncthreads();  // a previous call may still be reading `running`
    if (threadIdx.x == 0) running = 0;
    __syncthreads();
    for (i64 base = 0; base < n; base += blockDim.x) {
        i64 i = base + threadIdx.x;
        int v = i < n ? ld_relaxed_gpu(in + i) : 0;
        int x = v;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) warp_sums[warp] = x;
        __syncthreads();
        if (warp == 0) {
            int s = lane < nwarps ? warp_sums[lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                int y = __shfl_up_sync(0xffffffffu, s, o);
                if (lane >= o) s += y;
            }
            warp_sums[lane] = s;
        }
        __syncthreads();
        int prefix = running + (warp > 0 ? warp_sums[warp - 1] : 0);
        if (i < n) out[i] = prefix + x - v;
        int chunk_total = warp_sums[nwarps - 1];
        __syncthreads();  // every thread has read `running` and `warp_sums` (the PR #9 barrier)
        if (threadIdx.x == 0) running += chunk_total;
        __syncthreads();
    }
    return running;
}

// ---- dispatch, sender side (both transports) --------------------------------------------------

// NCCL, one block. cnt[e] = rows for expert e; pos[t*K+k] = rank of the row among expert e's
// rows (-1 for an invalid expert id); base[e] = offset of expert e's first row inside its
// destination's send block (the experts of a destination are contiguous, ascending).
extern "C" __global__ void __launch_bounds__(1024) moe_route(const i32* topk_idx, i64 rows,
                                                             i64 experts, i64 local_experts,
                                                             i32* cnt, i32* pos, i32* base,
                                                             unsigned* status) {
    for (i64 e = threadIdx.x; e < experts; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (i64 i = threadIdx.x; i < rows; i += blockDim.x) {
        int e = topk_idx[i];
        if (e < 0 || e >= experts) {
            pos[i] = -1;
            atomicOr(status, MOE_BAD_EXPERT);
        } else {
            pos[i] = atomicAdd(cnt + e, 1);
        }
    }
    __syncthreads();
    i64 world = experts / local_experts;
    for (i64 d = 0; d < world; ++d)
        block_exclusive_scan(cnt + d * local_experts, base + d * local_experts, local_experts);
}

// NCCL: one warp per (t, k) row: x[t] goes to row base[e] + pos of destination d's send block
// (meta = team-global token, k).
extern "C" __global__ void moe_nccl_dispatch_pack(const char* x, i64 row_bytes, const i32* topk_idx,
                                                  const i32* pos, const i32* base, i64 tokens,
                                                  i64 top_k, i64 local_experts, i64 rank,
                                                  i64 pair_rows, char* send_x, i32* send_meta) {
    const int lane = lane_id();
    for (i64 i = warp_id(); i < tokens * top_k; i += warp_count()) {
        int p = pos[i];
        if (p < 0) continue;
        int e = topk_idx[i];
        i64 d = e / local_experts;
        i64 row = d * pair_rows + base[e] + p;
        i64 t = i / top_k, k = i - t * top_k;
        warp_copy_row(send_x + row * row_bytes, x + t * row_bytes, row_bytes, lane);
        if (lane == 0) store_pair(send_meta + row * 2, (i32)(rank * tokens + t), (i32)k);
    }
}

// NVLink: one warp per (t, k) row: lane 0 reserves a row of expert e in the receiver's counter
// (system-scope atomic add at `peer_sym[d] + counter_off`), the warp stores x[t] (16-byte
// vectors) and (team-global token, k) straight into the receiver's expert_x / routing. Rows
// past C are dropped (MOE_OVERFLOW). The last block raises the dispatch flags.
extern "C" __global__ void moe_nvl_dispatch_send(const char* x, i64 row_bytes, const i32* topk_idx,
                                                 i64 tokens, i64 top_k, i64 experts,
                                                 i64 local_experts, i64 capacity, i64 rank,
                                                 const u64* peer_sym, i64 x_off, i64 routing_off,
                                                 i64 counter_off, unsigned* status,
                                                 unsigned* done, const u64* flag_ptrs, i64 world,
                                                 unsigned epoch) {
    const int lane = lane_id();
    for (i64 i = warp_id(); i < tokens * top_k; i += warp_count()) {
        int e = topk_idx[i];
        if (e < 0 || e >= experts) {
            if (lane == 0) atomicOr(status, MOE_BAD_EXPERT);
            continue;
        }
        i64 d = e / local_experts, le = e - d * local_experts;
        char* peer = (char*)peer_sym[d];
        int slot = 0;
        if (lane == 0) slot = atomic_add_sys((i32*)(peer + counter_off) + le, 1);
        slot = __shfl_sync(0xffffffffu, slot, 0);
        if (slot >= capacity) {
            if (lane == 0) atomicOr(status, MOE_OVERFLOW);
            continue;
        }
        i64 row = le * capacity + slot;
        i64 t = i / top_k, k = i - t * top_k;
        warp_copy_row(peer + x_off + row * row_bytes, x + t * row_bytes, row_bytes, lane);
        if (lane == 0) store_pair((i32*)(peer + routing_off) + row * 2, (i32)(rank * tokens + t), (i32)k);
    }
    grid_done_signal(done, flag_ptrs, world, epoch);
}

// ---- dispatch, receiver side: NVLink ----------------------------------------------------------

// Waits for every sender's flag, then counts[le] = min(rows reserved, C) (MOE_OVERFLOW past C),
// resets the other parity's counters for the next step, and zeroes padding rows and routing.
extern "C" __global__ void moe_nvl_dispatch_recv(const unsigned* flags, i64 world, unsigned epoch,
                                                 u64 timeout_ns, const i32* counters,
                                                 i32* counters_next, i32* counts,
                                                 i64 local_experts, i64 capacity, char* expert_x,
                                                 i64 row_bytes, i32* routing, unsigned* status) {
    block_wait_flags(flags, world, epoch, timeout_ns, status);
    for (i64 le = thread_index(); le < local_experts; le += thread_count()) {
        int total = ld_relaxed_gpu(counters + le);
        counts[le] = total < capacity ? total : (i32)capacity;
        if (total > capacity) atomicOr(status, MOE_OVERFLOW);
        counters_next[le] = 0;
    }
    const int lane = lane_id();
    for (i64 r = warp_id(); r < local_experts * capacity; r += warp_count()) {
        i64 le = r / capacity, j = r - le * capacity;
        if (j < ld_relaxed_gpu(counters + le)) continue;
        warp_zero_row(expert_x + r * row_bytes, row_bytes, lane);
        if (lane == 0) store_pair(routing + r * 2, 0, 0);
    }
}

// ---- dispatch, receiver side: NCCL ------------------------------------------------------------

// One block. c(s, le) = rows source s sent for local expert le (own counts for s == rank).
// src_off[s][le]: first row of (s, le) in s's block; src_total[s]: rows in s's block;
// dst_off[s][le]: first row of (s, le) in expert le; counts[le] = min(total, C).
extern "C" __global__ void __launch_bounds__(1024) moe_nccl_dispatch_scan(const i32* self_cnt, const i32* recv_cnt, i64 rank,
                                                  i64 world, i64 local_experts, i64 capacity,
                                                  i32* src_off, i32* dst_off, i32* src_total,
                                                  i32* counts, unsigned* status) {
    for (i64 s = 0; s < world; ++s) {
        const i32* c = s == rank ? self_cnt : recv_cnt + s * local_experts;
        int total = block_exclusive_scan(c, src_off + s * local_experts, local_experts);
        if (threadIdx.x == 0) src_total[s] = total;
    }
    for (i64 le = threadIdx.x; le < local_experts; le += blockDim.x) {
        i64 run = 0;
        bool bad = false;
        for (i64 s = 0; s < world; ++s) {
            const i32* c = s == rank ? self_cnt : recv_cnt + s * local_experts;
            dst_off[s * local_experts + le] = (i32)(run < 0x7fffffff ? run : 0x7fffffff);
            int v = ld_relaxed_gpu(c + le);
            if (v < 0) bad = true; else run += v;
        }
        counts[le] = run < capacity ? (i32)run : (i32)capacity;
        if (run > capacity) atomicOr(status, MOE_OVERFLOW);
        if (bad) atomicOr(status, MOE_BAD_ROUTING);
    }
}

// One warp per received row: finds its expert by binary search in src_off[s], places it at
// dst_off + rank-in-segment (dropped past C), copies its routing; then zeroes padding rows.
extern "C" __global__ void moe_nccl_dispatch_unpack(const char* recv_x, const char* send_x,
                                                    const i32* recv_meta, const i32* send_meta,
                                                    i64 rank, i64 world, i64 pair_rows,
                                                    i64 local_experts, i64 capacity, i64 row_bytes,
                                                    const i32* src_off, const i32* dst_off,
                                                    const i32* src_total, const i32* counts,
                                                    char* expert_x, i32* routing) {
    const int lane = lane_id();
    for (i64 r = warp_id(); r < world * pair_rows; r += warp_count()) {
        i64 s = r / pair_rows, j = r - s * pair_rows;
        if (j >= src_total[s]) continue;
        const i32* off = src_off + s * local_experts;
        i64 lo = 0, hi = local_experts;  // largest le with off[le] <= j
        while (hi - lo > 1) {
            i64 mid = (lo + hi) >> 1;
            if (off[mid] <= j) lo = mid; else hi = mid;
        }
        i64 dst = (i64)dst_off[s * local_experts + lo] + (j - off[lo]);
        if (dst < 0 || dst >= capacity) continue;
        const char* src = (s == rank ? send_x : recv_x) + r * row_bytes;
        const i32* meta = (s == rank ? send_meta : recv_meta) + r * 2;
        i64 row = lo * capacity + dst;
        warp_copy_row(expert_x + row * row_bytes, src, row_bytes, lane);
        if (lane == 0) store_pair(routing + row * 2, meta[0], meta[1]);
    }
    for (i64 r = warp_id(); r < local_experts * capacity; r += warp_count()) {
        i64 le = r / capacity, j = r - le * capacity;
        if (j < counts[le]) continue;
        warp_zero_row(expert_x + r * row_bytes, row_bytes, lane);
        if (lane == 0) store_pair(routing + r * 2, 0, 0);
    }
}

// ---- combine, expert side ---------------------------------------------------------------------

// Reads row r = (le, j) of the expert side; returns false for padding or invalid routing.
__device__ __forceinline__ bool expert_row_source(const i32* counts, const i32* routing, i64 r,
                                                  i64 capacity, i64 tokens, i64 top_k, i64 world,
                                                  i64* s, i64* t, i64* k, unsigned* status,
                                                  int lane) {
    i64 le = r / capacity, j = r - le * capacity;
    int c = counts[le];
    if (c < 0 || c > capacity) {
        if (lane == 0 && j == 0) atomicOr(status, MOE_BAD_ROUTING);
        c = c < 0 ? 0 : (int)capacity;
    }
    if (j >= c) return false;
    i64 g = routing[r * 2], kk = routing[r * 2 + 1];
    if (g < 0 || g >= world * tokens || kk < 0 || kk >= top_k) {
        if (lane == 0) atomicOr(status, MOE_BAD_ROUTING);
        return false;
    }
    *s = g / tokens;
    *t = g - *s * tokens;
    *k = kk;
    return true;
}

// NVLink: one warp per valid expert row: y row -> slot [t, k] of source s (peer memory), mark
// [t, k] = epoch; the last block raises the combine flags.
extern "C" __global__ void moe_nvl_combine_send(const char* y, i64 row_bytes, const i32* counts,
                                                const i32* routing, i64 local_experts,
                                                i64 capacity, i64 tokens, i64 top_k, i64 world,
                                                const u64* peer_sym, i64 slots_off, i64 marks_off,
                                                unsigned epoch, unsigned* status, unsigned* done,
                                                const u64* flag_ptrs) {
    const int lane = lane_id();
    for (i64 r = warp_id(); r < local_experts * capacity; r += warp_count()) {
        i64 s, t, k;
        if (!expert_row_source(counts, routing, r, capacity, tokens, top_k, world, &s, &t, &k,
                               status, lane))
            continue;
        char* peer = (char*)peer_sym[s];
        i64 slot = t * top_k + k;
        warp_copy_row(peer + slots_off + slot * row_bytes, y + r * row_bytes, row_bytes, lane);
        if (lane == 0) ((unsigned*)(peer + marks_off))[slot] = epoch;
    }
    grid_done_signal(done, flag_ptrs, world, epoch);
}

// NCCL: one warp per valid expert row: y row -> next free row of source s's send block.
extern "C" __global__ void moe_nccl_combine_pack(const char* y, i64 row_bytes, const i32* counts,
                                                 const i32* routing, i64 local_experts,
                                                 i64 capacity, i64 tokens, i64 top_k, i64 world,
                                                 i64 pair_rows, i32* send_cnt, char* send_x,
                                                 i32* send_meta, unsigned* status) {
    const int lane = lane_id();
    for (i64 r = warp_id(); r < local_experts * capacity; r += warp_count()) {
        i64 s, t, k;
        if (!expert_row_source(counts, routing, r, capacity, tokens, top_k, world, &s, &t, &k,
                               status, lane))
            continue;
        int slot = 0;
        if (lane == 0) slot = atomicAdd(send_cnt + s, 1);
        slot = __shfl_sync(0xffffffffu, slot, 0);
        if (slot >= pair_rows) {
            if (lane == 0) atomicOr(status, MOE_BAD_ROUTING);
            continue;
        }
        i64 row = s * pair_rows + slot;
        warp_copy_row(send_x + row * row_bytes, y + r * row_bytes, row_bytes, lane);
        if (lane == 0) store_pair(send_meta + row * 2, (i32)t, (i32)k);
    }
}

// NCCL: slot_idx[t*K+k] = row (s * pair_rows + j) of the received (or own) block holding y(t, k).
extern "C" __global__ void moe_nccl_combine_index(const i32* send_cnt, const i32* recv_cnt,
                                                  const i32* send_meta, const i32* recv_meta,
                                                  i64 rank, i64 world, i64 pair_rows, i64 tokens,
                                                  i64 top_k, i32* slot_idx, unsigned* status) {
    for (i64 r = thread_index(); r < world * pair_rows; r += thread_count()) {
        i64 s = r / pair_rows, j = r - s * pair_rows;
        i64 n = s == rank ? ld_relaxed_gpu(send_cnt + s) : recv_cnt[s];
        if (j >= n) continue;
        const i32* meta = (s == rank ? send_meta : recv_meta) + r * 2;
        i64 t = meta[0], k = meta[1];
        if (t < 0 || t >= tokens || k < 0 || k >= top_k) {
            atomicOr(status, MOE_BAD_ROUTING);
            continue;
        }
        if (atomicExch(slot_idx + t * top_k + k, (int)r) != -1) atomicOr(status, MOE_BAD_ROUTING);
    }
}

// ---- combine, token side: out[t] = sum_k w[t, k] * y(t, k) -------------------------------------

// Sums in k order in f32 with explicit round-to-nearest multiply and add (no FMA contraction, so
// the result is bit-identical to a plain host loop) and rounds once to T.
template <typename T, typename RowOf>
__device__ void combine_reduce(RowOf row_of, const float* weights, T* out, i64 tokens, i64 top_k,
                               i64 width) {
    const int VEC = 16 / (int)sizeof(T);
    const bool vec = (width % VEC) == 0 && aligned16(out);
    const i64 per_token = vec ? width / VEC : width;
    for (i64 c = thread_index(); c < tokens * per_token; c += thread_count()) {
        i64 t = c / per_token, f0 = (c - t * per_token) * (vec ? VEC : 1);
        float acc[16 / sizeof(T)];
        for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
        for (i64 k = 0; k < top_k; ++k) {
            const T* row = row_of(t * top_k + k);
            if (row == 0) continue;
            float w = weights[t * top_k + k];
            if (vec) {
                Vec16<T> y = *(const Vec16<T>*)(row + f0);
                for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], __fmul_rn(w, to_f32(y.v[v])));
            } else {
                acc[0] = __fadd_rn(acc[0], __fmul_rn(w, to_f32(row[f0])));
            }
        }
        if (vec) {
            Vec16<T> o;
            for (int v = 0; v < VEC; ++v) o.v[v] = from_f32<T>(acc[v]);
            *(Vec16<T>*)(out + t * width + f0) = o;
        } else {
            out[t * width + f0] = from_f32<T>(acc[0]);
        }
    }
}

template <typename T> struct SlotRows {
    const char* slots;
    const unsigned* marks;
    unsigned epoch;
    i64 row_bytes;
    __device__ const T* operator()(i64 slot) const {
        return marks[slot] == epoch ? (const T*)(slots + slot * row_bytes) : (const T*)0;
    }
};

template <typename T> struct IndexedRows {
    const char* recv_x;
    const char* send_x;
    const i32* slot_idx;
    i64 rank, pair_rows, row_bytes;
    __device__ const T* operator()(i64 slot) const {
        i64 r = slot_idx[slot];
        if (r < 0) return (const T*)0;
        return (const T*)((r / pair_rows == rank ? send_x : recv_x) + r * row_bytes);
    }
};

#define MOE_REDUCE(T)                                                                            \
    extern "C" __global__ void moe_nvl_combine_recv_##T(                                         \
        const unsigned* flags, i64 world, unsigned epoch, u64 timeout_ns, unsigned* status,     \
        const char* slots, const unsigned* marks, const float* weights, T* out, i64 tokens,     \
        i64 top_k, i64 width) {                                                                  \
        block_wait_flags(flags, world, epoch, timeout_ns, status);                               \
        SlotRows<T> rows = {slots, marks, epoch, width * (i64)sizeof(T)};                        \
        combine_reduce<T>(rows, weights, out, tokens, top_k, width);                             \
    }                                                                                            \
    extern "C" __global__ void moe_nccl_combine_reduce_##T(                                      \
        const char* recv_x, const char* send_x, const i32* slot_idx, i64 rank, i64 pair_rows,    \
        const float* weights, T* out, i64 tokens, i64 top_k, i64 width) {                        \
        IndexedRows<T> rows = {recv_x, send_x, slot_idx, rank, pair_rows, width * (i64)sizeof(T)}; \
        combine_reduce<T>(rows, weights, out, tokens, top_k, width);                             \
    }

MOE_REDUCE(f32)
MOE_REDUCE(bf16)
MOE_REDUCE(f16)
