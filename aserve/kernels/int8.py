"""Triton kernels for INT8 weight-only linear layers on GPUs (W8A16, `--quantization int8`): y = (x q^T) * scale
(+ bias), q int8 [N, K] row-major (nn.Linear's layout) with one float32 scale per output channel. The scale is
applied to each output after the sum over K; the int8 weights are widened in registers (exactly: |q| <= 127 fits
the mantissa of fp16 and bf16) and summed in float32. Reference: aserve/kernels/int8_reference.py int8_linear.

    int8_gemv     one row (batch-1 decode): aserve/kernels/gemv.py's loop (BLOCK_N rows per program, an
                  element-wise float32 accumulator reduced once at the end) over int8 tiles, half the bytes of the
                  bf16 GEMV; silu_mul fuses a Llama MLP's activation into the down projection's prologue, as there
    int8_matmul   more rows: tl.dot of [BLOCK_M, BLOCK_K] x tiles and [BLOCK_K, BLOCK_N] weight tiles widened to x's
                  dtype, a float32 accumulator, scales and bias in the epilogue; programs walk the output in groups
                  of GROUP_M row blocks, so the weight tiles they share are read from L2
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
import triton
import triton.language as tl

from aserve.kernels import gemv, pdl

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


@triton.jit
def _int8_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # GROUP_M row blocks walk the column blocks together: consecutive programs share weight tiles
    group = pid // (GROUP_M * blocks_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * blocks_n)) % group_m
    pid_n = (pid % (GROUP_M * blocks_n)) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl.gdc_sync(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk + k0 < K
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0)
        if IEEE:
            acc = tl.dot(x, w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def matmul_config(m: int) -> dict:
    return next(cfg for most, cfg in MATMUL_CONFIGS if most is None or m <= most)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> (x q^T) * scale (+ bias) [M, N] in x's dtype, on the tensor cores (float32 x: full-precision
    dot products)."""
    m, k = x.shape
    n = q.shape[0]
    assert q.shape[1] == k and x.stride(-1) == 1 and q.stride(-1) == 1 and q.dtype == torch.int8
    cfg = {**matmul_config(m), **(config or {})}
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _int8_matmul_kernel[grid](
        x, q, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), q.stride(0), out.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


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
