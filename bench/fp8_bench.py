"""FP8 weight-only kernels (aserve/kernels/fp8_gemv.py) against torch._scaled_mm and bf16 cuBLAS on a GPU with FP8
tensor cores, at the Llama-3-8B linear shapes:

    python bench/fp8_bench.py [--rows 1,2,4,8,16,32,64] [--tune [--budget-s 200]]

For each shape (N x K) and number of rows M, in microseconds (do_bench medians, no CUDA graphs): bf16 F.linear
(cuBLAS), the FP8 GEMV (M = 1), fp8_matmul (tl.dot, M <= 64 here), torch._scaled_mm with the activations' per-token
quantisation (aserve/kernels/fp8.py) included and the GEMM alone, and the FP8 layer's choice at that M (the
weight-only kernels up to fp8_gemv.MAX_ROWS rows, _scaled_mm beyond); each checked against the pure-torch reference
first. M = 1 rows also give the GEMV's weight read rate (GB/s).

--tune (bench/fp8_tune.py) then sweeps, each candidate checked against the reference first (split-K ones also for
bit-identical repeats): the GEMV's launch configurations (BLOCK_N / BLOCK_K / warps / stages) at M = 1 on the four
shapes and the down projection with SiLU·mul fused, and fp8_matmul's (with and without split K) at M = 2, 4, 8, 16,
32. It prints the fastest per shape with its GB/s, a short summary table and the entries for gemv.py's
SCALED_GEMV_CONFIGS and fp8_gemv.py's MATMUL_CONFIGS (one configuration per M bucket: the smallest total over the
four shapes; from the first bucket where the layer's torch._scaled_mm is faster in total, None). The sweep stops
trying candidates when --budget-s runs out (slices in proportion to their candidate counts; skipped ones are counted
in the output), and times with short do_bench runs.

Without CUDA the script runs its CPU-side checks (the kernels against the reference at small shapes, in Triton's
interpreter, float32 and fp16 activations) instead and exits with status 1, saying the timings need a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # the CPU-side checks run the Triton kernels in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fp8_tune  # noqa: E402  (bench/, the script's directory)
from fp8_tune import bench_us, check  # noqa: E402

from aserve.kernels import fp8_gemv  # noqa: E402
from aserve.kernels.fp8 import quantize_per_token  # noqa: E402
from aserve.kernels.fp8_reference import dequantize, fp8_weight_only_linear  # noqa: E402
from aserve.layers.quantization.fp8 import has_fp8_tensor_cores, quantize_per_channel  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MATMUL_MAX_ROWS = 64  # fp8_matmul is timed up to this many rows


def cpu_checks() -> None:
    """The kernels against the reference at small shapes (Triton's interpreter on CPU tensors: its bf16 tl.dot is
    not exact, hence float32 and fp16 activations)."""
    gen = torch.Generator().manual_seed(0)
    for n, k in ((48, 256), (37, 128)):
        w_fp8, scale = quantize_per_channel(torch.randn(n, k, generator=gen))
        bias = torch.randn(n, generator=gen)
        for dtype in (torch.float32, torch.float16):
            for m in (1, 3, fp8_gemv.MAX_ROWS):
                x = torch.randn(m, k, generator=gen).to(dtype)
                want = fp8_weight_only_linear(x, w_fp8, scale, bias.to(dtype))
                config = fp8_gemv.gemv_config(n, k, dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2))
                got = fp8_gemv.fp8_small_m(x, w_fp8, scale, bias.to(dtype), config)
                check(got, want, f"CPU check {n}x{k} M={m} {dtype}", tol=2e-3)
    print("CPU checks passed: fp8_gemv and fp8_matmul (Triton's interpreter) match the reference")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--tune", action="store_true")
    p.add_argument("--budget-s", type=float, default=200.0, help="--tune: most seconds for the sweep")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not torch.cuda.is_available():
        cpu_checks()
        sys.exit("fp8_bench: the timings need a CUDA GPU with FP8 tensor cores (torch.cuda.is_available() is False)")
    if not has_fp8_tensor_cores(torch.device("cuda")):
        sys.exit(f"fp8_bench: {torch.cuda.get_device_name()} has no FP8 tensor cores (compute capability < 8.9)")
    torch.manual_seed(0)
    print("| shape | M | bf16 cuBLAS us | fp8 GEMV us | fp8_matmul us | _scaled_mm + quant us | _scaled_mm us | "
          "layer us | layer / bf16 |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    weights = {}
    for name, (n, k) in SHAPES.items():
        w_fp8, scale = quantize_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        wb, scale_b = dequantize(w_fp8, scale, torch.bfloat16), scale.view(1, -1)
        row_cfg = fp8_gemv.gemv_config(n, k)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = fp8_weight_only_linear(x, w_fp8, scale)
            xq, xs = quantize_per_token(x)

            def scaled_mm_quant(x=x):
                q, s = quantize_per_token(x)
                return torch._scaled_mm(q, w_fp8.t(), scale_a=s, scale_b=scale_b, out_dtype=torch.bfloat16)

            paths = {"bf16": lambda: F.linear(x, wb), "scaled_quant": scaled_mm_quant,
                     "scaled": lambda: torch._scaled_mm(xq, w_fp8.t(), scale_a=xs, scale_b=scale_b,
                                                        out_dtype=torch.bfloat16)}  # fmt: skip
            if m <= MATMUL_MAX_ROWS:
                paths["matmul"] = lambda: fp8_gemv.fp8_matmul(x, w_fp8, scale)
            if m == 1 and row_cfg is not None:
                paths["gemv"] = lambda: fp8_gemv.fp8_gemv(x, w_fp8, scale, None, row_cfg)
            times = {}
            for key, fn in paths.items():
                check(fn(), want, f"{name} M={m} {key}", tol=2e-2 if key in ("gemv", "matmul", "bf16") else 8e-2)
                times[key] = bench_us(fn, *((5, 20) if args.tune else ()))
            layer = "scaled_quant" if m > fp8_gemv.MAX_ROWS else "gemv" if "gemv" in times else "matmul"
            times["layer"] = times[layer]
            gemv = f"{times['gemv']:.1f} ({n * k / times['gemv'] / 1e3:.0f} GB/s)" if "gemv" in times else "-"
            matmul = f"{times['matmul']:.1f}" if "matmul" in times else "-"
            print(f"| {name} {n}x{k} | {m} | {times['bf16']:.1f} | {gemv} | {matmul} | {times['scaled_quant']:.1f} | "
                  f"{times['scaled']:.1f} | {times['layer']:.1f} | {times['layer'] / times['bf16']:.2f} |")  # fmt: skip
        weights[name] = (w_fp8, scale)
    if args.tune:
        fp8_tune.tune(SHAPES, weights, args.budget_s)


if __name__ == "__main__":
    main()
