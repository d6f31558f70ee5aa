/* Empty stub for bindgen (nccl.h includes it; the host API does not use it). */
