"""AWQ kernels over AutoAWQ's "gemm" tensors (aserve/kernels/awq_reference.py has the layout and the pure-torch
reference): awq_gemv for M <= 16 rows (M = 1 in fp16 / bf16: gemv1.py's f16x2 kernel; otherwise a dequantised K
tile (aserve/kernels/awq/unpack.py), then tl.dot, K split with split_k_reduce) and awq_dequantize (the whole weight,
for cuBLAS at M > 16). An AWQ layer on a GPU uses these only for layers awq_repack does not fit (group size other than
128, outputs not a multiple of 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels.awq import tuning
from aserve.kernels.awq.gemv1 import _awq_gemv1, _gemv1_config
from aserve.kernels.awq.split_k import split_k_reduce
from aserve.kernels.awq.unpack import _dequant_tile


@triton.jit
def _awq_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_os, k_per_split,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """A few rows (M <= 16, padded to BLOCK_M = 16 for tl.dot)."""
    BLOCK_N8: tl.constexpr = BLOCK_N // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = pid_n * BLOCK_N8 + tl.arange(0, BLOCK_N8)
    n_ok = rn < N
    j_ok = rj < N // 8
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, rk, rj, j_ok, N, GROUP, BLOCK_K, BLOCK_N8)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    ok = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:  # split K: float32 partials [SPLIT_K, M, N]
        tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _awq_dequant_kernel(qw_ptr, qz_ptr, s_ptr, out_ptr, N, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):  # fmt: skip
    BLOCK_N8: tl.constexpr = BLOCK_N // 8
    k0 = tl.program_id(0) * BLOCK_K
    pid_n = tl.program_id(1)
    rk = tl.arange(0, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = pid_n * BLOCK_N8 + tl.arange(0, BLOCK_N8)
    w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, rk, rj, rj < N // 8, N, GROUP, BLOCK_K, BLOCK_N8)
    out = out_ptr + (k0 + rk)[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(rn < N)[None, :])


def _check(x, qweight, qzeros, scales, group_size):
    k, n8 = qweight.shape
    assert x.shape[-1] == k and x.stride(-1) == 1, "x must be [M, in] with unit stride along in"
    assert qzeros.shape == (k // group_size, n8) and scales.shape == (k // group_size, n8 * 8)
    assert k % group_size == 0 and group_size % 16 == 0
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()


def gemv_config(m: int, n: int, k: int, group_size: int, device_index: int | None = None,
                dtype: torch.dtype = torch.bfloat16) -> dict:  # fmt: skip
    """The launch configuration of awq_gemv. M = 1 in fp16 / bf16: the f16x2 kernel (tuning.GEMV1_CONFIG resolved, see
    _gemv1_config). Otherwise (M > 1, or float32 activations, which f16 arithmetic would round): the tl.dot
    kernel, BLOCK_N / BLOCK_K / SPLIT_K / warps / stages, K split until there are two programs per SM."""
    if m == 1 and dtype in tuning.F16X2_DTYPES:
        return _gemv1_config(k, n, group_size)
    cfg = dict(BLOCK_N=128 if n >= 2048 else 64, BLOCK_K=min(64, group_size), num_warps=4, num_stages=3)
    tiles_n = triton.cdiv(n, cfg["BLOCK_N"])
    num_tiles_k = k // cfg["BLOCK_K"]
    split_k = 1
    while tiles_n * split_k < 2 * tuning._num_sms(device_index) and split_k * 2 <= min(num_tiles_k, 32):
        split_k *= 2
    cfg["SPLIT_K"] = split_k
    return cfg


def awq_gemv(x, qweight, qzeros, scales, group_size: int, bias=None, config: dict | None = None,
             counters: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [M <= 16, in] -> [M, out] in x's dtype. `config` overrides gemv_config (tuning, tests). `counters`
    (gemv_counters) for M = 1: the call site's own; default one shared per (device, out)."""
    _check(x, qweight, qzeros, scales, group_size)
    m, k = x.shape
    n = scales.shape[1]
    assert m <= tuning.GEMV_MAX_M
    if m == 1 and x.dtype in tuning.F16X2_DTYPES:
        return _awq_gemv1(x, qweight, qzeros, scales, group_size, bias, config, counters)
    cfg = {**gemv_config(m, n, k, group_size, x.device.index, x.dtype), **(config or {})}
    block_k, split_k, block_n = cfg["BLOCK_K"], cfg["SPLIT_K"], cfg["BLOCK_N"]
    assert group_size % block_k == 0 and block_n % 8 == 0
    k_per_split = triton.cdiv(k // block_k, split_k) * block_k  # whole K tiles, so no tile straddles two groups
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _awq_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, qweight, qzeros, scales, bias if bias is not None else scales, target, m, n, k, x.stride(0),
        target.stride(-2), target.stride(0) if split_k > 1 else 0, k_per_split,
        GROUP=group_size, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split_k > 1,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split_k > 1:
        split_k_reduce(target, bias, out)
    return out


def awq_dequantize(qweight, qzeros, scales, group_size: int, dtype: torch.dtype, config: dict | None = None):
    """-> W [in, out] in `dtype` (reference: aserve.kernels.awq_reference.dequantize)."""
    k, n8 = qweight.shape
    n = n8 * 8
    cfg = {**tuning.DEQUANT_CONFIG, **(config or {})}
    block_k, block_n = min(group_size, cfg["BLOCK_K"]), cfg["BLOCK_N"]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _awq_dequant_kernel[(k // block_k, triton.cdiv(n, block_n))](
        qweight, qzeros, scales, out, n, GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out
