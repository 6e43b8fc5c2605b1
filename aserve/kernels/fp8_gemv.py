"""Triton weight-only FP8 kernels for few rows (small-batch decode on GPUs): y = (x w^T) * scale (+ bias), w e4m3
[N, K] row-major (nn.Linear's layout) with one float32 scale per output channel, x in 16 bits. Activations are not
quantised (W8A16): at a few rows a linear is bound by its weight bytes, which e4m3 halves, and cuBLAS's FP8 GEMM
(torch._scaled_mm) is far from that bound there (Llama-3-8B shape, H200: 3.77 ms of a 4.52 ms batch-1 step,
docs/quantization.md). Reference: aserve/kernels/fp8_reference.py fp8_weight_only_linear.

    fp8_gemv        one row: aserve/kernels/gemv.py's loop (BLOCK_N rows per program, an element-wise float32
                    accumulator reduced once at the end) over e4m3 tiles widened to float32; silu_mul fuses a Llama
                    MLP's activation into the down projection's prologue, as there
    fp8_matmul      2 .. MAX_ROWS rows: tl.dot of the [BLOCK_M, BLOCK_K] x tile and the weight tile widened to x's
                    dtype (exact: every e4m3 value is a bf16 and an fp16 value), a float32 accumulator, scales and
                    bias in the epilogue
    fp8_small_m     the kernel for M <= MAX_ROWS rows

The layer (aserve/layers/quantization/fp8.py) runs these up to MAX_ROWS rows and torch._scaled_mm beyond. Widening
e4m3 is exact in Triton's interpreter too (the tests run there on CPU tensors), unlike the rounding casts to e4m3 of
aserve/kernels/fp8.py; the interpreter's bf16 tl.dot is not exact on CPU, so those tests use float32 / fp16 x.
The launch configurations and MAX_ROWS are starting points: bench/fp8_bench.py times them against bf16 cuBLAS and
torch._scaled_mm at the Llama-3-8B shapes on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import gemv, pdl

MAX_ROWS = 16  # more rows: the layer's large-M kernel (torch._scaled_mm)
MATMUL_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)


gemv_config = gemv.scaled_gemv_config  # the launch configuration of the GEMV for an [n, k] weight


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:  # fmt: skip
    """x [1, K] -> (x w^T) * scale (+ bias) [1, N] in x's dtype; silu_mul: x is [1, 2K] = [gate | up] and the
    product is taken of silu(gate) * up."""
    assert w.dtype == torch.float8_e4m3fn
    cfg = gemv_config(*w.shape, config, silu_mul)
    assert cfg is not None, f"K={w.shape[1]} is not a multiple of 64"
    return gemv.scaled_gemv(x, w, scale, bias, cfg, silu_mul)


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(1), tl.program_id(0)
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
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0, eviction_policy="evict_first")
        if IEEE:
            acc = tl.dot(x, w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> (x w^T) * scale (+ bias) [M, N] in x's dtype, on the tensor cores (float32 x: full-precision
    dot products)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(-1) == 1 and w.stride(-1) == 1 and w.dtype == torch.float8_e4m3fn
    cfg = {**MATMUL_CONFIG, **(config or {})}
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    _fp8_matmul_kernel[grid](
        x, w, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def fp8_small_m(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                row_config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K], M <= MAX_ROWS -> [M, N]: the GEMV at one row (row_config: its launch configuration, gemv_config;
    None where it does not take the weight), fp8_matmul otherwise."""
    if x.shape[0] == 1 and row_config is not None:
        return fp8_gemv(x, w, scale, bias, row_config)
    return fp8_matmul(x, w, scale, bias)
