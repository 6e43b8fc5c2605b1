"""Triton weight-only FP8 kernels for few rows (small-batch decode on GPUs): y = (x w^T) * scale (+ bias), w e4m3
[N, K] row-major (nn.Linear's layout) with one float32 scale per output channel, x in 16 bits. Activations are not
quantised (W8A16): at a few rows a linear is bound by its weight bytes, which e4m3 halves, and cuBLAS's FP8 GEMM
(torch._scaled_mm) is far from that bound there (Llama-3-8B shape, H200: 3.77 ms of a 4.52 ms batch-1 step,
docs/quantization.md). Reference: aserve/kernels/fp8_reference.py fp8_weight_only_linear.

    fp8_gemv        one row: aserve/kernels/gemv.py's scaled_gemv (BLOCK_N rows per program over all of K, an
                    element-wise float32 accumulator reduced once at the end; the configuration per weight shape
                    from SCALED_GEMV_CONFIGS) over e4m3 tiles widened to float32; silu_mul fuses a Llama MLP's
                    activation into the down projection's prologue, as there
    fp8_matmul      2 .. MAX_ROWS rows: aserve/kernels/scaled_matmul.py's tl.dot kernel (weight tiles widened to x's
                    dtype, exact: every e4m3 value is a bf16 and an fp16 value; a float32 accumulator, scales and
                    bias in the epilogue; evict-first weight loads), its configuration by rows from MATMUL_CONFIGS
    fp8_small_m     the kernel for M <= MAX_ROWS rows

The layer (aserve/layers/quantization/fp8.py) runs these up to MAX_ROWS rows and torch._scaled_mm beyond. Widening
e4m3 is exact in Triton's interpreter too (the tests run there on CPU tensors), unlike the rounding casts to e4m3 of
aserve/kernels/fp8.py; the interpreter's bf16 tl.dot is not exact on CPU, so those tests use float32 / fp16 x.
The launch configurations and MAX_ROWS are starting points: bench/fp8_bench.py times them against bf16 cuBLAS and
torch._scaled_mm at the Llama-3-8B shapes on a GPU, and --tune prints the table entries it finds fastest.
"""

from __future__ import annotations

import torch

from aserve.kernels import gemv, scaled_matmul

MATMUL_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, SPLIT_K=1, num_warps=4, num_stages=4)
# fp8_matmul by rows: (most rows, configuration or None). None: from that bucket on the layer's large-M kernel
# (torch._scaled_mm) runs instead; MAX_ROWS is the last bucket with a configuration. bench/fp8_bench.py --tune
# times each bucket's configurations (SPLIT_K: aserve/kernels/scaled_matmul.py) at the Llama-3-8B shapes and prints
# the entries with the smallest total time over the shapes.
# H200, 2026-12-03 (us summed over the four shapes; torch._scaled_mm with the activations' quantisation beside):
MATMUL_CONFIGS = (
    # M <= 2: 133.9 us, _scaled_mm + quant 204.6 us
    (2, dict(BLOCK_K=128, BLOCK_M=16, BLOCK_N=32, GROUP_M=1, SPLIT_K=1, num_stages=4, num_warps=4)),
    # M <= 4: 127.2 us, _scaled_mm + quant 150.5 us
    (4, dict(BLOCK_K=128, BLOCK_M=16, BLOCK_N=64, GROUP_M=1, SPLIT_K=4, num_stages=4, num_warps=4)),
    # M <= 8: 127.2 us, _scaled_mm + quant 143.4 us
    (8, dict(BLOCK_K=128, BLOCK_M=16, BLOCK_N=32, GROUP_M=1, SPLIT_K=4, num_stages=4, num_warps=4)),
    # M <= 16: 141.3 us, _scaled_mm + quant 191.1 us
    (16, dict(BLOCK_K=512, BLOCK_M=16, BLOCK_N=32, GROUP_M=1, SPLIT_K=1, num_stages=4, num_warps=4)),
    # M <= 32: 193.5 us, _scaled_mm + quant 177.1 us: _scaled_mm from here on
    (None, None),
)
MAX_ROWS = max((most for most, cfg in MATMUL_CONFIGS if cfg is not None and most is not None), default=1)


gemv_config = gemv.scaled_gemv_config  # the launch configuration of the GEMV for an [n, k] weight


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:  # fmt: skip
    """x [1, K] -> (x w^T) * scale (+ bias) [1, N] in x's dtype; silu_mul: x is [1, 2K] = [gate | up] and the
    product is taken of silu(gate) * up."""
    assert w.dtype == torch.float8_e4m3fn
    cfg = gemv_config(*w.shape, config, silu_mul)
    assert cfg is not None, f"K={w.shape[1]} is not a multiple of 64"
    return gemv.scaled_gemv(x, w, scale, bias, cfg, silu_mul)


def matmul_config(m: int) -> dict | None:
    """fp8_matmul's launch configuration at m rows (None: more rows than MAX_ROWS)."""
    return next(cfg for most, cfg in MATMUL_CONFIGS if most is None or m <= most)


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> (x w^T) * scale (+ bias) [M, N] in x's dtype, on the tensor cores (float32 x: full-precision
    dot products); config overrides matmul_config(M) (MATMUL_CONFIG where that is None)."""
    assert w.dtype == torch.float8_e4m3fn
    base = matmul_config(x.shape[0]) or MATMUL_CONFIG
    return scaled_matmul.scaled_matmul(x, w, scale, bias, {**base, **(config or {})}, evict_first=True)


def fp8_small_m(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                row_config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K], M <= MAX_ROWS -> [M, N]: the GEMV at one row (row_config: its launch configuration, gemv_config;
    None where it does not take the weight), fp8_matmul otherwise."""
    if x.shape[0] == 1 and row_config is not None:
        return fp8_gemv(x, w, scale, bias, row_config)
    return fp8_matmul(x, w, scale, bias)
