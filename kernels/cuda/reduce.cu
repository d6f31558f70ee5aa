// Sum over one axis with f32 accumulation. The input is viewed as [outer, axis, inner] and the
// output as [outer, inner]. `sum_axis_*`: one thread per output element (coalesced over inner);
// `sum_rows_*` (inner == 1): one block per row, warp-shuffle tree. Output is the input type or f32.

template <typename T, typename O>
__device__ void sum_axis(const T* in, O* out, i64 outer, i64 axis, i64 inner) {
    const i64 n = outer * inner;
    for (i64 i = thread_index(); i < n; i += thread_count()) {
        const i64 o = i / inner, j = i % inner;
        const T* p = in + o * axis * inner + j;
        float acc = 0.0f;
        for (i64 k = 0; k < axis; ++k) acc += to_f32(p[k * inner]);
        out[i] = from_f32<O>(acc);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

// blockDim.x must be a multiple of 32 (the host launches 256 threads).
template <typename T, typename O>
__device__ void sum_rows(const T* in, O* out, i64 rows, i64 cols) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* p = in + row * cols;
        float acc = 0.0f;
        for (i64 k = threadIdx.x; k < cols; k += blockDim.x) acc += to_f32(p[k]);
        acc = warp_sum(acc);
        if (lane == 0) partial[warp] = acc;
        __syncthreads();
        if (warp == 0) {
            float v = lane < warps ? partial[lane] : 0.0f;
            v = warp_sum(v);
            if (lane == 0) out[row] = from_f32<O>(v);
        }
        __syncthreads();
    }
}

#define MF_SUM(T, O) \
    extern "C" __global__ void sum_axis_##T##_##O(const T* in, O* out, i64 outer, i64 axis, i64 inner) { sum_axis<T, O>(in, out, outer, axis, inner); } \
    extern "C" __global__ void sum_rows_##T##_##O(const T* in, O* out, i64 rows, i64 cols) { sum_rows<T, O>(in, out, rows, cols); }

MF_SUM(f32, f32)
MF_SUM(bf16, bf16)
MF_SUM(bf16, f32)
MF_SUM(f16, f16)
MF_SUM(f16, f32)
