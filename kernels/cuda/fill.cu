// Fill a buffer with one raw 1/2/4/8-byte value (zeroing, constants, NaN poisoning in tests).

template <typename T>
__device__ void fill(T* out, T value, i64 n) {
    for (i64 i = thread_index(); i < n; i += thread_count()) out[i] = value;
}

#define MF_FILL(BYTES, T) \
    extern "C" __global__ void fill_b##BYTES(T* out, T value, i64 n) { fill<T>(out, value, n); }

MF_FILL(1, unsigned char)
MF_FILL(2, unsigned short)
MF_FILL(4, unsigned int)
MF_FILL(8, u64)
