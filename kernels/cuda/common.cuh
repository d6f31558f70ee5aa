// common.cuh: prepended by the host to every kernels/cuda/*.cu source before NVRTC compiles it.
// No CUDA headers are needed: bf16/f16 are plain 16-bit storage types converted with PTX or bit
// arithmetic, and all math is done in f32.

typedef long long i64;
typedef unsigned long long u64;
typedef float f32;
typedef int i32;

// 16-bit float storage types (distinct types so overloads pick the right conversion).
struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((unsigned int)x.bits) << 16); }
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
// Round to nearest even; NaN stays a (quiet) NaN. Matches half::bf16::from_f32 bit for bit.
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    unsigned int u = __float_as_uint(x);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = (unsigned short)(u >> 16);
    }
    return r;
}
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// Grid-stride loop helpers.
__device__ __forceinline__ i64 thread_index() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ i64 thread_count() { return (i64)gridDim.x * blockDim.x; }

// 16 bytes of T, for vectorized (128-bit) loads and stores.
template <typename T> struct alignas(16) Vec16 { T v[16 / sizeof(T)]; };

__device__ __forceinline__ bool aligned16(const void* p) { return (((u64)p) & 15u) == 0; }
