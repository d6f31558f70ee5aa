//! meshflow-kernels: the only crate with unsafe code and FFI (CUDA driver, cuBLAS, NVRTC, NCCL).
