"""Triton kernels for AWQ int4 linear layers (AutoAWQ "gemm" layout; see kernels/awq_reference.py for the layout
and the pure-torch reference they are tested against). `awq_linear` picks one by the number of rows M:

    M == 1       awq_gemv     batch-1 decode: memory-bound. Each program streams [BLOCK_K, BLOCK_N/8] tiles of
                              packed weights and keeps eight element-wise float32 accumulators (one per nibble)
                              in registers: x * (q - z) * s per weight, one reduction over K at the very end.
                              Split-K spreads K over programs (float32 partials + a reduce kernel in a fixed
                              order, so results do not depend on scheduling).
    1 < M <= 16  awq_gemv     small batches / speculative verification: a dequantised K tile, then tl.dot.
    M > 16       dequantise the whole weight once (awq_dequantize, at ~3.3 TB/s of bytes moved on an H200), then
                 cuBLAS. A fused dequantise + tl.dot GEMM was 2-4x slower than this on the H200 at every M from
                 64 to 2048 (bench/awq_bench.py, docs/benchmarks.md), so there is none.

Unpacking without per-weight shifts or int-to-float conversions (a slow path on NVIDIA GPUs): for nibble i < 5 of an
int32 v, (v & (15 << 4i)) | 0x4B000000 read as a float32 is exactly 2**23 + q * 16**i (the nibble lands in the
mantissa of 2**23), so (that - the same for the zero point) = (q - z) * 16**i exactly, and 16**-i is folded into the
scale. The three top nibbles do the same on v >> 20. One AND-OR (a single LOP3) and one subtraction per weight.

Nibble i holds column 8j + AWQ_ORDER[i]; joining the eight nibble planes as a binary tree,
join(join(join(n0, n2), join(n1, n3)), join(join(n4, n6), join(n5, n7))), puts them in column order (AutoAWQ's
interleave is exactly that tree), so tiles come out [BLOCK_K, BLOCK_N] with natural columns.

Every K tile lies inside one quantisation group (BLOCK_K divides the group size), so a tile needs one row of zeros
and scales.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

GEMV_MAX_M = 16  # more rows: dequantise + cuBLAS
# Launch configurations chosen on an H200 (bench/awq_bench.py --sections tune); awq_bench may override them.
GEMV1_CONFIG = dict(BLOCK_N=512, BLOCK_K=128, TILES_PER_PROGRAM=1, EACH_TILE=True, num_warps=4, num_stages=1)
DEQUANT_CONFIG = dict(BLOCK_N=256, BLOCK_K=32, num_warps=4)


@triton.jit
def _mant(v, SHIFT: tl.constexpr):
    """float32 2**23 + (nibble SHIFT / 4 of v) * 2**SHIFT, exactly (SHIFT <= 16: the nibble stays below bit 23)."""
    return ((v & (15 << SHIFT)) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _diff(qw, qz, qw_hi, qz_hi, NIB: tl.constexpr):
    """(q - z) * 16**e of nibble NIB as float32, [R, BN8] for columns 8j + AWQ_ORDER[NIB]: qw [R, BN8] and qz [BN8]
    are packed int32s, *_hi the same shifted right by 20; e = NIB (NIB < 5) or NIB - 5."""
    if NIB < 5:
        return _mant(qw, 4 * NIB) - _mant(qz, 4 * NIB)[None, :]
    else:
        return _mant(qw_hi, 4 * (NIB - 5)) - _mant(qz_hi, 4 * (NIB - 5))[None, :]


@triton.jit
def _scale(s_row, rj, j_ok, NIB: tl.constexpr):
    """s * 16**-e of nibble NIB ([BN8], the group's scales at s_row): _diff * _scale = (q - z) * s."""
    inv: tl.constexpr = 1.0 / (1 << (4 * (NIB if NIB < 5 else NIB - 5)))
    return tl.load(s_row + rj * 8 + ((NIB % 4) * 2 + NIB // 4), mask=j_ok, other=0.0).to(tl.float32) * inv


@triton.jit
def _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, NIB: tl.constexpr):
    """The float32 weights (q - z) * s of nibble NIB, [R, BN8]."""
    return _diff(qw, qz, qw_hi, qz_hi, NIB) * _scale(s_row, rj, j_ok, NIB)[None, :]


@triton.jit
def _in_column_order(w0, w1, w2, w3, w4, w5, w6, w7, R: tl.constexpr, BLOCK_N8: tl.constexpr):
    """Eight nibble planes [R, BN8] -> [R, 8 BN8] with column 8j + c where it belongs."""
    w = tl.join(tl.join(tl.join(w0, w2), tl.join(w1, w3)), tl.join(tl.join(w4, w6), tl.join(w5, w7)))
    return tl.reshape(w, [R, BLOCK_N8 * 8])


@triton.jit
def _dequant_tile(qw_ptr, qz_ptr, s_ptr, k0, rk, rj, j_ok, N, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_N8: tl.constexpr):  # fmt: skip
    """The float32 weights W[k0 + rk, 8 rj ...] ([BLOCK_K, 8 BLOCK_N8]) of one K tile inside one group."""
    N8 = N // 8
    qw = tl.load(qw_ptr + (k0 + rk)[:, None].to(tl.int64) * N8 + rj[None, :], mask=j_ok[None, :], other=0)
    g = k0 // GROUP
    qz = tl.load(qz_ptr + g * N8 + rj, mask=j_ok, other=0)
    s_row = s_ptr + g * N
    qw_hi = qw >> 20
    qz_hi = qz >> 20
    return _in_column_order(
        _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 0), _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 1),
        _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 2), _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 3),
        _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 4), _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 5),
        _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 6), _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 7),
        BLOCK_K, BLOCK_N8,
    )  # fmt: skip


@triton.jit
def _gemv1_zeros(BLOCK_K: tl.constexpr, BLOCK_N8: tl.constexpr, EACH_TILE: tl.constexpr):
    if EACH_TILE:
        return tl.zeros([BLOCK_N8], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_K, BLOCK_N8], dtype=tl.float32)


@triton.jit
def _gemv1_nibble(acc, x, qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, NIB: tl.constexpr, EACH_TILE: tl.constexpr):
    if EACH_TILE:  # the tile lies inside one group: scale after the reduction over K
        return acc + tl.sum(x * _diff(qw, qz, qw_hi, qz_hi, NIB), 0) * _scale(s_row, rj, j_ok, NIB)
    else:  # element-wise, reduced once at the end
        return acc + x * _plane(qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, NIB)


@triton.jit
def _gemv1_total(acc, EACH_TILE: tl.constexpr):
    if EACH_TILE:
        return acc[None, :]
    else:
        return tl.sum(acc, 0)[None, :]


@triton.jit
def _awq_gemv1_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, N, K, stride_os, k_per_split,
    GROUP: tl.constexpr, BLOCK_N8: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, EACH_TILE: tl.constexpr,
):  # fmt: skip
    """One row. Each program does TILES_PER_PROGRAM K tiles (a large grid keeps many loads in flight, which a GEMV
    needs to reach memory bandwidth). Per nibble one accumulator: EACH_TILE reduces every tile over K right away
    ([BN8]); otherwise it is element-wise ([BLOCK_K, BN8]) and reduced once at the end."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    N8 = N // 8
    rj = pid_n * BLOCK_N8 + tl.arange(0, BLOCK_N8)
    j_ok = rj < N8
    rk = tl.arange(0, BLOCK_K)
    a0 = _gemv1_zeros(BLOCK_K, BLOCK_N8, EACH_TILE)
    a1 = _gemv1_zeros(BLOCK_K, BLOCK_N8, EACH_TILE)
    a2 = _gemv1_zeros(BLOCK_K, BLOCK_N8, EACH_TILE)
    a3 = _gemv1_zeros(BLOCK_K, BLOCK_N8, EACH_TILE)
    a4 = _gemv1_zeros(BLOCK_K, BLOCK_N8, EACH_TILE)
    a5 = _gemv1_zeros(BLOCK_K, BLOCK_N8, EACH_TILE)
    a6 = _gemv1_zeros(BLOCK_K, BLOCK_N8, EACH_TILE)
    a7 = _gemv1_zeros(BLOCK_K, BLOCK_N8, EACH_TILE)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        qw = tl.load(qw_ptr + (k0 + rk)[:, None].to(tl.int64) * N8 + rj[None, :], mask=j_ok[None, :], other=0)
        g = k0 // GROUP
        qz = tl.load(qz_ptr + g * N8 + rj, mask=j_ok, other=0)
        x = tl.load(x_ptr + k0 + rk).to(tl.float32)[:, None]
        s_row = s_ptr + g * N
        qw_hi = qw >> 20
        qz_hi = qz >> 20
        a0 = _gemv1_nibble(a0, x, qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 0, EACH_TILE)
        a1 = _gemv1_nibble(a1, x, qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 1, EACH_TILE)
        a2 = _gemv1_nibble(a2, x, qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 2, EACH_TILE)
        a3 = _gemv1_nibble(a3, x, qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 3, EACH_TILE)
        a4 = _gemv1_nibble(a4, x, qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 4, EACH_TILE)
        a5 = _gemv1_nibble(a5, x, qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 5, EACH_TILE)
        a6 = _gemv1_nibble(a6, x, qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 6, EACH_TILE)
        a7 = _gemv1_nibble(a7, x, qw, qz, qw_hi, qz_hi, s_row, rj, j_ok, 7, EACH_TILE)
    y = _in_column_order(
        _gemv1_total(a0, EACH_TILE), _gemv1_total(a1, EACH_TILE), _gemv1_total(a2, EACH_TILE),
        _gemv1_total(a3, EACH_TILE), _gemv1_total(a4, EACH_TILE), _gemv1_total(a5, EACH_TILE),
        _gemv1_total(a6, EACH_TILE), _gemv1_total(a7, EACH_TILE), 1, BLOCK_N8,
    )  # fmt: skip
    rn = pid_n * BLOCK_N8 * 8 + tl.arange(0, BLOCK_N8 * 8)[None, :]
    n_ok = rn < N
    if PARTIAL:  # split K: float32 partials [SPLIT_K, N]
        tl.store(out_ptr + pid_k * stride_os + rn, y, mask=n_ok)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


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
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K, HAS_BIAS: tl.constexpr, SPLIT_PAD: tl.constexpr,
                           BLOCK: tl.constexpr):  # fmt: skip
    """out = sum of the SPLIT_K float32 partials [SPLIT_K, MN] (+ bias). All partials of a column block are loaded at
    once (a loop over them would wait for one load after another) and summed in a fixed tree order, so results do
    not depend on scheduling."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    rs = tl.arange(0, SPLIT_PAD)
    parts = tl.load(part_ptr + rs[:, None] * MN + offs[None, :], mask=(rs < SPLIT_K)[:, None] & ok[None, :], other=0.0)
    acc = tl.sum(parts, 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def split_k_reduce(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = partials [SPLIT_K, M, N] summed over SPLIT_K (+ bias [N])."""
    split_k, m, n = partials.shape
    pad = triton.next_power_of_2(split_k)
    block = max(32, 4096 // pad)
    _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
        partials, bias if bias is not None else partials, out, m * n, n, split_k, HAS_BIAS=bias is not None,
        SPLIT_PAD=pad, BLOCK=block,
    )  # fmt: skip


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
    """BLOCK_N / BLOCK_K / SPLIT_K / warps / stages for awq_gemv. M = 1: each program does TILES_PER_PROGRAM K
    tiles (K split accordingly). M > 1: K is split until there are two programs per SM."""
    if m == 1:
        cfg = dict(GEMV1_CONFIG)
        tiles = cfg.pop("TILES_PER_PROGRAM")
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], group_size)
        cfg["SPLIT_K"] = max(1, k // (cfg["BLOCK_K"] * tiles))
        return cfg
    cfg = dict(BLOCK_N=128 if n >= 2048 else 64, BLOCK_K=min(64, group_size), num_warps=4, num_stages=3)
    tiles_n = triton.cdiv(n, cfg["BLOCK_N"])
    num_tiles_k = k // cfg["BLOCK_K"]
    split_k = 1
    while tiles_n * split_k < 2 * _num_sms(device_index) and split_k * 2 <= min(num_tiles_k, 32):
        split_k *= 2
    cfg["SPLIT_K"] = split_k
    return cfg


def awq_gemv(x, qweight, qzeros, scales, group_size: int, bias=None, config: dict | None = None) -> torch.Tensor:
    """x [M <= 16, in] -> [M, out] in x's dtype. `config` overrides gemv_config (tuning, tests)."""
    _check(x, qweight, qzeros, scales, group_size)
    m, k = x.shape
    n = scales.shape[1]
    assert m <= GEMV_MAX_M
    cfg = {**gemv_config(m, n, k, group_size, x.device.index), **(config or {})}
    block_k, split_k, block_n = cfg["BLOCK_K"], cfg["SPLIT_K"], cfg["BLOCK_N"]
    assert group_size % block_k == 0 and block_n % 8 == 0
    k_per_split = triton.cdiv(k // block_k, split_k) * block_k  # whole K tiles, so no tile straddles two groups
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else scales
    grid = (triton.cdiv(n, block_n), split_k)
    if m == 1:
        _awq_gemv1_kernel[grid](
            x, qweight, qzeros, scales, bias_arg, target, n, k, target.stride(0) if split_k > 1 else 0, k_per_split,
            GROUP=group_size, BLOCK_N8=block_n // 8, BLOCK_K=block_k, PARTIAL=split_k > 1, HAS_BIAS=bias is not None,
            EACH_TILE=cfg["EACH_TILE"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
    else:
        _awq_gemv_kernel[grid](
            x, qweight, qzeros, scales, bias_arg, target, m, n, k, x.stride(0), target.stride(-2),
            target.stride(0) if split_k > 1 else 0, k_per_split,
            GROUP=group_size, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split_k > 1,
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
    if split_k > 1:
        split_k_reduce(target, bias, out)
    return out


def awq_dequantize(qweight, qzeros, scales, group_size: int, dtype: torch.dtype, config: dict | None = None):
    """-> W [in, out] in `dtype` (reference: kernels.awq_reference.dequantize)."""
    k, n8 = qweight.shape
    n = n8 * 8
    cfg = {**DEQUANT_CONFIG, **(config or {})}
    block_k, block_n = min(group_size, cfg["BLOCK_K"]), cfg["BLOCK_N"]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _awq_dequant_kernel[(k // block_k, triton.cdiv(n, block_n))](
        qweight, qzeros, scales, out, n, GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def awq_linear(x, qweight, qzeros, scales, group_size: int, bias=None) -> torch.Tensor:
    """x [M, in] -> [M, out]: the kernel for M (see the module docstring)."""
    m = x.shape[0]
    if m <= GEMV_MAX_M:
        return awq_gemv(x, qweight, qzeros, scales, group_size, bias)
    w = awq_dequantize(qweight, qzeros, scales, group_size, x.dtype)
    return torch.addmm(bias.to(x.dtype), x, w) if bias is not None else x @ w
