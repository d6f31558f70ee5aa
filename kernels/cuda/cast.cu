// Casts between f32, bf16 and f16 (through f32, round to nearest even), and between i32 and i64
// (i64 -> i32 keeps the low 32 bits).

template <typename S, typename D>
__device__ void cast_float(const S* in, D* out, i64 n) {
    for (i64 i = thread_index(); i < n; i += thread_count()) out[i] = from_f32<D>(to_f32(in[i]));
}

#define MF_CAST(S, D) \
    extern "C" __global__ void cast_##S##_##D(const S* in, D* out, i64 n) { cast_float<S, D>(in, out, n); }

MF_CAST(f32, bf16)
MF_CAST(f32, f16)
MF_CAST(bf16, f32)
MF_CAST(bf16, f16)
MF_CAST(f16, f32)
MF_CAST(f16, bf16)

extern "C" __global__ void cast_i32_i64(const i32* in, i64* out, i64 n) {
    for (i64 i = thread_index(); i < n; i += thread_count()) out[i] = (i64)in[i];
}
extern "C" __global__ void cast_i64_i32(const i64* in, i32* out, i64 n) {
    for (i64 i = thread_index(); i < n; i += thread_count()) out[i] = (i32)(unsigned int)(u64)in[i];
}
