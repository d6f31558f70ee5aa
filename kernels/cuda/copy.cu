// Strided copy of up to 4-D tensors (permutes, non-contiguous views). Elements are moved as raw
// 1/2/4/8-byte words, so one kernel per element size serves every dtype. The logical index runs
// over `size` in row-major order; strides are in elements and may differ for source and target.

struct StridedArgs {
    i64 size[4];
    i64 src_stride[4];
    i64 dst_stride[4];
    i64 n;  // product of size
};

template <typename T>
__device__ void strided_copy(const T* src, T* dst, const StridedArgs& a) {
    for (i64 i = thread_index(); i < a.n; i += thread_count()) {
        i64 rest = i, s = 0, d = 0;
#pragma unroll
        for (int dim = 3; dim >= 0; --dim) {
            const i64 idx = rest % a.size[dim];
            rest /= a.size[dim];
            s += idx * a.src_stride[dim];
            d += idx * a.dst_stride[dim];
        }
        dst[d] = src[s];
    }
}

#define MF_COPY(BYTES, T) \
    extern "C" __global__ void strided_copy_b##BYTES(const T* src, T* dst, StridedArgs a) { strided_copy<T>(src, dst, a); }

MF_COPY(1, unsigned char)
MF_COPY(2, unsigned short)
MF_COPY(4, unsigned int)
MF_COPY(8, u64)
