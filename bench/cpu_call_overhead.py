"""Per-call cost of the ways into the CPU kernels (aserve/kernels/cpu_build.py), on a call whose kernel work is tiny:
add + RMSNorm of one [1, 576] bf16 row (SmolLM2's hidden size; batch-1 decode), so the binding's overhead dominates.

    python bench/cpu_call_overhead.py [--calls 100000] [--rounds 3]

Ways: the extension's raw entry point (pybind11, integer pointers: what the one-token forward calls), the same C
function through ctypes (raw pointers, argument types declared), the typed op torch.ops.aserve.add_rms_norm, the
Python function aserve.kernels.cpu.add_rms_norm over it, and eager torch (aserve.layers.elementwise). Rounds
alternate between the ways; prints a table of us per call (best round, and every round).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time

import torch

from aserve.kernels import cpu, cpu_build
from aserve.layers import elementwise as layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    ext = cpu_build.load_all()
    assert ext is not None, "the CPU kernels could not be built"
    library = os.path.join(cpu_build.cache_dir(), ext.__name__, f"{ext.__name__}.so")
    c_fn = ctypes.CDLL(library).add_rms_norm
    c_fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_int] * 3
    c_fn.restype = None

    gen = torch.Generator().manual_seed(0)
    x, res = (torch.randn(1, 576, generator=gen).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(576, generator=gen) + 0.5).to(torch.bfloat16)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    ptrs = (x.data_ptr(), res.data_ptr(), w.data_ptr(), out.data_ptr(), res_out.data_ptr())
    nt = torch.get_num_threads()
    op = torch.ops.aserve.add_rms_norm
    ways = {
        "raw entry point (pybind11, pointers)": lambda: ext.add_rms_norm(*ptrs, 1, 576, 1e-5, 1, 1, nt),
        "ctypes (pointers)": lambda: c_fn(*ptrs, 1, 576, 1e-5, 1, 1, nt),
        "typed op torch.ops.aserve.add_rms_norm": lambda: op(x, res, w, 1e-5),
        "cpu.add_rms_norm": lambda: cpu.add_rms_norm(x, res, w, 1e-5),
        "eager torch (aserve.layers.elementwise)": lambda: layers.add_rms_norm(x, res, w, 1e-5),
    }
    expected = op(x, res, w, 1e-5)
    ways["raw entry point (pybind11, pointers)"]()
    assert torch.equal(out, expected[0]) and torch.equal(res_out, expected[1])
    rounds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            for _ in range(1000):
                fn()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            rounds[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    print(f"\n{args.calls} calls per round, threads {nt}\n\n| way in | us per call (best) | rounds |\n|---|---|---|")
    for name, times in rounds.items():
        print(f"| {name} | {min(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |")


if __name__ == "__main__":
    main()
