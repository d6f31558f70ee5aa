/* Stub for bindgen: nccl.h's host API only needs cudaStream_t. No CUDA toolkit required. */
#include <stddef.h>
#include <stdint.h>
#define CUDART_VERSION 13000
typedef struct CUstream_st *cudaStream_t;
