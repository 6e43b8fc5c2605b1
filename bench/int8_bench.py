"""INT8 weight-only kernels (aserve/kernels/int8.py) against bf16 cuBLAS on a GPU, at the Llama-3-8B linear shapes:

    python bench/int8_bench.py [--rows 1,2,4,8,16,32,64,128,256,512,2048] [--tune]

For each shape (N x K) and number of rows M: bf16 F.linear (cuBLAS), the int8 GEMV (M = 1), int8_matmul (tl.dot) and
dequantise + cuBLAS, in microseconds (CUDA-graph-free do_bench medians), each checked against the pure-torch
reference first; the int8_linear column is what a layer runs at that M (int8.py's thresholds). M = 1 rows also give
the GEMV's weight read rate (GB/s). --tune times a few launch configurations of the GEMV and of the small-M
matmul and prints the fastest per shape (set them in aserve/kernels/gemv.py SCALED_GEMV_CONFIG* and int8.py).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def bench_us(fn) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    if err > 2e-2:
        raise AssertionError(f"{what}: relative error {err:.3g} against the reference")


def main() -> None:
    from aserve.kernels import int8
    from aserve.kernels.int8_reference import int8_linear
    from aserve.layers.quantization.int8 import quantize_per_channel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256,512,2048")
    p.add_argument("--tune", action="store_true")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    print("| shape | M | bf16 cuBLAS us | int8 GEMV us | int8_matmul us | dequant + cuBLAS us | int8_linear us | "
          "int8_linear / bf16 |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, scale = quantize_per_channel(w)
        wb = (q.float() * scale[:, None]).to(torch.bfloat16)
        row_cfg = int8.gemv_config(n, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = int8_linear(x, q, scale)
            times = {"bf16": bench_us(lambda: F.linear(x, wb))}
            paths = {"matmul": lambda: int8.int8_matmul(x, q, scale), "dequant": lambda: int8.dequantized_matmul(
                x, q, scale), "linear": lambda: int8.int8_linear(x, q, scale, None, row_cfg)}  # fmt: skip
            if m == 1:
                paths["gemv"] = lambda: int8.int8_gemv(x, q, scale, None, row_cfg)
            for key, fn in paths.items():
                check(fn(), want, f"{name} M={m} {key}")
                times[key] = bench_us(fn)
            gemv = f"{times['gemv']:.1f} ({n * k / times['gemv'] / 1e3:.0f} GB/s)" if "gemv" in times else "-"
            ratio = times["linear"] / times["bf16"]
            print(f"| {name} {n}x{k} | {m} | {times['bf16']:.1f} | {gemv} | {times['matmul']:.1f} | "
                  f"{times['dequant']:.1f} | {times['linear']:.1f} | {ratio:.2f} |")  # fmt: skip
        if args.tune:
            tune(name, n, k, q, scale)


def tune(name: str, n: int, k: int, q: torch.Tensor, scale: torch.Tensor) -> None:
    from aserve.kernels import int8

    x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    gemv = []
    for bn, bk, warps, stages in itertools.product((8, 16, 32), (1024, 2048), (4, 8), (2, 3)):
        cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        if k % bk == 0 and bn * bk <= 32768:
            gemv.append((bench_us(lambda: int8.int8_gemv(x1, q, scale, None, cfg)), cfg))
    best = min(gemv, key=lambda t: t[0])
    print(f"tune {name} GEMV: {best[0]:.1f} us with {best[1]}")
    for m in (4, 16, 64, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        found = []
        if m <= 16:
            grid = itertools.product((16,), (32, 64), (128, 256), (4, 8), (3, 4))
        else:
            grid = itertools.product((16, 32, 64) if m <= 64 else (64, 128), (64, 128), (64, 128), (4, 8), (3, 4))
        for bm, bn, bk, warps, stages in grid:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1 if m <= 64 else 8, num_warps=warps,
                       num_stages=stages)  # fmt: skip
            try:
                found.append((bench_us(lambda: int8.int8_matmul(x, q, scale, config=cfg)), cfg))
            except Exception:  # shared memory exceeded: skip the configuration
                continue
        best = min(found, key=lambda t: t[0])
        print(f"tune {name} matmul M={m}: {best[0]:.1f} us with {best[1]}")


if __name__ == "__main__":
    main()
