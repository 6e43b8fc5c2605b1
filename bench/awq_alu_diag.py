"""Does its arithmetic bound the M = 1 AWQ GEMV (kernels/awq.py, over the repacked copy)? The kernel with its f16x2
step changed, in CUDA graphs with PDL at the Llama-3-8B layer shapes (default tiles per program):

    PYTHONPATH=. python bench/awq_alu_diag.py [--variants default,nozero,xoronly,notail,xoronly+notail]

default   as shipped: per packed int32 1 shift, 4 lop3, 4 zero-point sub / fma, 4 fma with x (13 instructions)
nozero    without the 4 zero-point instructions (wrong output): what 4 of the 13 cost
xoronly   the step only XORs the weights into an accumulator (wrong output; ptxas then drops x's conversion too):
          the kernel's loads, scales and split-K tail without the unpacking arithmetic
notail    each program only stores its float32 partial (no counter, no last-program sum; wrong output): what the
          split-K tail costs
xoronly+notail  both: the kernel's loads alone, against the load-only streams (bench/awq_bench.py tma_diag)

If nozero were ~30 % faster, fewer instructions per weight (tensor cores doing the multiply-adds, as Marlin does)
would pay; H200, session 14 (docs/benchmarks.md): it is not, and xoronly is only 0.4-1.7 us faster, so the loads
and the tail bound the kernel; notail says how much of that is the tail. Each variant runs in its own process (the
asm strings and the epilogue are compile-time globals of the jit functions). Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.awq import _column_sums  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 14336), (14336, 4096), (4096, 28672)]


def patch(variants: str) -> None:
    for variant in variants.split("+"):
        _patch(variant)


def _patch(variant: str) -> None:
    import triton.language as tl

    from kernels import awq

    if variant == "notail":
        awq._gemv1_epilogue = _partial_only_epilogue
    elif variant == "nozero":
        def strip(asm: str) -> str:  # noqa: E306
            return "\n".join(line for line in asm.splitlines()
                             if not line.startswith(("sub.f16x2 w", "fma.rn.f16x2 w")))  # fmt: skip

        awq._STEP_ASM = tl.constexpr(strip(awq._STEP_ASM.value))
        awq._FIRST_STEP_ASM = tl.constexpr(strip(awq._FIRST_STEP_ASM.value))
    elif variant == "xoronly":  # (a0..a3 $4..$7, q $8, ...) and, first row, (q $4, ...)
        awq._STEP_ASM = tl.constexpr("xor.b32 $0, $4, $8;\nmov.b32 $1, $5;\nmov.b32 $2, $6;\nmov.b32 $3, $7;")
        awq._FIRST_STEP_ASM = tl.constexpr("mov.b32 $0, $4;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;")
    else:
        assert variant == "default", variant


@triton.jit
def _partial_only_epilogue(c, pid_n, pid_k, N, split_k, bias_ptr, out_ptr, part_ptr, cnt_ptr, BLOCK_N8: tl.constexpr,
                           SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, RED_CH: tl.constexpr, EVEN_N: tl.constexpr,
                           HAS_BIAS: tl.constexpr):  # fmt: skip
    """kernels/awq.py _gemv1_epilogue's interface; stores the program's column sums as its partial and stops."""
    y = _column_sums(c, BLOCK_N8)
    rn = pid_n * BLOCK_N8 * 8 + tl.arange(0, BLOCK_N8 * 8)
    if SPLIT:
        tl.store(part_ptr + pid_k * N + rn, y)
    else:
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty))


def run_variant(variant: str) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from awq_bench import GROUP, awq_bytes, graph_us, random_awq

    patch(variant)
    from kernels import awq, pdl

    out = {}
    for k, n in SHAPES:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        copies = max(4, int(400e6 // awq_bytes(k, n)))
        ps = [(x, awq.awq_repack(*random_awq(k, n)[:3], GROUP)) for _ in range(copies)]
        pdl.enable(True)
        try:
            out[f"{k}x{n}"] = graph_us(awq.awq_gemv_repacked, ps)
        finally:
            pdl.enable(False)
        del ps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="default,nozero,xoronly,notail,xoronly+notail")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_variant(args.one)), flush=True)
        return
    rows = {}
    for v in args.variants.split(","):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", v], capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        rows[v] = json.loads(line[7:]) if line else {}
        print(f"{v}: {rows[v] or r.stderr[-2000:]}", flush=True)
    names = [f"{k}x{n}" for k, n in SHAPES]
    print("\n| variant | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for v, r in rows.items():
        print(f"| {v} | " + " | ".join(f"{r[s]:.1f}" if s in r else "-" for s in names) + " |")


if __name__ == "__main__":
    main()
