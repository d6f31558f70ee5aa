#line 1 "moe_fused.cu"
// moe_fused.cu: the fused NVLink MoE kernels (appended to moe.cu after moe_dispatch.cu and
// moe_combine.cu, whose helpers they use; the warp dispatch, moe_fused_warp.cu, and the warp
// combine, moe_fused_warp_combine.cu, are appended after this file; host side:
// kernels/src/moe/fused.rs).
//
// One kernel per phase instead of two, with the receive side overlapping the peers' sends:
//
// - Positions are fixed: token t of rank s lies in slot t of every receiver's rows[s] (token
//   field -1 when it does not go there), so sent_pos[t][r] is t or -1, and a receiver knows
//   where a token lies before its sender is done.
// - Tokens form chunks of `chunk` consecutive tokens. A sender releases a chunk's flags at
//   every peer (system-scope release stores after a barrier over the chunk's stores) as soon
//   as it has written the chunk there; a receiver acquires only the flags of the chunk it is
//   about to read. The combine has a flag per chunk (chunk_flags[me][c]), so its chunk is the
//   same on every rank (derived from the shape); the dispatch has a flag per token
//   (token_flags[me][t]: a chunk releases and a receiver waits for each of its tokens), so
//   each rank may chunk its dispatch its own way (its kernel and chunk are local choices).
// - Work is handed out in tickets (one atomic per block and item, ascending): per chunk there
//   are `A` producer items and `B` consumer items, and the consumers of chunk c are handed out
//   after the producers of chunk c + lag, so they rarely wait. A consumer only waits for
//   producers of lower tickets (here: its peers' producers, which wait at most for late
//   weights, raised by an earlier kernel of their source), so the team makes progress whatever
//   number of blocks is resident.
//
// Dispatch (A = 1, B = W - 1): a producer routes its chunk's tokens (own fan-out, wire rows into
// the receivers' slot t, -1 markers) and releases the chunk at the peers; a consumer fans out
// the chunk's rows of one source. Combine (A = W - 1, B = 1): a producer reduces the chunk's
// received rows of one source into partials stored at the source and releases the chunk there;
// a consumer waits for the chunk from every peer, computes this rank's own partials of its
// tokens into out (no partial round trip through memory of its own), then sums in rank order
// into out (same order, same roundings as the unfused kernels). The one-pass variant of the
// consumer waits first and sums each token with its own partial held in registers
// (partial_sum_row). The block combine comes in block shapes (threads, blocks per SM, vectors per
// thread and round, prefetch of the next token's fan and weights: nvl_combine_fused and its
// typed entry points). The per-wire dispatch kernels are the same code for one wire format each
// (see the typed entry points); the warp kernels (moe_fused_warp.cu: dispatch,
// moe_fused_warp_combine.cu: combine) run the same items with a warp each instead of a block.
//
// Reuse across steps: a peer writes rows / partials of step s + 1 only after its combine of
// step s, whose consumers waited for this rank's release of every chunk (empty ones included),
// which follows all of this rank's reads of step s's rows; partials alike through the dispatch
// of step s + 1, whose consumers wait for every chunk of every peer.

// A ticket for the block (every thread gets the same value).
__device__ __forceinline__ i64 block_ticket(unsigned* counter) {
    __shared__ i64 ticket;
    __syncthreads();
    if (threadIdx.x == 0) ticket = (i64)atomicAdd(counter, 1u);
    __syncthreads();
    return ticket;
}

// One work item of a fused kernel: `consumer` or producer of chunk `chunk`, `index` < A (or B).
struct Item {
    bool valid, consumer;
    i64 chunk, index;
};

// The item of ticket q with n chunks, a producers and b consumers per chunk, consumers of chunk c
// after the producers of chunk c + lag (see the top of this file).
__device__ __forceinline__ Item item_of(i64 q, i64 n, i64 a, i64 b, i64 lag) {
    Item it = {false, false, 0, 0};
    const i64 d = lag < n ? lag : n;
    if (q < d * a) {
        it.valid = true;
        it.chunk = q / a;
        it.index = q - it.chunk * a;
        return it;
    }
    q -= d * a;
    const i64 per = a + b, body = (n - d) * per;
    if (q < body) {
        const i64 i = q / per, j = q - i * per;
        it.valid = true;
        if (j < a) {
            it.chunk = d + i;
            it.index = j;
        } else {
            it.consumer = true;
            it.chunk = i;
            it.index = j - a;
        }
        return it;
    }
    q -= body;
    if (b > 0 && q < d * b) {
        it.valid = true;
        it.consumer = true;
        it.chunk = (n - d) + q / b;
        it.index = q - (q / b) * b;
    }
    return it;
}

// One thread, after its block's (or warp's) stores of chunk c and a barrier over them:
// chunk_flags[rank * n + c] = epoch in every peer but this rank (a release store at system
// scope: the barrier orders the other threads' stores before it, and a release is cumulative
// over what is ordered before it, so no separate fence before it). peer == -1: every other rank,
// else only that one.
__device__ void release_chunk_flags(const u64* peer_sym, i64 flags_off, i64 world, i64 rank,
                                    i64 peer, i64 n, i64 c, unsigned epoch) {
    for (i64 d = 0; d < world; ++d)
        if (d != rank && (peer < 0 || d == peer))
            st_release_sys((unsigned*)((char*)peer_sym[d] + flags_off) + rank * n + c, epoch);
}

// The dispatch's release of tokens [t0, t1) (their flags, one per token) at every other rank,
// by one thread after a barrier over the stores of those tokens. One token: release stores, as
// release_chunk_flags; several: one acq_rel fence and relaxed stores (each flag store after the
// fence is a release pattern of the PTX memory model), one fence's wait instead of one per
// token.
__device__ void release_token_flags(const u64* peer_sym, i64 flags_off, i64 world, i64 rank,
                                    i64 tokens, i64 t0, i64 t1, unsigned epoch) {
    if (t1 - t0 == 1) {
        release_chunk_flags(peer_sym, flags_off, world, rank, -1, tokens, t0, epoch);
        return;
    }
    fence_acq_rel_sys();
    for (i64 d = 0; d < world; ++d)
        if (d != rank)
            for (i64 t = t0; t < t1; ++t)
                st_relaxed_sys((unsigned*)((char*)peer_sym[d] + flags_off) + rank * tokens + t,
                               epoch);
}

// release_chunk_flags after the whole block's stores of chunk c.
__device__ void release_chunk(const u64* peer_sym, i64 flags_off, i64 world, i64 rank, i64 peer,
                              i64 n, i64 c, unsigned epoch) {
    __syncthreads();
    if (threadIdx.x == 0) release_chunk_flags(peer_sym, flags_off, world, rank, peer, n, c, epoch);
}

// ---- dispatch ---------------------------------------------------------------------------------

// The block fans the row in slot t of source s out to the local experts (as fan_out does for
// one row); returns whether the slot held a row (the same in every thread).
template <typename T>
__device__ bool fan_out_slot(const char* rows, i64 s, i64 t, i64 tokens, i64 top_k, i64 experts,
                             i64 local_experts, i64 rank, i64 capacity, i64 hidden, unsigned wire,
                             i64 stride, i64 scale_off, i64 meta_off, T* expert_x, i32* routing,
                             i32* fan, i32* ecnt, unsigned* status) {
    __shared__ RowTargets to;
    __shared__ int present;
    const int lane = lane_id();
    const char* row = rows + (s * tokens + t) * stride;
    const i64 row_bytes = hidden * (i64)sizeof(T);
    for (i64 k0 = 0; k0 < top_k; k0 += 32) {
        if (threadIdx.x < 32) {
            const int tok = ld_cg_i32(row + meta_off);
            if (tok != -1 && tok != t && lane == 0 && k0 == 0) atomicOr(status, MOE_BAD_ROUTING);
            const int e = tok == t && k0 + lane < top_k
                              ? ld_cg_i32(row + meta_off + 4 + 4 * (k0 + lane))
                              : -1;
            int n = 0;
            if (tok == t)
                n = take_expert_rows(e, k0, top_k, experts, local_experts, rank, capacity,
                                     (i32)(s * tokens + t), (char*)expert_x, row_bytes, routing,
                                     fan + (s * tokens + t) * top_k, ecnt, status, to, 0);
            if (lane == 0) {
                present = tok == t;
                to.n_wire = 0;
                to.n = n;
            }
        }
        __syncthreads();
        if (!present) {
            // Uniform; warp 0 rewrites `present` for the next slot only after this barrier.
            __syncthreads();
            return false;
        }
        block_read_payload<T>(row, hidden, wire, scale_off, to);
        __syncthreads();
    }
    return true;
}

// The end of a fused dispatch, called by every block: the last block writes the expert counts,
// this rank's received row counts (counts[s]), zeroes the counters, resets the ticket counter
// and stores the epoch.
__device__ void dispatch_fused_finish(i64 local_experts, i64 world, i64 rank, char* sym,
                                      i64 counts_off, i32* cnt, i32* recv_cnt, unsigned* state,
                                      const OwnFanOut& own, i32* expert_counts, unsigned epoch) {
    if (grid_last_block<false>(state + 1)) {
        for (i64 le = threadIdx.x; le < local_experts; le += blockDim.x) {
            const int total = ld_relaxed_gpu(own.ecnt + le);
            expert_counts[le] = total < own.capacity ? total : (i32)own.capacity;
            own.ecnt[le] = 0;
        }
        for (i64 s = threadIdx.x; s < world; s += blockDim.x) {
            ((i32*)(sym + counts_off))[s] = ld_relaxed_gpu(s == rank ? cnt + s : recv_cnt + s);
            recv_cnt[s] = 0;
        }
        for (i64 r = threadIdx.x; r < world; r += blockDim.x) cnt[r] = 0;
        __syncthreads();
        if (threadIdx.x == 0) {
            state[5] = 0u;
            *(volatile unsigned*)state = epoch;
        }
    }
}

// rows/counts/token flags: this rank's symmetric regions (local addresses); recv_cnt[W]: zeroed
// per-source counters of received rows. The last block writes the expert counts, this rank's
// received row counts (counts[s]), zeroes the counters and stores the epoch. QB: FP8 chunks
// per thread and round of loads of the sender's quantisation (block_quantize_multi).
template <typename T, int QB = FP8_BATCH>
__device__ void nvl_dispatch_fused(const T* x, const i32* topk_idx, const float* weights,
                                   i64 tokens, i64 top_k, i64 experts, i64 local_experts,
                                   i64 world, i64 rank, i64 hidden, unsigned wire, i64 stride,
                                   i64 scale_off, i64 meta_off, const u64* peer_sym, i64 rows_off,
                                   i64 token_flags_off, char* sym, i64 counts_off, i64 chunk,
                                   i64 lag, u64 timeout_ns, i32* cnt, i32* recv_cnt,
                                   i32* sent_pos, unsigned* status, unsigned* state,
                                   const OwnFanOut& own, i32* expert_counts) {
    const unsigned epoch = *(volatile unsigned*)state + 1u;
    const i64 n = (tokens + chunk - 1) / chunk;
    PeerRowAt at = {peer_sym, rows_off, rank, tokens, stride};
    const char* rows = sym + rows_off;
    const unsigned* flags = (const unsigned*)(sym + token_flags_off);
    for (;;) {
        const Item it = item_of(block_ticket(state + 5), n, 1, world - 1, lag);
        if (!it.valid) break;
        const i64 t0 = it.chunk * chunk, t1 = t0 + chunk < tokens ? t0 + chunk : tokens;
        if (!it.consumer) {
            for (i64 t = t0; t < t1; ++t)
                route_and_send_token<T, true, PeerRowAt, QB>(t, at, x, topk_idx, weights, tokens, top_k, experts,
                                              local_experts, world, rank, hidden, wire, scale_off,
                                              meta_off, cnt, sent_pos, status, own);
            __syncthreads();
            if (threadIdx.x == 0)
                release_token_flags(peer_sym, token_flags_off, world, rank, tokens, t0, t1, epoch);
        } else {
            const i64 s = (rank + 1 + it.index) % world;
            block_wait_run(flags + s * tokens + t0, t1 - t0, epoch, timeout_ns, status,
                           MOE_GAVE_UP_DISPATCH, s);
            int got = 0;
            for (i64 t = t0; t < t1; ++t)
                got += fan_out_slot<T>(rows, s, t, tokens, top_k, experts, local_experts, rank,
                                       own.capacity, hidden, wire, stride, scale_off, meta_off,
                                       (T*)own.expert_x, own.routing, own.fan, own.ecnt, status);
            if (threadIdx.x == 0 && got > 0) atomicAdd(recv_cnt + s, got);
        }
    }
    dispatch_fused_finish(local_experts, world, rank, sym, counts_off, cnt, recv_cnt, state, own,
                          expert_counts, epoch);
}

// ---- combine ----------------------------------------------------------------------------------

// out[t] for t in [t0, t1): the sum in ascending rank order of the partials of the ranks with
// sent_pos[t][r] >= 0, where this rank's own partial already lies in out[t] and every other
// rank's in partials[r][t]; f32 from +0, rounded once (sum_partials, in place). NV: vectors per
// thread and round (the kernel's block shape).
template <typename T, int NV>
__device__ void block_sum_chunk(const char* partials, i64 rank, const i32* sent_pos, T* out,
                                i64 t0, i64 t1, i64 tokens, i64 world, i64 width) {
    const int VEC = 16 / (int)sizeof(T);
    const i64 row_bytes = width * (i64)sizeof(T);
    if ((width % VEC) == 0 && aligned16(out) && aligned16(partials)) {
        const i64 nv = width / VEC, items = (t1 - t0) * nv, nt = blockDim.x;
        for (i64 base = threadIdx.x; base < items; base += NV * nt) {
            float acc[NV][16 / sizeof(T)];
            i64 tt[NV], vv[NV];
#pragma unroll
            for (int u = 0; u < NV; ++u) {
                const i64 i = base + u * nt;
                tt[u] = t0 + i / nv;
                vv[u] = i - (i / nv) * nv;
#pragma unroll
                for (int q = 0; q < VEC; ++q) acc[u][q] = 0.0f;
            }
            for (i64 r = 0; r < world; ++r) {
                U128 raw[NV];
                bool use[NV];
#pragma unroll
                for (int u = 0; u < NV; ++u) {
                    use[u] = base + u * nt < items && sent_pos[tt[u] * world + r] >= 0;
                    if (use[u]) {
                        const char* src = r == rank ? (const char*)(out + tt[u] * width)
                                                    : partials + (r * tokens + tt[u]) * row_bytes;
                        raw[u] = ld_cg_v4(src + 16 * vv[u]);
                    }
                }
#pragma unroll
                for (int u = 0; u < NV; ++u) {
                    if (use[u]) {
                        const Vec16<T> pv = *(const Vec16<T>*)&raw[u];
#pragma unroll
                        for (int q = 0; q < VEC; ++q) acc[u][q] = __fadd_rn(acc[u][q], to_f32(pv.v[q]));
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < NV; ++u) {
                if (base + u * nt < items) {
                    Vec16<T> o;
#pragma unroll
                    for (int q = 0; q < VEC; ++q) o.v[q] = from_f32<T>(acc[u][q]);
                    st_v4(out + tt[u] * width + vv[u] * VEC, *(const U128*)&o);
                }
            }
        }
    } else {
        for (i64 i = threadIdx.x; i < (t1 - t0) * width; i += blockDim.x) {
            const i64 t = t0 + i / width, c = i - (i / width) * width;
            float acc = 0.0f;
            for (i64 r = 0; r < world; ++r) {
                if (sent_pos[t * world + r] < 0) continue;
                const char* src = r == rank ? (const char*)(out + t * width)
                                            : partials + (r * tokens + t) * row_bytes;
                acc = __fadd_rn(acc, to_f32(load_cg<T>(src + c * (i64)sizeof(T))));
            }
            out[t * width + c] = from_f32<T>(acc);
        }
    }
}

// block_sum_chunk as a call: inlined into the combine at the 72-register bound of the NV = 1
// shapes it spilled (ptxas -v), called it does not (once per consumer item).
template <typename T, int NV>
__device__ __noinline__ void block_sum_chunk_call(const char* partials, i64 rank,
                                                  const i32* sent_pos, T* out, i64 t0, i64 t1,
                                                  i64 tokens, i64 world, i64 width) {
    block_sum_chunk<T, NV>(partials, rank, sent_pos, out, t0, t1, tokens, world, width);
}

// The one-pass consumer of token t (ONEPASS below; tid < nt: the threads sharing the row, as in
// partial_row): out_row = the sum in ascending rank order of the partials of the ranks with
// pos_row[r] >= 0 (pos_row = sent_pos + t * W), in f32 from +0, rounded once, where this rank's
// own partial (when pos_row[rank] >= 0) is computed here as partial_row does (first: the warp's
// k_lane of fan_row) and never stored, and every other rank's is read from partials[r][t]. The
// same roundings in the same order as reduce_row into out followed by block_sum_chunk, without
// the round trip of the own partial through out (one write of out instead of two writes and a
// read). The first peer's vectors are loaded together with the own expert rows.
template <typename T, int NV>
__device__ __forceinline__ void partial_sum_row(T* out_row, KLane first, const i32* fan_row,
                                                const char* w_at, const T* y, i64 top_k,
                                                i64 width, const char* partials, i64 rank,
                                                const i32* pos_row, i64 t, i64 tokens, i64 world,
                                                i64 tid, i64 nt) {
    const int VEC = 16 / (int)sizeof(T);
    const i64 row_bytes = width * (i64)sizeof(T);
    const bool own = pos_row[rank] >= 0;
    if ((width % VEC) == 0 && aligned16(y) && aligned16(out_row) && aligned16(partials)) {
        // The first peer with a partial (world: none).
        i64 r1 = 0;
        while (r1 < world && (r1 == rank || pos_row[r1] < 0)) ++r1;
        const i64 nv = width / VEC;
        for (i64 base = 0; base < nv; base += NV * nt) {
            const RowVecs<NV> at = row_vecs<NV>(base + tid, nt, nv);
            U128 pre[NV];
            if (r1 < world) {
                const char* src = partials + (r1 * tokens + t) * row_bytes + at.off;
#pragma unroll
                for (int u = 0; u < NV; ++u)
                    if (at.ok[u]) pre[u] = ld_cg_v4(src + u * at.step);
            }
            float acc[NV][16 / sizeof(T)];
            // `own` is the same in every thread (weighted_sum shuffles).
            if (own) {
                weighted_sum<T, NV>(acc, at, first, fan_row, w_at, y, top_k, width);
            } else {
#pragma unroll
                for (int u = 0; u < NV; ++u) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[u][e] = 0.0f;
                }
            }
            // The rank-ordered sum; acc holds the own partial before rounding.
            float sum[NV][16 / sizeof(T)];
#pragma unroll
            for (int u = 0; u < NV; ++u) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) sum[u][e] = 0.0f;
            }
            for (i64 r = 0; r < world; ++r) {
                if (pos_row[r] < 0) continue;
                const char* src = partials + (r * tokens + t) * row_bytes + at.off;
#pragma unroll
                for (int u = 0; u < NV; ++u) {
                    if (!at.ok[u]) continue;
                    if (r == rank) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e)
                            sum[u][e] = __fadd_rn(sum[u][e], to_f32(from_f32<T>(acc[u][e])));
                    } else {
                        const U128 raw = r == r1 ? pre[u] : ld_cg_v4(src + u * at.step);
                        const Vec16<T> pv = *(const Vec16<T>*)&raw;
#pragma unroll
                        for (int e = 0; e < VEC; ++e)
                            sum[u][e] = __fadd_rn(sum[u][e], to_f32(pv.v[e]));
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < NV; ++u)
                if (at.ok[u]) store_rounded<T>((char*)out_row + at.off + u * at.step, sum[u]);
        }
    } else {
        for (i64 c = tid; c < width; c += nt) {
            const float acc = own ? weighted_column<T>(fan_row, w_at, y, top_k, width, c) : 0.0f;
            float sum = 0.0f;
            for (i64 r = 0; r < world; ++r) {
                if (pos_row[r] < 0) continue;
                const float p = r == rank ? to_f32(from_f32<T>(acc))
                                          : to_f32(load_cg<T>(partials + (r * tokens + t) * row_bytes +
                                                              c * (i64)sizeof(T)));
                sum = __fadd_rn(sum, p);
            }
            out_row[c] = from_f32<T>(sum);
        }
    }
}

// Where the combine's weights of token t of source s lie: the wire row `row` (given at dispatch)
// or, when late, w_area ([W, T, K], slot s from rank s).
__device__ __forceinline__ const char* combine_w_at(const char* row, i64 meta_off, i64 top_k,
                                                    unsigned late, const float* w_area, i64 s,
                                                    i64 t, i64 tokens) {
    return late != 0 ? (const char*)(w_area + (s * tokens + t) * top_k)
                     : row + meta_off + 4 + 4 * top_k;
}

// Whether slot t of source s (rows_s: its rows) holds a row the combine reduces: for a producer,
// the source's wire row carries token t; for the consumer (s == rank), token t went to this rank.
// The same in every thread of the block.
__device__ __forceinline__ bool combine_has_row(bool consumer, const char* rows_s, i64 stride,
                                                i64 meta_off, const i32* sent_pos, i64 world,
                                                i64 rank, i64 t) {
    return consumer ? sent_pos[t * world + rank] >= 0
                    : ld_cg_i32(rows_s + t * stride + meta_off) == t;
}

// rows / partials / chunk flags: this rank's symmetric regions (local addresses). late: the
// weights come from w_area ([W, T, K], slot s from rank s), an item of source s waiting for
// weight flag s only (a block never waits for weights it does not read); else from the wire
// rows. The last block resets the ticket counter. ONEPASS: the consumer waits for the chunk
// from every peer first, then computes each token's own partial and the rank-ordered sum in
// one pass (partial_sum_row); else it stores its own partials into out, waits, and sums
// (block_sum_chunk).
//
// NV: 16-byte vectors per thread and round, for the block shape the kernel is launched with
// (kernels/src/moe/fused.rs, CombineBlock; the code is correct for any block size). PREFETCH:
// every loop over a chunk's tokens reads the next token's k_lane (fan row and weights) and,
// producers and the two-pass consumer, whether its slot holds a row, before it reduces this
// token's expert rows, so that their round trip overlaps this token's loads instead of
// preceding the next token's. Neither changes a result (every element's sum keeps its order).
template <typename T, bool ONEPASS, int NV, bool PREFETCH>
__device__ void nvl_combine_fused(const unsigned* w_flags, unsigned* state, u64 timeout_ns,
                                  const char* rows, const char* partials, const unsigned* flags,
                                  i64 rank, const T* y, const i32* fan, const i32* sent_pos,
                                  T* out, i64 tokens, i64 top_k, i64 world, i64 width,
                                  i64 stride, i64 meta_off, unsigned late, const float* w_area,
                                  const u64* peer_sym, i64 partials_off, i64 chunk_flags_off,
                                  i64 chunk, i64 lag, unsigned* status) {
    const unsigned epoch = *(volatile unsigned*)state;
    const i64 n = (tokens + chunk - 1) / chunk;
    const i64 row_bytes = width * (i64)sizeof(T);
    for (;;) {
        const Item it = item_of(block_ticket(state + 6), n, world - 1, 1, lag);
        if (!it.valid) break;
        const i64 t0 = it.chunk * chunk, t1 = t0 + chunk < tokens ? t0 + chunk : tokens;
        // Producer: partials of source s; consumer: this rank's own tokens.
        const i64 s = it.consumer ? rank : (rank + 1 + it.index) % world;
        const char* rows_s = rows + s * tokens * stride;
        const i32* fan_s = fan + s * tokens * top_k;
        // Late weights: only source s's (this rank's own were raised earlier on this stream).
        if (late != 0)
            block_wait_strided(w_flags + s, 1, 0, -1, epoch, timeout_ns, status,
                               MOE_GAVE_UP_COMBINE, s);
        // PREFETCH: token t's slot test and k_lane, read while token t - 1 was reduced.
        bool has_next = false;
        KLane next = {-1, 0.0f};
        if (PREFETCH && t0 < t1) {
            if (!(ONEPASS && it.consumer))
                has_next = combine_has_row(it.consumer, rows_s, stride, meta_off, sent_pos, world,
                                           rank, t0);
            next = k_lane(fan_s + t0 * top_k,
                          combine_w_at(rows_s + t0 * stride, meta_off, top_k, late, w_area, s, t0,
                                       tokens),
                          top_k, 0);
        }
        if (ONEPASS && it.consumer) {
            block_wait_strided(flags + it.chunk, world, n, rank, epoch, timeout_ns, status,
                               MOE_GAVE_UP_COMBINE, 0);
            for (i64 t = t0; t < t1; ++t) {
                const char* w_at = combine_w_at(rows + (s * tokens + t) * stride, meta_off, top_k,
                                                late, w_area, s, t, tokens);
                const i32* fan_row = fan + (s * tokens + t) * top_k;
                KLane first = next;
                if (!PREFETCH) {
                    first = k_lane(fan_row, w_at, top_k, 0);
                } else if (t + 1 < t1) {
                    next = k_lane(fan_row + top_k,
                                  combine_w_at(rows_s + (t + 1) * stride, meta_off, top_k, late,
                                               w_area, s, t + 1, tokens),
                                  top_k, 0);
                }
                partial_sum_row<T, NV>(out + t * width, first, fan_row, w_at, y, top_k, width,
                                       partials, rank, sent_pos + t * world, t, tokens, world,
                                       threadIdx.x, blockDim.x);
            }
            continue;
        }
        for (i64 t = t0; t < t1; ++t) {
            const char* row = rows + (s * tokens + t) * stride;
            const i32* fan_row = fan + (s * tokens + t) * top_k;
            bool has = has_next;
            KLane first = next;
            if (!PREFETCH) {
                // Own tokens: the slot holds a row iff the token went to this rank.
                has = it.consumer ? sent_pos[t * world + rank] >= 0
                                  : ld_cg_i32(row + meta_off) == t;
            } else if (t + 1 < t1) {
                has_next = combine_has_row(it.consumer, rows_s, stride, meta_off, sent_pos, world,
                                           rank, t + 1);
                next = k_lane(fan_row + top_k,
                              combine_w_at(row + stride, meta_off, top_k, late, w_area, s, t + 1,
                                           tokens),
                              top_k, 0);
            }
            if (!has) continue;
            const char* w_at = combine_w_at(row, meta_off, top_k, late, w_area, s, t, tokens);
            T* dst = it.consumer ? out + t * width
                                 : (T*)((char*)peer_sym[s] + partials_off +
                                        (rank * tokens + t) * row_bytes);
            if (PREFETCH)
                partial_row<T, NV>(dst, first, fan_row, w_at, y, top_k, width, threadIdx.x,
                                   blockDim.x);
            else
                reduce_row<T, NV>(dst, fan_row, w_at, y, top_k, width);
        }
        if (it.consumer) {
            // The own partials first (they need nothing from the peers), then the peers'.
            __syncthreads();
            block_wait_strided(flags + it.chunk, world, n, rank, epoch, timeout_ns, status,
                               MOE_GAVE_UP_COMBINE, 0);
            if (NV == 1)
                block_sum_chunk_call<T, NV>(partials, rank, sent_pos, out, t0, t1, tokens, world,
                                            width);
            else
                block_sum_chunk<T, NV>(partials, rank, sent_pos, out, t0, t1, tokens, world, width);
        } else {
            release_chunk(peer_sym, chunk_flags_off, world, rank, s, n, it.chunk, epoch);
        }
    }
    if (grid_last_block<false>(state + 3)) {
        if (threadIdx.x == 0) state[6] = 0u;
    }
}

// ---- typed entry points ----------------------------------------------------------------------
//
// moe_nvl_dispatch_fused_<T> takes the wire format as an argument (every format's code in one
// kernel: at the 128-register bound of ROW_KERNEL it spills, measured with ptxas -v);
// moe_nvl_dispatch_fused_{native,fp8t,fp8b}_<T> are the same code for one format each (the
// `wire` argument is ignored), none of which spills (per-token FP8 quantises one 16-element
// chunk per thread and round of loads for that). moe_nvl_combine_fused_onepass_<T> is the
// combine with the one-pass consumer (see nvl_combine_fused).
//
// The block combine comes in block shapes (kernels/src/moe/fused.rs, CombineBlock), each its own
// kernel with its launch bounds: moe_nvl_combine_fused[_onepass]_<T> 256 threads, 2 blocks per
// SM, NV = 2 (ROW_KERNEL); the suffix b<threads>x<blocks per SM>[n1] another shape (n1: NV = 1,
// else 2), e.g. _b448x1 (448 threads, 1 block per SM, NV = 2: a 7168-wide bf16 row, 896
// vectors, in one round); a final `p` the PREFETCH variant (_b256x2p for the first shape), for
// the NV = 2 shapes only: at the 72-register bound of the NV = 1 shapes the one-pass kernel with
// PREFETCH spilled (ptxas -v).

#define MOE_FUSED_DISPATCH_PARAMS(T)                                                               \
    const T *x, const i32 *topk_idx, const float *weights, i64 tokens, i64 top_k, i64 experts,     \
        i64 local_experts, i64 world, i64 rank, i64 hidden, unsigned wire, i64 stride,             \
        i64 scale_off, i64 meta_off, const u64 *peer_sym, i64 rows_off, i64 token_flags_off,       \
        char *sym, i64 counts_off, i64 chunk, i64 lag, u64 timeout_ns, i32 *cnt, i32 *recv_cnt,    \
        i32 *sent_pos, unsigned *status, unsigned *state, T *expert_x, i32 *routing, i32 *fan,     \
        i32 *ecnt, i64 capacity, i32 *expert_counts

#define MOE_FUSED_DISPATCH_BODY(T, WIRE, QB)                                                       \
    {                                                                                              \
        OwnFanOut own = {(char*)expert_x, routing, fan, ecnt, capacity};                           \
        nvl_dispatch_fused<T, QB>(x, topk_idx, weights, tokens, top_k, experts, local_experts,     \
                                  world, rank, hidden, WIRE, stride, scale_off, meta_off,          \
                                  peer_sym, rows_off, token_flags_off, sym, counts_off, chunk,     \
                                  lag, timeout_ns, cnt, recv_cnt, sent_pos, status, state, own,    \
                                  expert_counts);                                                  \
    }

#define MOE_FUSED_COMBINE_PARAMS(T)                                                                \
    const unsigned *w_flags, unsigned *state, u64 timeout_ns, const char *rows,                    \
        const char *partials, const unsigned *flags, i64 rank, const T *y, const i32 *fan,         \
        const i32 *sent_pos, T *out, i64 tokens, i64 top_k, i64 world, i64 width, i64 stride,      \
        i64 meta_off, unsigned late, const float *w_area, const u64 *peer_sym, i64 partials_off,   \
        i64 chunk_flags_off, i64 chunk, i64 lag, unsigned *status

#define MOE_FUSED_COMBINE_BODY(T, ONEPASS, NV, PREFETCH)                                          \
    {                                                                                              \
        nvl_combine_fused<T, ONEPASS, NV, PREFETCH>(                                               \
            w_flags, state, timeout_ns, rows, partials, flags, rank, y, fan, sent_pos, out,        \
            tokens, top_k, world, width, stride, meta_off, late, w_area, peer_sym, partials_off,   \
            chunk_flags_off, chunk, lag, status);                                                  \
    }

#define MF_KERNEL_moe_nvl_dispatch_fused(T)                                                        \
    extern "C" __global__ void ROW_KERNEL moe_nvl_dispatch_fused_##T(                              \
        MOE_FUSED_DISPATCH_PARAMS(T)) MOE_FUSED_DISPATCH_BODY(T, wire, FP8_BATCH)
#define MF_KERNEL_moe_nvl_dispatch_fused_native(T)                                                 \
    extern "C" __global__ void ROW_KERNEL moe_nvl_dispatch_fused_native_##T(                       \
        MOE_FUSED_DISPATCH_PARAMS(T)) MOE_FUSED_DISPATCH_BODY(T, WIRE_NATIVE, FP8_BATCH)
#define MF_KERNEL_moe_nvl_dispatch_fused_fp8t(T)                                                   \
    extern "C" __global__ void ROW_KERNEL moe_nvl_dispatch_fused_fp8t_##T(                         \
        MOE_FUSED_DISPATCH_PARAMS(T)) MOE_FUSED_DISPATCH_BODY(T, WIRE_FP8_TOKEN, 1)
#define MF_KERNEL_moe_nvl_dispatch_fused_fp8b(T)                                                   \
    extern "C" __global__ void ROW_KERNEL moe_nvl_dispatch_fused_fp8b_##T(                         \
        MOE_FUSED_DISPATCH_PARAMS(T)) MOE_FUSED_DISPATCH_BODY(T, WIRE_FP8_BLOCK, FP8_BATCH)
// Launch bounds of the block combine's shapes other than ROW_KERNEL's 256 x 2 (threads, blocks per
// SM; ptxas caps the registers at 65536 / (threads * blocks), e.g. 72 for 448 x 2).
#define COMBINE_448X1 __launch_bounds__(448, 1)
#define COMBINE_448X2 __launch_bounds__(448, 2)
#define COMBINE_896X1 __launch_bounds__(896, 1)
#define COMBINE_512X1 __launch_bounds__(512, 1)
#define COMBINE_224X4 __launch_bounds__(224, 4)
#define COMBINE_128X8 __launch_bounds__(128, 8)
#define MF_KERNEL_moe_nvl_combine_fused(T)                                                         \
    extern "C" __global__ void ROW_KERNEL moe_nvl_combine_fused_##T(                               \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 2, false)
#define MF_KERNEL_moe_nvl_combine_fused_onepass(T)                                                 \
    extern "C" __global__ void ROW_KERNEL moe_nvl_combine_fused_onepass_##T(                       \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 2, false)
#define MF_KERNEL_moe_nvl_combine_fused_b256x2p(T)                                                 \
    extern "C" __global__ void ROW_KERNEL moe_nvl_combine_fused_b256x2p_##T(                       \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 2, true)
#define MF_KERNEL_moe_nvl_combine_fused_onepass_b256x2p(T)                                         \
    extern "C" __global__ void ROW_KERNEL moe_nvl_combine_fused_onepass_b256x2p_##T(               \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 2, true)
#define MF_KERNEL_moe_nvl_combine_fused_b448x1(T)                                                  \
    extern "C" __global__ void COMBINE_448X1 moe_nvl_combine_fused_b448x1_##T(                     \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 2, false)
#define MF_KERNEL_moe_nvl_combine_fused_onepass_b448x1(T)                                          \
    extern "C" __global__ void COMBINE_448X1 moe_nvl_combine_fused_onepass_b448x1_##T(             \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 2, false)
#define MF_KERNEL_moe_nvl_combine_fused_b448x1p(T)                                                 \
    extern "C" __global__ void COMBINE_448X1 moe_nvl_combine_fused_b448x1p_##T(                    \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 2, true)
#define MF_KERNEL_moe_nvl_combine_fused_onepass_b448x1p(T)                                         \
    extern "C" __global__ void COMBINE_448X1 moe_nvl_combine_fused_onepass_b448x1p_##T(            \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 2, true)
#define MF_KERNEL_moe_nvl_combine_fused_b448x2n1(T)                                                \
    extern "C" __global__ void COMBINE_448X2 moe_nvl_combine_fused_b448x2n1_##T(                   \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 1, false)
#define MF_KERNEL_moe_nvl_combine_fused_onepass_b448x2n1(T)                                        \
    extern "C" __global__ void COMBINE_448X2 moe_nvl_combine_fused_onepass_b448x2n1_##T(           \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 1, false)
#define MF_KERNEL_moe_nvl_combine_fused_b896x1n1(T)                                                \
    extern "C" __global__ void COMBINE_896X1 moe_nvl_combine_fused_b896x1n1_##T(                   \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 1, false)
#define MF_KERNEL_moe_nvl_combine_fused_onepass_b896x1n1(T)                                        \
    extern "C" __global__ void COMBINE_896X1 moe_nvl_combine_fused_onepass_b896x1n1_##T(           \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 1, false)
#define MF_KERNEL_moe_nvl_combine_fused_b512x1(T)                                                  \
    extern "C" __global__ void COMBINE_512X1 moe_nvl_combine_fused_b512x1_##T(                     \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 2, false)
#define MF_KERNEL_moe_nvl_combine_fused_onepass_b512x1(T)                                          \
    extern "C" __global__ void COMBINE_512X1 moe_nvl_combine_fused_onepass_b512x1_##T(             \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 2, false)
#define MF_KERNEL_moe_nvl_combine_fused_b512x1p(T)                                                 \
    extern "C" __global__ void COMBINE_512X1 moe_nvl_combine_fused_b512x1p_##T(                    \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 2, true)
#define MF_KERNEL_moe_nvl_combine_fused_b224x4n1(T)                                                \
    extern "C" __global__ void COMBINE_224X4 moe_nvl_combine_fused_b224x4n1_##T(                   \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 1, false)
#define MF_KERNEL_moe_nvl_combine_fused_onepass_b224x4n1(T)                                        \
    extern "C" __global__ void COMBINE_224X4 moe_nvl_combine_fused_onepass_b224x4n1_##T(           \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 1, false)
#define MF_KERNEL_moe_nvl_combine_fused_b128x8n1(T)                                                \
    extern "C" __global__ void COMBINE_128X8 moe_nvl_combine_fused_b128x8n1_##T(                   \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, false, 1, false)
#define MF_KERNEL_moe_nvl_combine_fused_onepass_b128x8n1(T)                                        \
    extern "C" __global__ void COMBINE_128X8 moe_nvl_combine_fused_onepass_b128x8n1_##T(           \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 1, false)
#define MF_KERNEL_moe_nvl_combine_fused_onepass_b512x1p(T)                                         \
    extern "C" __global__ void COMBINE_512X1 moe_nvl_combine_fused_onepass_b512x1p_##T(            \
        MOE_FUSED_COMBINE_PARAMS(T)) MOE_FUSED_COMBINE_BODY(T, true, 2, true)
