"""Triton kernels for AWQ int4 linear layers on GPUs, over AutoAWQ's "gemm" tensors (aserve/kernels/awq_reference.py
has the layout and the pure-torch reference the tests compare against) or over awq_repack's copy of them.

    dispatch.py        awq_linear: the kernel for the number of rows M
    tuning.py          launch configurations and thresholds (bench/awq_bench.py and tests set them there)
    autoawq.py         over AutoAWQ's tensors: awq_gemv (M <= 16), awq_dequantize (M > 16, then cuBLAS)
    gemv1.py           over AutoAWQ's tensors, M = 1: the f16x2 GEMV with a fused split-K reduction
    repack.py          awq_repack's layout, its tl.dot GEMV (M <= 16) and dequantise kernel (M > 16)
    gemv1_repacked.py  over the repacked copy, small M: the f16x2 GEMV, optionally with the MLP's SiLU·mul
    f16x2.py           packed f16x2 arithmetic in inline PTX, and its tl twins for Triton's interpreter
    split_k.py         split-K reductions: fused (counters) and separate (split_k_reduce)
    unpack.py          int4 tiles -> float32 for the tl.dot and dequantise kernels

Why the kernels are shaped so (what bounds them, what was tried and measured on an H200): docs/quantization.md,
"Kernels".

The kernels read their knobs from tuning.py when they are called: set `aserve.kernels.awq.tuning.NAME` to change one.
"""

from __future__ import annotations

from aserve.kernels.awq import tuning
from aserve.kernels.awq.autoawq import awq_dequantize, awq_gemv, gemv_config
from aserve.kernels.awq.dispatch import awq_linear
from aserve.kernels.awq.gemv1_repacked import awq_gemv_repacked
from aserve.kernels.awq.repack import (
    REPACK_BLOCK_N8,
    REPACK_GROUP,
    RepackedAWQ,
    awq_dequantize_repacked,
    awq_gemv_repacked_dot,
    awq_repack,
)
from aserve.kernels.awq.split_k import gemv_counters, split_k_reduce

__all__ = [
    "REPACK_BLOCK_N8",
    "REPACK_GROUP",
    "RepackedAWQ",
    "awq_dequantize",
    "awq_dequantize_repacked",
    "awq_gemv",
    "awq_gemv_repacked",
    "awq_gemv_repacked_dot",
    "awq_linear",
    "awq_repack",
    "gemv_config",
    "gemv_counters",
    "split_k_reduce",
    "tuning",
]
