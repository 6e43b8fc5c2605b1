"""GPU time by kernel of a callable (CUPTI through torch.profiler): shared by bench/gpu_bench.py's decode section and
bench/deterministic.py --kernels."""

from __future__ import annotations

import torch


def kernel_times(fn, calls: int = 20) -> list[tuple[str, float, float]]:
    """(kernel, GPU us per call of fn, launches per call of fn), the most time first: CUPTI via torch.profiler over
    `calls` calls after one. (With programmatic dependent launch a kernel's time includes its wait for the one
    before: ASERVE_PDL=0 for each kernel's own.)"""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / calls, e.count / calls) for e in prof.key_averages()
            if e.device_time_total > 0]  # fmt: skip
    return sorted(rows, key=lambda r: -r[1])
