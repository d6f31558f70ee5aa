// moe.cu: MoE expert-parallel dispatch / combine kernels (host side: kernels/src/moe/).
//
// Both transports move ONE wire row per (token, destination rank). A wire row is
// [payload][f32 scales][meta: token i32, K expert ids i32, K weights f32], each region padded to
// 16 bytes (kernels/src/moe/wire.rs, WireLayout). The payload is the token row as is (native) or
// E4M3 codes (FP8, per-token or per-128-channel scales). On arrival the receiver fans a row out
// to its local experts (expert_x, routing) and records, per received row and k, which expert row
// it went to (`fan`). A token's row to its own rank carries only the metadata: the sender fans
// the token out to its local experts itself (the values a receiver would write, FP8 rows
// quantized and dequantized), so dispatch_recv handles only other ranks' rows and the own
// fan-out overlaps the transfer (moe_dispatch.cu). The combine (moe_combine.cu) reduces, per
// received row, the weighted outputs of its local expert rows in k order into ONE partial row,
// rounded to T, sent back to the token's rank; that rank sums the partials in ascending rank
// order (`sent_pos[t][r]` says where token t's partial from rank r lies) and rounds once.
//
// - NCCL: dispatch_send (route + pack into per-destination blocks [16-byte count header][T rows],
//   counts by the last block) -> grouped send/recv (host) -> dispatch_recv (fan-out, counts by the
//   last block) ... combine_send (reduce into per-source blocks of T partial rows) -> grouped
//   send/recv -> combine_recv (sum).
// - NVLink: the same kernels store straight into peer memory (the symmetric allocation of each
//   rank: receive rows [W][T], counts [W], flags) and raise release flags carrying the step number
//   (epoch, kept on the device in `state[0]` so steps replay in CUDA graphs); receivers acquire.
//   One kernel per phase; the combine's late weights (when not given at dispatch) take one more.
//   The fused NVLink kernels (moe_fused.cu, appended after moe_combine.cu; the default) run
//   one kernel per phase with fixed slots and per-chunk flags, receivers overlapping senders.
//
// The row kernels (dispatch send and receive, combine send) give each row to a whole block
// (ROW_THREADS threads, a grid-stride loop over rows): one warp routes the row (atomics,
// positions, the destination rows, into shared memory), then every thread moves 16-byte
// vectors, several loads in flight before any store, and the row is read once however many
// destinations it has (a token's ranks, a received row's local experts). FP8 rows are
// quantized and dequantized once per row, not once per destination.
//
// Row order inside an expert is unspecified (atomics); counts and the combine result are exact.
// No kernel scans over experts with one block: any E (E > 1024 included) works with any block
// size, and there is no block-wide running total to race on (the missing barrier of
// pplx-garden's chunked expert scan, PR #9, cannot happen here).
// All float math uses explicit round-to-nearest intrinsics (NVRTC contracts a*b+c into FMA
// otherwise), so results are bit-identical to the CPU reference.
//
// Files: this one holds the status bits, the wire formats and the helpers the kernels share
// (memory model, flag waits, 16-byte vectors and row movers, FP8 E4M3, wire payloads). Appended
// to it, in this order, each using the helpers of the files before it (Source::text in
// kernels/src/kernels/sources.rs): moe_dispatch.cu (fan-out to local experts, the split dispatch
// kernels), moe_combine.cu (the split combine kernels), moe_fused.cu (the fused NVLink kernels),
// moe_fused_warp.cu and moe_fused_warp_combine.cu (their warp-per-item dispatch and combine).
//
// Typed kernels: one macro per kernel, MF_KERNEL_<name>(T), defines the kernel <name>_<T>. No
// file of this source instantiates them: the host compiles each kernel for one float type at a
// time, as its own compile unit, by appending `MF_KERNEL_<name>(<T>)` to the source
// (kernels/src/kernels/units.rs), so a run compiles only the kernels it launches. Each appended
// file defines its own in its "typed entry points" section.

#define MOE_OVERFLOW 1u
#define MOE_BAD_EXPERT 2u
#define MOE_BAD_ROUTING 4u
#define MOE_TIMEOUT 8u
#define MOE_ABORTED 16u
#define MOE_GAVE_UP_DISPATCH 32u
#define MOE_GAVE_UP_COMBINE 64u
// Bits MOE_PEER_SHIFT.. of the status: 1 + the team index of the first peer a wait gave up on.
#define MOE_PEER_SHIFT 16
// Microseconds (units of 1024 ns) between two polls of the host's abort word (a read over
// PCIe) by the waits of one engine's kernels together (see abort_raised).
#define MOE_ABORT_POLL_US 16u

#define WIRE_NATIVE 0u
#define WIRE_FP8_TOKEN 1u
#define WIRE_FP8_BLOCK 2u

#define FULL_MASK 0xffffffffu

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
// A fence that makes the relaxed system-scope stores after it release what this thread wrote
// (or observed) before it: with st_relaxed_sys, several flags released for one fence, where a
// release store each would wait like a fence each.
__device__ __forceinline__ void fence_acq_rel_sys() {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ void st_relaxed_sys(unsigned* p, unsigned v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Loads of data other GPUs (or other blocks) wrote: cached in L2 only, never a stale L1 line.
__device__ __forceinline__ int ld_cg_i32(const void* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float ld_cg_f32(const void* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned short ld_cg_u16(const void* p) {
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
// One element of T that another GPU wrote (see ld_cg_i32).
template <typename T> __device__ T load_cg(const char* p);
template <> __device__ __forceinline__ float load_cg<float>(const char* p) { return ld_cg_f32(p); }
template <> __device__ __forceinline__ bf16 load_cg<bf16>(const char* p) {
    bf16 r;
    r.bits = ld_cg_u16(p);
    return r;
}
template <> __device__ __forceinline__ f16 load_cg<f16>(const char* p) {
    f16 r;
    r.bits = ld_cg_u16(p);
    return r;
}
__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The status block of an engine: word 0 the status, word 1 when the abort word was last polled
// (abort_raised), bytes 8..16 the device address of the host's abort word (pinned, device-mapped
// host memory; 0: none), fixed at the engine's creation.
__device__ __forceinline__ const volatile unsigned* abort_word_of(const unsigned* status) {
    return (const volatile unsigned*)*(const volatile u64*)(status + 2);
}

// Whether the host raised the engine's abort word, polled by at most one waiting thread of the
// engine's kernels every MOE_ABORT_POLL_US: the waiter that wins the poll time in status word 1
// (globaltimer >> 10, wrapping) reads the word; every other waiter returns false at once. Reads of
// host memory are slow: polled by every waiting block (hundreds of them in a split kernel), they
// made waits notice their flags hundreds of microseconds late. A waiter that sees the word raised
// gives up, and the others then see MOE_TIMEOUT in the status word.
__device__ __forceinline__ bool abort_raised(unsigned* status, const volatile unsigned* abort) {
    if (abort == 0) return false;
    const unsigned now = (unsigned)(global_timer_ns() >> 10);
    const unsigned last = *(volatile unsigned*)(status + 1);
    if (now - last < MOE_ABORT_POLL_US) return false;
    if (atomicCAS(status + 1, last, now) != last) return false;
    return *abort != 0u;
}

// Records that a wait of `phase` (MOE_GAVE_UP_*) gave up on team peer `peer` for `why`
// (MOE_TIMEOUT, with MOE_ABORTED when the host raised the abort word); the first peer recorded
// stays.
__device__ void moe_give_up(unsigned* status, unsigned why, unsigned phase, i64 peer) {
    unsigned old = atomicOr(status, why | MOE_TIMEOUT | phase) | why | MOE_TIMEOUT | phase;
    while ((old >> MOE_PEER_SHIFT) == 0u) {
        unsigned seen = atomicCAS(status, old, old | ((unsigned)(peer + 1) << MOE_PEER_SHIFT));
        if (seen == old) break;
        old = seen;
    }
}

// One thread waits until *flag reaches `epoch` (acquire, system scope); false: the wait gave up
// (see block_wait_flags), `peer` being the team rank whose flag it is. `start` is when the
// block's wait began.
__device__ bool wait_flag(const unsigned* flag, unsigned epoch, u64 start, u64 timeout_ns,
                          unsigned* status, unsigned phase, i64 peer) {
    const volatile unsigned* abort = abort_word_of(status);
    while ((int)(ld_acquire_sys(flag) - epoch) < 0) {
        // Another wait gave up (and recorded why).
        if ((*(volatile unsigned*)status & MOE_TIMEOUT) != 0) return false;
        unsigned why = 0;
        if (abort_raised(status, abort)) {
            why = MOE_ABORTED;
        } else if (global_timer_ns() - start > timeout_ns) {
            why = MOE_TIMEOUT;
        }
        if (why != 0) {
            if ((int)(ld_acquire_sys(flag) - epoch) >= 0) return true;
            moe_give_up(status, why, phase, peer);
            return false;
        }
    }
    return true;
}

// One thread waits until flags[i * stride] has reached `epoch` for every i < n but `skip` (the
// flag of team rank peer0 + i); see block_wait_flags.
__device__ void wait_strided(const unsigned* flags, i64 n, i64 stride, i64 skip, unsigned epoch,
                             u64 timeout_ns, unsigned* status, unsigned phase, i64 peer0) {
    u64 start = global_timer_ns();
    bool ok = (*(volatile unsigned*)status & MOE_TIMEOUT) == 0;
    for (i64 i = 0; i < n && ok; ++i) {
        if (i == skip) continue;
        ok = wait_flag(flags + i * stride, epoch, start, timeout_ns, status, phase, peer0 + i);
    }
}

// Waits until the n consecutive flags at `flags`, all raised by team rank `peer`, have reached
// `epoch` (wait_flag's timeout and abort rules, one start time for all).
__device__ void wait_run(const unsigned* flags, i64 n, unsigned epoch, u64 timeout_ns,
                         unsigned* status, unsigned phase, i64 peer) {
    u64 start = global_timer_ns();
    bool ok = (*(volatile unsigned*)status & MOE_TIMEOUT) == 0;
    for (i64 i = 0; i < n && ok; ++i)
        ok = wait_flag(flags + i, epoch, start, timeout_ns, status, phase, peer);
}

// Thread 0 waits (wait_run), then the block proceeds.
__device__ void block_wait_run(const unsigned* flags, i64 n, unsigned epoch, u64 timeout_ns,
                               unsigned* status, unsigned phase, i64 peer) {
    if (threadIdx.x == 0) wait_run(flags, n, epoch, timeout_ns, status, phase, peer);
    __syncthreads();
}

// Thread 0 waits (wait_strided), then the block proceeds.
__device__ void block_wait_strided(const unsigned* flags, i64 n, i64 stride, i64 skip,
                                   unsigned epoch, u64 timeout_ns, unsigned* status,
                                   unsigned phase, i64 peer0) {
    if (threadIdx.x == 0)
        wait_strided(flags, n, stride, skip, epoch, timeout_ns, status, phase, peer0);
    __syncthreads();
}

// Thread 0 of the block waits until every flags[i] (i < n, the team's ranks) has reached
// `epoch` (acquire, system scope), then the block proceeds. A wait gives up (results are then
// garbage, but the GPU never hangs on a dead peer) after `timeout_ns`, or at once when the host
// raised the engine's abort word (a peer known lost; see abort_raised), recording
// why, `phase` (MOE_GAVE_UP_DISPATCH or MOE_GAVE_UP_COMBINE) and the peer (moe_give_up); a flag
// that arrived meanwhile still counts. Once MOE_TIMEOUT is set, later waits give up at once, so a
// dead team fails fast until the status is cleared.
__device__ void block_wait_flags(const unsigned* flags, i64 n, unsigned epoch, u64 timeout_ns,
                                 unsigned* status, unsigned phase) {
    block_wait_strided(flags, n, 1, -1, epoch, timeout_ns, status, phase, 0);
}

// A fence at system scope (SYSTEM) or at GPU scope.
template <bool SYSTEM>
__device__ __forceinline__ void fence_at() {
    if (SYSTEM)
        __threadfence_system();
    else
        __threadfence();
}

// Called by every block at its end: returns true (to every thread of the block) in the last block
// to arrive. Each block fences its stores before arriving, so the last block sees every block's
// stores (read them with ld_relaxed_gpu / ld_cg_*) and may publish them. `done` is a zeroed
// counter, reset here for the next launch. SYSTEM: system-scope fences, for a last block that
// publishes the other blocks' stores to other GPUs (raise_peer_flags). Without it, GPU-scope
// fences: for kernels whose last block reads only what other blocks wrote on this GPU (counters)
// and publishes nothing to other GPUs, as the fused kernels, whose stores to peers their chunk
// flags release already (release_chunk_flags); a system-scope fence waits until the block's
// stores are visible to the whole system and only adds latency to the end of every phase there.
template <bool SYSTEM = true>
__device__ bool grid_last_block(unsigned* done) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_at<SYSTEM>();
        last = atomicAdd(done, 1u) == gridDim.x - 1;
        if (last) {
            fence_at<SYSTEM>();
            *done = 0u;
        }
    }
    __syncthreads();
    return last;
}

// The last block's thread 0 raises `*(peer_sym[d] + flags_off + 4 * rank) = epoch` for every
// destination d (release, system scope), after a system-scope fence over the block's prior stores.
__device__ void raise_peer_flags(const u64* peer_sym, i64 flags_off, i64 world, i64 rank,
                                 unsigned epoch) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        for (i64 d = 0; d < world; ++d)
            st_release_sys((unsigned*)((char*)peer_sym[d] + flags_off) + rank, epoch);
    }
}

// ---- 16-byte vectors and block-wide row movers ------------------------------------------------
//
// The row kernels give one row (a token, a received row) to a whole block: every thread loads
// up to ROW_BATCH 16-byte vectors of the row at once and then stores them to every
// destination of the row, so a row is read once, whatever its fan-out, and a block keeps
// blockDim.x * ROW_BATCH * 16 bytes in flight.

#define ROW_BATCH 4
#define FP8_BATCH 2
// The row kernels run ROW_THREADS threads per block (kernels/src/moe/kernel_calls.rs launches
// them so), at least two blocks per SM.
#define ROW_THREADS 256
#define ROW_KERNEL __launch_bounds__(ROW_THREADS, 2)

struct alignas(16) U128 { unsigned a, b, c, d; };

__device__ __forceinline__ U128 ld_cg_v4(const void* p) {
    U128 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
    return v;
}
// Inputs that nothing writes while the kernel runs (x, expert_y): the read-only path, not
// kept in L1 (each byte is read once).
__device__ __forceinline__ U128 ld_nc_v4(const void* p) {
    U128 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
    return v;
}
__device__ __forceinline__ void st_v4(void* p, U128 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.a), "r"(v.b), "r"(v.c),
                 "r"(v.d) : "memory");
}

template <bool SHARED> __device__ __forceinline__ U128 ld_v4(const char* p) {
    return SHARED ? ld_cg_v4(p) : ld_nc_v4(p);
}

// Whether src, the length and every destination row dst[0..n) are 16-byte aligned (the same
// answer in every thread of the block: dst lies in shared memory).
__device__ __forceinline__ bool rows_aligned(const char* src, i64 bytes, char* const* dst, int n) {
    bool ok = ((((u64)src) | (u64)bytes) & 15u) == 0;
    for (int d = 0; d < n; ++d) ok = ok && aligned16(dst[d]);
    return ok;
}

// The block copies `bytes` (a multiple of 2) from src to the n rows dst[0..n). SHARED: src was
// written by another GPU or kernel launch phase (L2 loads), else it is a read-only input.
// 16-byte vectors when everything is aligned, else 2-byte elements.
template <bool SHARED>
__device__ void block_copy_multi(const char* src, i64 bytes, char* const* dst, int n) {
    if (n == 0) return;
    if (rows_aligned(src, bytes, dst, n)) {
        const i64 nv = bytes >> 4, nt = blockDim.x;
        for (i64 base = threadIdx.x; base < nv; base += nt * ROW_BATCH) {
            U128 v[ROW_BATCH];
#pragma unroll
            for (int u = 0; u < ROW_BATCH; ++u) {
                const i64 i = base + u * nt;
                if (i < nv) v[u] = ld_v4<SHARED>(src + 16 * i);
            }
            for (int d = 0; d < n; ++d) {
                char* o = dst[d];
#pragma unroll
                for (int u = 0; u < ROW_BATCH; ++u) {
                    const i64 i = base + u * nt;
                    if (i < nv) st_v4(o + 16 * i, v[u]);
                }
            }
        }
    } else {
        for (i64 i = threadIdx.x; i < (bytes >> 1); i += blockDim.x) {
            const unsigned short v =
                SHARED ? ld_cg_u16(src + 2 * i) : ((const unsigned short*)src)[i];
            for (int d = 0; d < n; ++d) ((unsigned short*)dst[d])[i] = v;
        }
    }
}

__device__ __forceinline__ void warp_zero_row(char* dst, i64 bytes, int lane) {
    if ((((u64)dst | (u64)bytes) & 15u) == 0) {
        U128 z = {0u, 0u, 0u, 0u};
        for (i64 i = lane; i < (bytes >> 4); i += 32) st_v4(dst + 16 * i, z);
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
__device__ __forceinline__ unsigned lanes_below() { return (1u << lane_id()) - 1u; }

// Bitwise OR over the warp.
__device__ __forceinline__ unsigned warp_or(unsigned v) {
    for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// The destination rows of the block's current row, in shared memory: row[0, n_wire) are wire
// rows (at most 32: one per rank of a chunk), row[n_wire, n) expert rows (at most 32: one per
// k of a chunk).
struct RowTargets {
    char* row[64];
    int n, n_wire;
};

// ---- FP8 E4M3 (mirrors kernels/src/fp8.rs bit for bit) -------------------------------------

// Round to nearest even, saturating to +-448 (infinities too), NaN -> 0x7f | sign.
__device__ __forceinline__ unsigned f32_to_e4m3(float v) {
    const unsigned u = __float_as_uint(v);
    const unsigned sign = (u >> 24) & 0x80u;
    const unsigned a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;
    if (a >= 0x43e00000u) return sign | 0x7eu;
    if (a >= 0x3c800000u) {
        const unsigned rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
        return sign | (rounded - (120u << 3));
    }
    const int exp = (int)(a >> 23);
    if (exp == 0) return sign;
    const unsigned mant = (a & 0x7fffffu) | 0x800000u;
    const int shift = 141 - exp;
    if (shift > 24) return sign;
    unsigned q = mant >> shift;
    const unsigned rem = mant & ((1u << shift) - 1u);
    const unsigned half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u) != 0u)) q += 1u;
    return sign | q;
}

__device__ __forceinline__ float e4m3_to_f32(unsigned b) {
    const unsigned sign = (b & 0x80u) << 24;
    const unsigned e = (b >> 3) & 0xfu, m = b & 7u;
    if (e == 15u && m == 7u) return __uint_as_float(sign | 0x7fc00000u);
    if (e == 0u) return __uint_as_float(__float_as_uint(__fmul_rn((float)m, 0.001953125f)) | sign);
    return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// max(m, |v|) over finite v (non-finite values do not count toward a scale).
__device__ __forceinline__ float amax_finite(float m, float v) {
    const unsigned a = __float_as_uint(v) & 0x7fffffffu;
    if (a >= 0x7f800000u) return m;
    const float f = __uint_as_float(a);
    return f > m ? f : m;
}

__device__ __forceinline__ float fp8_scale(float amax) {
    return amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
}

template <typename T> struct alignas(16) Pack16 { T v[16]; };

// 16 elements of T at p (16-byte aligned, a read-only input) as f32.
template <typename T> __device__ __forceinline__ void load16(const T* p, float* v) {
    const int per = 16 / (int)sizeof(T);
#pragma unroll
    for (int h = 0; h < (int)sizeof(T); ++h) {
        U128 raw = ld_nc_v4((const char*)p + 16 * h);
        const Vec16<T> x = *(const Vec16<T>*)&raw;
#pragma unroll
        for (int j = 0; j < per; ++j) v[h * per + j] = to_f32(x.v[j]);
    }
}

// e4m3(v[j] / scale) for j < 16 as one 16-byte vector.
__device__ __forceinline__ U128 quantize16(const float* v, float scale) {
    unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j >> 2] |= f32_to_e4m3(__fdiv_rn(v[j], scale)) << (8 * (j & 3));
    U128 q = {w[0], w[1], w[2], w[3]};
    return q;
}

// The values (code * scale, rounded to T) of 16 E4M3 codes: what a receiver writes.
template <typename T> __device__ __forceinline__ void dequantize16(U128 codes, float scale, T* o) {
    const unsigned w[4] = {codes.a, codes.b, codes.c, codes.d};
#pragma unroll
    for (int j = 0; j < 16; ++j)
        o[j] = from_f32<T>(__fmul_rn(e4m3_to_f32((w[j >> 2] >> (8 * (j & 3))) & 0xffu), scale));
}

// max over the lanes of each aligned group of `width` lanes (width a power of two <= 32).
__device__ __forceinline__ float group_max(float m, int width) {
    for (int o = width >> 1; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(FULL_MASK, m, o);
        m = other > m ? other : m;
    }
    return m;
}

// ---- wire payloads (whole block) ----------------------------------------------------------

// The block writes the E4M3 payload of token row x_row (h elements of T, h % 16 == 0, a
// read-only input) and its scales into the wire rows of `to`, and the values that arrive
// (code * scale rounded to T, as a receiver dequantizes them) into its expert rows: one scale
// per row
// (WIRE_FP8_TOKEN) or per 128 channels (WIRE_FP8_BLOCK, h % 128 == 0). Thread i handles the
// 16-element chunks c = i + m * blockDim.x, QB of them per round of loads; with block
// scales the 8 threads 8g .. 8g + 7 (consecutive chunks) share one 128-channel block, wholly
// inside the row or wholly past it. Every thread of the block must call this.
template <typename T, int QB = FP8_BATCH>
__device__ void block_quantize_multi(const T* x_row, i64 h, unsigned wire, i64 scale_off,
                                     const RowTargets& to) {
    __shared__ unsigned amax_bits;
    const i64 chunks = h >> 4, nt = blockDim.x;
    const int n = to.n, nw = to.n_wire;
    float row_scale = 1.0f;
    if (wire == WIRE_FP8_TOKEN) {
        if (threadIdx.x == 0) amax_bits = 0u;
        __syncthreads();
        float amax = 0.0f;
        for (i64 base = threadIdx.x; base < chunks; base += nt * QB) {
            float v[QB][16];
#pragma unroll
            for (int u = 0; u < QB; ++u)
                if (base + u * nt < chunks) load16(x_row + 16 * (base + u * nt), v[u]);
#pragma unroll
            for (int u = 0; u < QB; ++u)
                if (base + u * nt < chunks) {
#pragma unroll
                    for (int j = 0; j < 16; ++j) amax = amax_finite(amax, v[u][j]);
                }
        }
        amax = group_max(amax, 32);
        // Non-negative floats order like their bit patterns.
        if (lane_id() == 0) atomicMax(&amax_bits, __float_as_uint(amax));
        __syncthreads();
        row_scale = fp8_scale(__uint_as_float(amax_bits));
        for (int d = threadIdx.x; d < nw; d += nt) *(float*)(to.row[d] + scale_off) = row_scale;
    }
    for (i64 base = 0; base < chunks; base += nt * QB) {
        float v[QB][16];
#pragma unroll
        for (int u = 0; u < QB; ++u) {
            const i64 c = base + threadIdx.x + u * nt;
            if (c < chunks) load16(x_row + 16 * c, v[u]);
        }
#pragma unroll
        for (int u = 0; u < QB; ++u) {
            const i64 c = base + threadIdx.x + u * nt;
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

// The block writes the payload of the wire row at src (written by another GPU or an earlier
// kernel) into every expert row of `to` (h elements of T each): copied, or dequantized
// (code * scale, rounded to T) once and stored to all of them.
template <typename T>
__device__ void block_read_payload(const char* src, i64 h, unsigned wire, i64 scale_off,
                                   const RowTargets& to) {
    const int n = to.n;
    if (n == 0) return;
    if (wire == WIRE_NATIVE) {
        block_copy_multi<true>(src, h * (i64)sizeof(T), to.row, n);
        return;
    }
    const i64 chunks = h >> 4, nt = blockDim.x;
    for (i64 base = threadIdx.x; base < chunks; base += nt * 4) {
        U128 c[4];
        float s[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const i64 i = base + u * nt;
            if (i < chunks) {
                c[u] = ld_cg_v4(src + 16 * i);
                s[u] = ld_cg_f32(src + scale_off + 4 * (wire == WIRE_FP8_TOKEN ? 0 : i >> 3));
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const i64 i = base + u * nt;
            if (i < chunks) {
                Pack16<T> o;
                dequantize16<T>(c[u], s[u], o.v);
                for (int d = 0; d < n; ++d) *(Pack16<T>*)((T*)to.row[d] + 16 * i) = o;
            }
        }
    }
}

// The block writes token row x_row as the payload of the wire rows of `to` and as the row of
// its expert rows (native: the same bytes for both). QB: FP8 chunks per thread and round of
// loads (block_quantize_multi).
template <typename T, int QB = FP8_BATCH>
__device__ void block_write_payload(const T* x_row, i64 h, unsigned wire, i64 scale_off,
                                    const RowTargets& to) {
    if (wire == WIRE_NATIVE)
        block_copy_multi<false>((const char*)x_row, h * (i64)sizeof(T), to.row, to.n);
    else
        block_quantize_multi<T, QB>(x_row, h, wire, scale_off, to);
}
