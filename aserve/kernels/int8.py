"""Triton kernels for INT8 weight-only linear layers on GPUs (W8A16, `--quantization int8`): y = (x q^T) * scale
(+ bias), q int8 [N, K] row-major (nn.Linear's layout) with one float32 scale per output channel. The scale is
applied to each output after the sum over K; the int8 weights are widened in registers (exactly: |q| <= 127 fits
the mantissa of fp16 and bf16) and summed in float32. Reference: aserve/kernels/int8_reference.py int8_linear.

    int8_gemv     one row (batch-1 decode): aserve/kernels/gemv.py's loop (BLOCK_N rows per program, an
                  element-wise float32 accumulator reduced once at the end) over int8 tiles, half the bytes of the
                  bf16 GEMV; silu_mul fuses a Llama MLP's activation into the down projection's prologue, as there
    int8_matmul   more rows: aserve/kernels/scaled_matmul.py's tl.dot kernel (weight tiles widened to x's dtype, a
                  float32 accumulator, scales and bias in the epilogue, GROUP_M row blocks walking the output
                  together) with the configurations of MATMUL_CONFIGS
    int8_linear   the kernel for M rows: the GEMV at M = 1, int8_matmul up to DEQUANT_MIN_ROWS rows, beyond that the
                  weight dequantised to x's dtype (one elementwise kernel) and cuBLAS, where the GEMM's arithmetic
                  dwarfs the extra pass over the weights

bench/int8_bench.py measures every path against bf16 cuBLAS at Llama-3-8B shapes (`--tune` searches the launch
configurations); docs/quantization.md has its H200 table. There the dequantise + cuBLAS path was slower than
int8_matmul at every M up to 2,048 (the extra pass over the weights costs more than cuBLAS saves), so it is off
(DEQUANT_MIN_ROWS None).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aserve.kernels import gemv, scaled_matmul

# int8_matmul by rows: (most rows, configuration)
MATMUL_CONFIGS = (
    (16, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)),
)
DEQUANT_MIN_ROWS = None  # from this many rows: dequantise + cuBLAS (None: int8_matmul at every M)


gemv_config = gemv.scaled_gemv_config  # the launch configuration of the GEMV for an [n, k] weight


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:  # fmt: skip
    """x [1, K] -> (x q^T) * scale (+ bias) [1, N] in x's dtype; silu_mul: x is [1, 2K] = [gate | up] and the
    product is taken of silu(gate) * up."""
    assert q.dtype == torch.int8
    cfg = gemv_config(*q.shape, config, silu_mul)
    assert cfg is not None, f"K={q.shape[1]} is not a multiple of 64"
    return gemv.scaled_gemv(x, q, scale, bias, cfg, silu_mul)


def matmul_config(m: int) -> dict:
    return next(cfg for most, cfg in MATMUL_CONFIGS if most is None or m <= most)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> (x q^T) * scale (+ bias) [M, N] in x's dtype, on the tensor cores (float32 x: full-precision
    dot products)."""
    assert q.dtype == torch.int8
    return scaled_matmul.scaled_matmul(x, q, scale, bias, {**matmul_config(x.shape[0]), **(config or {})})


def dequantized_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> the same product through the weight dequantised to x's dtype (q times the scale rounded to x's
    dtype: one elementwise kernel) and cuBLAS."""
    w = torch.mul(q, scale.to(x.dtype)[:, None])  # int8 * 16-bit -> 16-bit
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                row_config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> [M, N]: the kernel for M (the module docstring); row_config: the GEMV's launch configuration
    (gemv_config), None where the GEMV does not take the weight."""
    m = x.shape[0]
    if m == 1 and row_config is not None:
        return int8_gemv(x, q, scale, bias, row_config)
    if DEQUANT_MIN_ROWS is not None and m >= DEQUANT_MIN_ROWS:
        return dequantized_matmul(x, q, scale, bias)
    return int8_matmul(x, q, scale, bias)
