// Kernels along one axis: max/min/avg reductions, softmax and rms_norm, for f32, bf16 and f16.
// The input is viewed as [outer, n, inner] around the axis; one thread handles one (outer,
// inner) position and walks the axis in ascending order with f32 arithmetic, rounding once to
// the output type (so results do not depend on the launch shape). Outputs are packed:
// [outer, inner] for the reductions, [outer, n, inner] otherwise.

__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

// OP: 0 = max, 1 = min, 2 = avg.
template <typename T, int OP>
__device__ void reduce_rows(const T* in, T* out, i64 outer, i64 n, i64 inner) {
    const i64 total = outer * inner;
    for (i64 t = thread_index(); t < total; t += thread_count()) {
        const i64 o = t / inner, j = t % inner;
        const T* p = in + o * n * inner + j;
        float acc = OP == 0 ? -pos_inf() : (OP == 1 ? pos_inf() : 0.0f);
        for (i64 k = 0; k < n; ++k) {
            const float v = to_f32(p[k * inner]);
            acc = OP == 0 ? fmaxf(acc, v) : (OP == 1 ? fminf(acc, v) : acc + v);
        }
        if (OP == 2 && n > 0) acc /= (float)n;
        out[t] = from_f32<T>(acc);
    }
}

template <typename T>
__device__ void softmax_rows(const T* in, T* out, i64 outer, i64 n, i64 inner) {
    const i64 total = outer * inner;
    for (i64 t = thread_index(); t < total; t += thread_count()) {
        const i64 base = (t / inner) * n * inner + t % inner;
        float m = -pos_inf();
        for (i64 k = 0; k < n; ++k) m = fmaxf(m, to_f32(in[base + k * inner]));
        float s = 0.0f;
        for (i64 k = 0; k < n; ++k) s += expf(to_f32(in[base + k * inner]) - m);
        for (i64 k = 0; k < n; ++k)
            out[base + k * inner] = from_f32<T>(expf(to_f32(in[base + k * inner]) - m) / s);
    }
}

// `eps` is passed as the bits of an f32.
template <typename T>
__device__ void rms_norm_rows(const T* in, const T* w, T* out, i64 outer, i64 n, i64 inner,
                              unsigned int eps_bits) {
    const float eps = __uint_as_float(eps_bits);
    const i64 total = outer * inner;
    for (i64 t = thread_index(); t < total; t += thread_count()) {
        const i64 base = (t / inner) * n * inner + t % inner;
        float ss = 0.0f;
        for (i64 k = 0; k < n; ++k) {
            const float v = to_f32(in[base + k * inner]);
            ss += v * v;
        }
        const float scale = 1.0f / sqrtf(ss / (float)(n > 0 ? n : 1) + eps);
        for (i64 k = 0; k < n; ++k)
            out[base + k * inner] = from_f32<T>(to_f32(in[base + k * inner]) * scale * to_f32(w[k]));
    }
}

#define MF_ROWS(T) \
    extern "C" __global__ void rows_max_##T(const T* in, T* out, i64 outer, i64 n, i64 inner) { reduce_rows<T, 0>(in, out, outer, n, inner); } \
    extern "C" __global__ void rows_min_##T(const T* in, T* out, i64 outer, i64 n, i64 inner) { reduce_rows<T, 1>(in, out, outer, n, inner); } \
    extern "C" __global__ void rows_avg_##T(const T* in, T* out, i64 outer, i64 n, i64 inner) { reduce_rows<T, 2>(in, out, outer, n, inner); } \
    extern "C" __global__ void rows_softmax_##T(const T* in, T* out, i64 outer, i64 n, i64 inner) { softmax_rows<T>(in, out, outer, n, inner); } \
    extern "C" __global__ void rows_rms_norm_##T(const T* in, const T* w, T* out, i64 outer, i64 n, i64 inner, unsigned int eps_bits) { rms_norm_rows<T>(in, w, out, outer, n, inner, eps_bits); }

MF_ROWS(f32)
MF_ROWS(bf16)
MF_ROWS(f16)
