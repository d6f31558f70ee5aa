// Elementwise binary (add, sub, mul) and unary (gelu tanh, silu) kernels for f32, bf16 and f16.
// Math in f32; 128-bit vectorized main loop when all pointers are 16-byte aligned, scalar tail.
// In-place use (out == a, out == b or out == x) is allowed.

struct AddOp { __device__ float operator()(float a, float b) const { return a + b; } };
struct SubOp { __device__ float operator()(float a, float b) const { return a - b; } };
struct MulOp { __device__ float operator()(float a, float b) const { return a * b; } };

struct GeluOp {
    __device__ float operator()(float x) const {
        const float k = 0.7978845608028654f;  // sqrt(2 / pi)
        // 0.5 x (1 + tanh z) written as x / (1 + e^(-2z)): the same function, without the
        // cancellation of 1 + tanh z in f32 for negative z (where the result is tiny).
        return x / (1.0f + expf(-2.0f * k * (x + 0.044715f * x * x * x)));
    }
};
struct SiluOp {
    __device__ float operator()(float x) const { return x / (1.0f + expf(-x)); }
};

template <typename T, typename Op>
__device__ void binary(const T* a, const T* b, T* out, i64 n) {
    constexpr int V = 16 / sizeof(T);
    Op op;
    const i64 start = thread_index(), step = thread_count();
    const i64 nvec = (aligned16(a) && aligned16(b) && aligned16(out)) ? n / V : 0;
    for (i64 i = start; i < nvec; i += step) {
        Vec16<T> x = reinterpret_cast<const Vec16<T>*>(a)[i];
        Vec16<T> y = reinterpret_cast<const Vec16<T>*>(b)[i];
        Vec16<T> z;
#pragma unroll
        for (int j = 0; j < V; ++j) z.v[j] = from_f32<T>(op(to_f32(x.v[j]), to_f32(y.v[j])));
        reinterpret_cast<Vec16<T>*>(out)[i] = z;
    }
    for (i64 i = nvec * V + start; i < n; i += step) out[i] = from_f32<T>(op(to_f32(a[i]), to_f32(b[i])));
}

template <typename T, typename Op>
__device__ void unary(const T* x, T* out, i64 n) {
    constexpr int V = 16 / sizeof(T);
    Op op;
    const i64 start = thread_index(), step = thread_count();
    const i64 nvec = (aligned16(x) && aligned16(out)) ? n / V : 0;
    for (i64 i = start; i < nvec; i += step) {
        Vec16<T> v = reinterpret_cast<const Vec16<T>*>(x)[i];
#pragma unroll
        for (int j = 0; j < V; ++j) v.v[j] = from_f32<T>(op(to_f32(v.v[j])));
        reinterpret_cast<Vec16<T>*>(out)[i] = v;
    }
    for (i64 i = nvec * V + start; i < n; i += step) out[i] = from_f32<T>(op(to_f32(x[i])));
}

#define MF_BINARY(NAME, OP, T) \
    extern "C" __global__ void binary_##NAME##_##T(const T* a, const T* b, T* out, i64 n) { binary<T, OP>(a, b, out, n); }
#define MF_UNARY(NAME, OP, T) \
    extern "C" __global__ void unary_##NAME##_##T(const T* x, T* out, i64 n) { unary<T, OP>(x, out, n); }
#define MF_ALL_OPS(T) \
    MF_BINARY(add, AddOp, T) MF_BINARY(sub, SubOp, T) MF_BINARY(mul, MulOp, T) \
    MF_UNARY(gelu, GeluOp, T) MF_UNARY(silu, SiluOp, T)

MF_ALL_OPS(f32)
MF_ALL_OPS(bf16)
MF_ALL_OPS(f16)
