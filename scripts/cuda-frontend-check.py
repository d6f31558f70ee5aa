#!/usr/bin/env python3
"""Front-end check of kernels/cuda/*.cu without nvcc or NVRTC: parses each source (with the
common prelude and its appended parts, as NVRTC sees it, and every typed kernel instantiated for
every float type: scripts/kernel_units.py) as CUDA device code with libclang and prints every
diagnostic.
It catches syntax errors, undeclared names, type errors and bad template instantiations; it
does not generate code (register pressure, PTX assembly of inline asm and link errors are
still NVRTC's to find on a GPU machine).

Needs libclang (Debian: libclang-14-dev or newer) and clang's own CUDA wrapper headers
(`__clang_cuda_*.h`, shipped with libclang's resource directory); no CUDA toolkit. The few
declarations the CUDA toolkit would provide (vector types, atomics) are declared below.

    python3 scripts/cuda-frontend-check.py            # every kernels/cuda/*.cu
    python3 scripts/cuda-frontend-check.py moe.cu     # some of them (an appended part: its source)

Exit status 0 when no source has an error."""

import ctypes
import glob
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_units  # noqa: E402

PRELUDE = r"""
#define CUDA_VERSION 12000
typedef unsigned long size_t;
typedef unsigned int cuuint32_t;
#define INT_MAX 2147483647
#define INT_MIN (-INT_MAX - 1)
#define HUGE_VAL __builtin_huge_val()
#define HUGE_VALF __builtin_huge_valf()
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __host__ __attribute__((host))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#include "__clang_cuda_builtin_vars.h"
#define __DEVICE__ static __device__ __forceinline__
#include "__clang_cuda_libdevice_declares.h"
#include "__clang_cuda_device_functions.h"
#include "__clang_cuda_math.h"
#undef __DEVICE__
VECTOR_TYPES
#include "__clang_cuda_intrinsics.h"
__device__ int atomicAdd(int* p, int v);
__device__ unsigned atomicAdd(unsigned* p, unsigned v);
__device__ float atomicAdd(float* p, float v);
__device__ unsigned atomicOr(unsigned* p, unsigned v);
__device__ int atomicMax(int* p, int v);
__device__ unsigned atomicMax(unsigned* p, unsigned v);
__device__ int atomicExch(int* p, int v);
__device__ unsigned atomicExch(unsigned* p, unsigned v);
__device__ int atomicCAS(int* p, int cmp, int v);
__device__ unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v);
"""


def vector_types():
    base = {
        "char": "char", "uchar": "unsigned char", "short": "short", "ushort": "unsigned short",
        "int": "int", "uint": "unsigned int", "longlong": "long long",
        "ulonglong": "unsigned long long", "float": "float", "double": "double",
    }
    out = []
    for name, ty in base.items():
        out.append(f"struct {name}2 {{ {ty} x, y; }};")
        out.append(f"struct {name}4 {{ {ty} x, y, z, w; }};")
    return "\n".join(out)


def find_libclang():
    for pattern in ["/usr/lib/llvm-*/lib/libclang.so", "/usr/lib/llvm-*/lib/libclang-*.so*",
                    "/usr/lib/x86_64-linux-gnu/libclang-*.so*"]:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


class CXString(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("flags", ctypes.c_uint)]


def check(lib, name, workdir):
    text = kernel_units.check_text(name)
    full = os.path.join(workdir, name)
    with open(full, "w") as f:
        f.write(text)
    args = ["-x", "cuda", "--cuda-device-only", "-nocudainc", "-nocudalib",
            "--cuda-gpu-arch=sm_80", "-std=c++17", "-I", os.path.join(workdir, "inc"),
            "-include", os.path.join(workdir, "prelude.h")]
    argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
    index = lib.clang_createIndex(0, 0)
    tu = ctypes.c_void_p()
    rc = lib.clang_parseTranslationUnit2(index, full.encode(), argv, len(args), None, 0, 0,
                                         ctypes.byref(tu))
    if rc != 0:
        print(f"{name}: libclang could not parse it (error {rc})")
        return 1
    errors = 0
    for i in range(lib.clang_getNumDiagnostics(tu)):
        d = lib.clang_getDiagnostic(tu, i)
        severity = lib.clang_getDiagnosticSeverity(d)
        msg = lib.clang_getCString(lib.clang_formatDiagnostic(d, 0x1 | 0x2 | 0x4)).decode()
        print(msg)
        errors += severity >= 3
    print(f"{name}: {errors} error(s)")
    return errors


def main():
    so = find_libclang()
    if so is None:
        print("skipped: no libclang found (install libclang-dev)")
        return 0
    lib = ctypes.CDLL(so)
    lib.clang_createIndex.restype = ctypes.c_void_p
    lib.clang_parseTranslationUnit2.argtypes = [
        ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int,
        ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
    lib.clang_getNumDiagnostics.argtypes = [ctypes.c_void_p]
    lib.clang_getDiagnostic.restype = ctypes.c_void_p
    lib.clang_getDiagnostic.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.clang_getDiagnosticSeverity.argtypes = [ctypes.c_void_p]
    lib.clang_formatDiagnostic.restype = CXString
    lib.clang_formatDiagnostic.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.clang_getCString.restype = ctypes.c_char_p
    lib.clang_getCString.argtypes = [CXString]
    names = []
    for arg in sys.argv[1:] or kernel_units.sources():
        arg = os.path.basename(arg)
        owner = next((s for s, parts in kernel_units.PARTS.items() if arg in parts), arg)
        if owner not in names:
            names.append(owner)
    errors = 0
    with tempfile.TemporaryDirectory() as work:
        # clang's intrinsics header includes a CUDA toolkit header we do not need.
        os.makedirs(os.path.join(work, "inc", "crt"))
        open(os.path.join(work, "inc", "crt", "sm_70_rt.hpp"), "w").close()
        with open(os.path.join(work, "prelude.h"), "w") as f:
            f.write(PRELUDE.replace("VECTOR_TYPES", vector_types()))
        for n in names:
            errors += check(lib, n, work)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
