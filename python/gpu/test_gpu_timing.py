"""AG+GEMM through meshflow next to torch's async-TP (`fused_all_gather_matmul` over symmetric
memory) and torch's all-gather then matmul, in the same process and on the same tensors; the
figures go to $OUT/python_agmm_<world>.json. Checks the results agree; asserts no timing."""

import json
import statistics
import time

import torch
import torch.distributed as dist_

import meshflow.torch as mft
from conftest import all_gather, out_dir, rel_error
from programs import agmm

SIZES = [(8192, 8192, 8192), (16384, 8192, 8192)]  # M, K, N of the full GEMM


def timeit(fn, iters=20, warmup=5):
    """Per-rank median of CUDA-event time (µs) and of wall time with a synchronize (µs),
    max over ranks."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist_.barrier()
    device_us, wall_us = [], []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        e.synchronize()
        wall_us.append((time.perf_counter() - t0) * 1e6)
        device_us.append(s.elapsed_time(e) * 1000.0)
    t = torch.tensor([statistics.median(device_us), statistics.median(wall_us)], device="cuda")
    dist_.all_reduce(t, op=dist_.ReduceOp.MAX)
    return round(t[0].item(), 1), round(t[1].item(), 1)


def test_agmm_next_to_torch_async_tp(dist):
    rank, d, device = dist
    result = {"world": d, "device": torch.cuda.get_device_name(device), "cases": {}}
    group = dist_.group.WORLD.group_name
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group)
        symm = None
    except Exception as ex:  # noqa: BLE001 (reported in the JSON)
        symm = repr(ex)[:300]
    for M, K, N in SIZES:
        key = f"agmm_{M}x{K}x{N}"
        case = {}
        g = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn((M // d, K), generator=g, device=device).to(torch.bfloat16)
        w = torch.randn((N // d, K), generator=g, device=device).to(torch.bfloat16)
        wt = w.t().contiguous()  # [K, N/d] for torch
        full = torch.empty((M, K), device=device, dtype=torch.bfloat16)
        ag = lambda: dist_.all_gather_into_tensor(full, x)  # noqa: E731
        case["torch_ag_then_gemm_us"], case["torch_ag_then_gemm_wall_us"] = timeit(
            lambda: (ag(), torch.matmul(full, wt))
        )
        want = torch.matmul(all_gather(x).float(), w.float().t())
        if symm is None:
            try:
                fused = lambda: torch.ops.symm_mem.fused_all_gather_matmul(  # noqa: E731
                    x, [wt], gather_dim=0, group_name=group
                )
                _, (c,) = fused()
                case["torch_async_tp_rel_err"] = rel_error(c, want)
                case["torch_async_tp_us"], case["torch_async_tp_wall_us"] = timeit(fused)
            except Exception as ex:  # noqa: BLE001 (reported in the JSON)
                case["torch_async_tp_error"] = repr(ex)[:300]
        else:
            case["torch_async_tp_error"] = symm
        y = torch.empty((M, N // d), device=device, dtype=torch.bfloat16)
        for variant in [None, "ring", "ring_forward"]:
            options = {} if variant is None else {"decompose": {"x_gathered": variant}}
            host = agmm(d, "bf16", M // d, N // d, K).lower(**options)
            ex = mft.Executor(host)
            ex.run(x=x, w=w, y=y)
            name = "meshflow_" + (variant or "auto")
            case[f"{name}_rel_err"] = rel_error(y, want)
            assert case[f"{name}_rel_err"] < 2e-2, host.explain
            case[f"{name}_plan"] = host.plans["x_gathered"]
            case[f"{name}_us"], case[f"{name}_wall_us"] = timeit(lambda: ex.run(x=x, w=w, y=y))
            case[f"{name}_device_us"] = ex.last_run_us
        result["cases"][key] = case
    if rank == 0:
        path = out_dir() / f"python_agmm_{d}.json"
        path.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
