#!/usr/bin/env python3
"""Compile-checks kernels/cuda/*.cu with NVRTC on a machine without a GPU, and times it.

NVRTC needs no device: this compiles the same compile units as kernels/src/kernels/units.rs
(scripts/kernel_units.py assembles them: the common prelude, the source with its appended parts,
and for a typed kernel its one instantiation; --std=c++17) for one architecture, prints each
unit's compiler log and how long NVRTC took (CPU seconds of the compiling thread, and wall), and
the totals. It needs libnvrtc, e.g. `pip install nvidia-cuda-nvrtc-cu12`, found through NVRTC_LIB
or the installed package.

Usage: scripts/nvrtc-check.py [--arch sm_90] [--verbose] [--dtype bf16 ...] [--jobs N] [WHAT ...]
WHAT is a source (`moe.cu`: all of its units), a unit (`moe`: the base unit of moe.cu;
`moe_nvl_combine_fused_bf16`: one typed kernel), or nothing for every unit of every source.
"""
import argparse
import ctypes
import glob
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_units  # noqa: E402


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


def compile_unit(lib, unit, arch, verbose=False):
    """Compiles one unit; returns (NVRTC result, log, CPU seconds, wall seconds)."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), unit.text.encode(), unit.source.encode(),
                                0, None, None)
    if rc != 0:
        return rc, "nvrtcCreateProgram failed", 0.0, 0.0
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    if verbose:
        opts.append(b"--ptxas-options=-v")
    arr = (ctypes.c_char_p * len(opts))(*opts)
    cpu, wall = time.thread_time(), time.perf_counter()
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), cpu, wall


def select(what, dtypes):
    """The units named by `what` (sources or unit names), every unit when empty."""
    everything = [u for s in kernel_units.sources() for u in kernel_units.units(s, dtypes)]
    if not what:
        return everything
    chosen = []
    for w in what:
        name = os.path.basename(w)
        hits = [u for u in everything if u.source == name or u.name == name]
        if not hits:
            sys.exit(f"{w}: no such source or compile unit (kernels/cuda, scripts/kernel_units.py)")
        chosen += [u for u in hits if u not in chosen]
    return chosen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--verbose", action="store_true", help="print ptxas register and spill use")
    ap.add_argument("--dtype", action="append", choices=kernel_units.FLOATS,
                    help="only the typed units of this float type (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="units compiled at once (threads)")
    ap.add_argument("what", nargs="*")
    args = ap.parse_args()
    units = select(args.what, args.dtype or kernel_units.FLOATS)
    lib = load_nvrtc()
    lock = threading.Lock()
    results = []

    def run(unit):
        rc, log, cpu, wall = compile_unit(lib, unit, args.arch, args.verbose)
        status = "ok" if rc == 0 else f"FAILED (nvrtc {rc})"
        with lock:
            print(f"{unit}: {status} {cpu:.2f} s CPU, {wall:.2f} s wall", flush=True)
            if log.strip():
                print(log, flush=True)
            results.append((rc, cpu))

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(run, units))
    failed = sum(rc != 0 for rc, _ in results)
    print(f"{len(units)} unit(s), {failed} failed: {sum(c for _, c in results):.1f} s CPU, "
          f"{time.perf_counter() - start:.1f} s wall ({args.arch}, {max(1, args.jobs)} job(s))")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
