#!/usr/bin/env python3
"""Compile-checks kernels/cuda/*.cu with NVRTC on a machine without a GPU.

NVRTC needs no device: this compiles every source the way kernels/src/kernels/compile.rs does
(the common prelude in front, --std=c++17) for one architecture and prints the compiler log.
It needs libnvrtc, e.g. `pip install nvidia-cuda-nvrtc-cu12`, found through NVRTC_LIB or the
installed package. Usage: scripts/nvrtc-check.py [--arch sm_90] [--verbose] [FILE.cu ...]
"""
import argparse
import ctypes
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = os.path.join(ROOT, "kernels", "cuda")


def load_nvrtc():
    cands = [os.environ.get("NVRTC_LIB", "")]
    try:
        import nvidia.cuda_nvrtc as pkg  # type: ignore

        base = list(pkg.__path__)[0]
        cands += sorted(glob.glob(os.path.join(base, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    cands += ["libnvrtc.so", "libnvrtc.so.12"]
    for c in cands:
        if not c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    sys.exit("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12 or set NVRTC_LIB")


# Sources appended to another before compiling (kernels/src/kernels/sources.rs does the same).
PARTS = {"moe.cu": ["moe_fused.cu", "moe_fused_warp.cu", "moe_fused_warp_combine.cu"]}
APPENDED = {p for parts in PARTS.values() for p in parts}


def compile_one(lib, path, arch, verbose=False):
    with open(os.path.join(CUDA, "common.cuh")) as f:
        common = f.read()
    with open(path) as f:
        body = f.read()
    for part in PARTS.get(os.path.basename(path), []):
        with open(os.path.join(CUDA, part)) as f:
            body += "\n" + f.read()
    text = f'{common}\n#line 1 "{os.path.basename(path)}"\n{body}'
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), os.path.basename(path).encode(),
                                0, None, None)
    if rc != 0:
        return rc, "nvrtcCreateProgram failed"
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    if verbose:
        opts.append(b"--ptxas-options=-v")
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--verbose", action="store_true", help="print ptxas register and spill use")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    files = args.files or sorted(glob.glob(os.path.join(CUDA, "*.cu")))
    files = [f for f in files if os.path.basename(f) not in APPENDED]
    lib = load_nvrtc()
    failed = 0
    for path in files:
        rc, log = compile_one(lib, path, args.arch, args.verbose)
        status = "ok" if rc == 0 else f"FAILED (nvrtc {rc})"
        print(f"{os.path.basename(path)}: {status}")
        if log.strip():
            print(log)
        failed += rc != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
