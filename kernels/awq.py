"""Triton kernels for AWQ int4 linear layers (AutoAWQ "gemm" layout; see kernels/awq_reference.py for the layout
and the pure-torch reference they are tested against). `awq_linear` picks one by the number of rows M:

    M <= 16      awq_gemv     decode: memory-bound. Each program streams a [BLOCK_K, BLOCK_N/8] tile of packed
                              weights per iteration, dequantises it in registers and accumulates in float32;
                              split-K spreads the K dimension over SPLIT_K programs (partials + a reduce kernel)
                              so that even 4096-wide layers fill every SM.
    16 < M < DEQUANT_MIN_M    awq_gemm     prefill: a K tile is dequantised into registers, then tl.dot.
    M >= DEQUANT_MIN_M        dequantise the whole weight once (awq_dequantize), then cuBLAS: at large M the
                              matmul dwarfs the one extra pass over the weight.

Unpacking: a [BK, BN/8] int32 tile is interleaved with itself three times, giving [BK, BN] where column n holds the
int32 of its 8-column group; shifting by 4 * AWQ_REVERSE_ORDER[n % 8] and masking 4 bits gives q. Integers become
float32 with the exponent trick (0x4B000000 | q is the float 2**23 + q, exactly), which avoids int-to-float
conversions, a slow path on NVIDIA GPUs; (2**23 + q) - (2**23 + z) = q - z exactly.

Every K tile lies inside one quantisation group (BLOCK_K divides the group size), so a tile needs one row of zeros
and scales.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

DEQUANT_MIN_M = 1024  # from this many rows on, dequantise + cuBLAS beats the fused GEMM (bench/awq_bench.py)
GEMV_MAX_M = 16


@triton.jit
def _unpack(packed, BLOCK_N: tl.constexpr):
    """int32 [R, BLOCK_N // 8] (AWQ order) -> float32 [R, BLOCK_N] holding 2**23 + q."""
    x = tl.interleave(packed, packed)
    x = tl.interleave(x, x)
    x = tl.interleave(x, x)
    c = tl.arange(0, BLOCK_N) % 8
    shifts = ((c // 2) + (c % 2) * 4) * 4  # 4 * AWQ_REVERSE_ORDER[c]
    q = (x >> shifts[None, :]) & 0xF
    return (q | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, rk, rn, rn8, n_ok, n8_ok, N, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """The float32 weights W[k0 + rk, rn] ([BLOCK_K, BLOCK_N]) of one K tile inside one group."""
    qw = tl.load(qw_ptr + (k0 + rk)[:, None].to(tl.int64) * (N // 8) + rn8[None, :], mask=n8_ok[None, :], other=0)
    g = k0 // GROUP
    qz = tl.load(qz_ptr + g * (N // 8) + rn8[None, :], mask=n8_ok[None, :], other=0)
    s = tl.load(s_ptr + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
    return (_unpack(qw, BLOCK_N) - _unpack(qz, BLOCK_N)) * s[None, :]


@triton.jit
def _awq_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_os, k_per_split,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn8 = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    n_ok = rn < N
    n8_ok = rn8 < N // 8
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if BLOCK_M == 1:
        # One row: a broadcast multiply and a column sum on CUDA cores (tl.dot would pad to 16 rows).
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, rk, rn, rn8, n_ok, n8_ok, N, GROUP, BLOCK_N)
            x = tl.load(x_ptr + k0 + rk).to(tl.float32)
            acc += tl.sum(x[:, None] * w, axis=0)
        acc2 = acc[None, :]
    else:
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, rk, rn, rn8, n_ok, n8_ok, N, GROUP, BLOCK_N)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
            if IEEE:
                acc2 = tl.dot(x, w, acc2, input_precision="ieee")
            else:
                acc2 = tl.dot(x, w.to(x.dtype), acc2)
    rm = tl.arange(0, BLOCK_M)
    ok = (rm < M)[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc2 += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc2.to(out_ptr.dtype.element_ty), mask=ok)
    else:  # float32 partials [SPLIT_K, M, N]
        tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :], acc2, mask=ok)


@triton.jit
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):  # a fixed order: results do not depend on scheduling
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _awq_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # Programs walk GROUP_M row tiles per column tile, so a column tile of weights is reused from L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn8 = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    n8_ok = rn8 < N // 8
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, rk, rn, rn8, n_ok, n8_ok, N, GROUP, BLOCK_N)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _awq_dequant_kernel(qw_ptr, qz_ptr, s_ptr, out_ptr, N, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):  # fmt: skip
    k0 = tl.program_id(0) * BLOCK_K
    pid_n = tl.program_id(1)
    rk = tl.arange(0, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn8 = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    n_ok = rn < N
    w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, rk, rn, rn8, n_ok, rn8 < N // 8, N, GROUP, BLOCK_N)
    out = out_ptr + (k0 + rk)[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


# -- launchers --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    return 132  # interpreter: pretend an H200, so tests run the launch shapes of the GPU


def _check(x, qweight, qzeros, scales, group_size):
    k, n8 = qweight.shape
    assert x.shape[-1] == k and x.stride(-1) == 1, "x must be [M, in] with unit stride along in"
    assert qzeros.shape == (k // group_size, n8) and scales.shape == (k // group_size, n8 * 8)
    assert k % group_size == 0 and group_size % 16 == 0
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()


def gemv_config(m: int, n: int, k: int, group_size: int, device_index: int | None = None) -> dict:
    """BLOCK_N / BLOCK_K / SPLIT_K for awq_gemv: split K (in whole groups) until there are ~2 programs per SM."""
    block_n = 128 if n >= 2048 else 64
    block_k = min(group_size, 64)  # a [64, 128] float32 tile is 64 registers per thread at 4 warps
    tiles_n = triton.cdiv(n, block_n)
    num_groups = k // group_size
    split_k = 1
    while tiles_n * split_k < 2 * _num_sms(device_index) and split_k * 2 <= min(num_groups, 16):
        split_k *= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4, num_stages=3)


def gemm_config(m: int, n: int, k: int, group_size: int) -> dict:
    block_m = 32 if m <= 32 else 64 if m <= 64 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=min(group_size, 64), GROUP_M=8,
                num_warps=4 if block_m <= 64 else 8, num_stages=3)  # fmt: skip


def awq_gemv(x, qweight, qzeros, scales, group_size: int, bias=None, config: dict | None = None) -> torch.Tensor:
    """x [M <= 16, in] -> [M, out] in x's dtype. `config` overrides gemv_config (tuning, tests)."""
    _check(x, qweight, qzeros, scales, group_size)
    m, k = x.shape
    n = scales.shape[1]
    assert m <= GEMV_MAX_M
    cfg = {**gemv_config(m, n, k, group_size, x.device.index), **(config or {})}
    block_k, split_k = cfg["BLOCK_K"], cfg["SPLIT_K"]
    assert group_size % block_k == 0
    k_per_split = triton.cdiv(k // group_size, split_k) * group_size
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else scales
    _awq_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split_k)](
        x, qweight, qzeros, scales, bias_arg, target, m, n, k, x.stride(0), target.stride(-2),
        target.stride(0) if split_k > 1 else 0, k_per_split,
        GROUP=group_size, BLOCK_M=1 if m == 1 else 16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, SPLIT_K=split_k,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
            target, bias_arg, out, m * n, n, SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block
        )
    return out


def awq_gemm(x, qweight, qzeros, scales, group_size: int, bias=None, config: dict | None = None) -> torch.Tensor:
    """x [M, in] -> [M, out] in x's dtype, fused dequantisation + tl.dot."""
    _check(x, qweight, qzeros, scales, group_size)
    m, k = x.shape
    n = scales.shape[1]
    cfg = {**gemm_config(m, n, k, group_size), **(config or {})}
    assert group_size % cfg["BLOCK_K"] == 0
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _awq_gemm_kernel[grid](
        x, qweight, qzeros, scales, bias if bias is not None else scales, out, m, n, k, x.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def awq_dequantize(qweight, qzeros, scales, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """-> W [in, out] in `dtype` (reference: kernels.awq_reference.dequantize)."""
    k, n8 = qweight.shape
    n = n8 * 8
    block_k, block_n = min(group_size, 64), 128
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _awq_dequant_kernel[(k // block_k, triton.cdiv(n, block_n))](
        qweight, qzeros, scales, out, n, GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k
    )
    return out


def awq_linear(x, qweight, qzeros, scales, group_size: int, bias=None) -> torch.Tensor:
    """x [M, in] -> [M, out]: the kernel for M (see the module docstring)."""
    m = x.shape[0]
    if m <= GEMV_MAX_M:
        return awq_gemv(x, qweight, qzeros, scales, group_size, bias)
    if m < DEQUANT_MIN_M:
        return awq_gemm(x, qweight, qzeros, scales, group_size, bias)
    w = awq_dequantize(qweight, qzeros, scales, group_size, x.dtype)
    return torch.addmm(bias.to(x.dtype), x, w) if bias is not None else x @ w
