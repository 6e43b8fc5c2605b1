"""awq_repack's copy of an AWQ layer's weights, built once at load time, and its tl.dot GEMV (M <= 16) and dequantise
kernel (M > 16); gemv1_repacked.py has the f16x2 GEMV over it (small M). With these a layer that awq_repack fits
needs no AutoAWQ tensors on the GPU (AWQLinearMethod.repack drops them): the int4 weights are held once.

    wq    int32 [N/128, K/128, 16, 8, 16]: column block b (128 columns), K tile t (128 rows = one group), slice r,
          row group i, column group j  <-  qweight[128 t + 16 i + r, 16 b + j]
    meta  int32 [N/128, K/128, 8, 16]: per tile and column group, words 0-3 the zero points as f16x2.py's _ZEROS_ASM
          makes them (f16x2 1024 + z for column pairs 0, 2; -(64 + z) for pairs 1, 3), words 4-7 the scales * 16 as
          f16x2 pairs (columns 2p, 2p + 1)

A slice [8, 16] is 512 contiguous bytes (one 16-byte load per lane of a warp) and a program's tiles one contiguous
chunk; a lane's 16 rows of a tile are consecutive, so the f16x2 kernel's inputs come as 8 bf16 / fp16 pairs (one
4-byte load each), and zero points and scales as 8 16-byte loads per tile instead of 8 scalar 2-byte scale loads and
a zero point decode (9-13 % faster than over the AutoAWQ tensors on an H200 at the three Llama-3-8B shapes, with
PDL; docs/benchmarks.md).

The kernels here decode the meta back to (z, s) per column and unpack nibbles with unpack.py's float32 mantissa
trick (exact: (q - z) * 16**e, then times s * 16**-e), so the weights they produce are bit-identical to the AutoAWQ
kernels' (and the reference's). K row 16 i + r of a tile sits at layout position 8 r + i; the kernels gather rows in
K order (_repacked_rows), so x loads and W stores stay contiguous.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from aserve.kernels.awq import tuning
from aserve.kernels.awq.f16x2 import _f16_bits
from aserve.kernels.awq.split_k import split_k_reduce
from aserve.kernels.awq.unpack import _in_column_order, _mant
from aserve.kernels.awq_reference import unpack_int4

REPACK_BLOCK_N8 = 16  # column groups (of 8) per program
REPACK_GROUP = 128  # the layout's K tile: one group


class RepackedAWQ(NamedTuple):
    """awq_repack's copy of one layer's weights (the layout: the module docstring)."""

    wq: torch.Tensor  # int32 [N/128 * K/128 * 2048]
    meta: torch.Tensor  # int32 [N/128 * K/128 * 128]
    in_features: int
    out_features: int


def awq_repack(qweight, qzeros, scales, group_size: int) -> RepackedAWQ | None:
    """AutoAWQ gemm tensors -> the repacked layout (once, at load time); None where it does not apply (group size
    other than 128, output size not a multiple of 128: those keep the kernels of autoawq.py)."""
    k, n8 = qweight.shape
    assert qzeros.shape == (k // group_size, n8) and scales.shape == (k // group_size, n8 * 8)
    if group_size != REPACK_GROUP or n8 % REPACK_BLOCK_N8 or k * n8 >= 2**31:
        return None
    if scales.abs().max().item() * 16 >= 65504:  # the scales * 16 are stored as fp16
        return None
    kt, nb = k // REPACK_GROUP, n8 // REPACK_BLOCK_N8
    wq = qweight.view(kt, 8, 16, nb, REPACK_BLOCK_N8).permute(3, 0, 2, 1, 4).contiguous().view(-1)
    z = unpack_int4(qzeros).float().view(kt, n8, 8)  # natural column order
    odd_pair = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool, device=z.device)
    words = torch.cat([torch.where(odd_pair, -(64.0 + z), 1024.0 + z), scales.float().view(kt, n8, 8) * 16.0], -1)
    h = words.half().view(torch.int16).to(torch.int32) & 0xFFFF  # [kt, n8, 16] f16 bits
    meta = h[..., 0::2] | (h[..., 1::2] << 16)  # [kt, n8, 8]: word w = (value 2w, value 2w + 1)
    meta = meta.view(kt, nb, REPACK_BLOCK_N8, 8).permute(1, 0, 3, 2).contiguous().view(-1)
    return RepackedAWQ(wq, meta, k, n8 * 8)


@triton.jit
def _repacked_plane(qw, qw_hi, zw, sw, NIB: tl.constexpr):
    """float32 (q - z) * s of nibble NIB ([BP, 16]; columns 8j + AWQ_ORDER[NIB]) from the tile's words qw and the
    meta words zw / sw ([16]) holding its column's zero point and scale * 16."""
    C: tl.constexpr = (NIB % 4) * 2 + NIB // 4  # the nibble's column within its group of 8
    E: tl.constexpr = NIB if NIB < 5 else NIB - 5
    MULT: tl.constexpr = float(1 << (4 * E))
    zc = _f16_bits(zw >> (16 * (C % 2)))
    s = _f16_bits(sw >> (16 * (C % 2)))
    if (C // 2) % 2 == 0:
        z = zc - 1024.0  # stored as 1024 + z
    else:
        z = -zc - 64.0  # stored as -(64 + z)
    zm = 8388608.0 + z * MULT  # what _mant gives for the zero point (2**23 + z * 16**E, exact)
    if NIB < 5:
        qm = _mant(qw, 4 * NIB)
    else:
        qm = _mant(qw_hi, 4 * (NIB - 5))
    return (qm - zm[None, :]) * (s * (0.0625 / MULT))[None, :]


@triton.jit
def _repacked_dequant_tile(w_ptr, m_ptr, rp, BP: tl.constexpr):
    """The rows at layout positions rp ([BP]) of the repacked tile at w_ptr / m_ptr -> float32 [BP, 128]."""
    rj = tl.arange(0, 16)
    qw = tl.load(w_ptr + rp[:, None] * 16 + rj[None, :])
    z0, z1, z2, z3 = tl.load(m_ptr + rj), tl.load(m_ptr + 16 + rj), tl.load(m_ptr + 32 + rj), tl.load(m_ptr + 48 + rj)
    s0, s1, s2, s3 = (tl.load(m_ptr + 64 + rj), tl.load(m_ptr + 80 + rj), tl.load(m_ptr + 96 + rj),
                      tl.load(m_ptr + 112 + rj))  # fmt: skip
    qw_hi = qw >> 20
    # nibble i holds column (0, 2, 4, 6, 1, 3, 5, 7)[i], whose words are z / s [column // 2]
    return _in_column_order(
        _repacked_plane(qw, qw_hi, z0, s0, 0), _repacked_plane(qw, qw_hi, z1, s1, 1),
        _repacked_plane(qw, qw_hi, z2, s2, 2), _repacked_plane(qw, qw_hi, z3, s3, 3),
        _repacked_plane(qw, qw_hi, z0, s0, 4), _repacked_plane(qw, qw_hi, z1, s1, 5),
        _repacked_plane(qw, qw_hi, z2, s2, 6), _repacked_plane(qw, qw_hi, z3, s3, 7), BP, 16,
    )  # fmt: skip


@triton.jit
def _repacked_rows(c, CH: tl.constexpr, BP: tl.constexpr):
    """Chunk c (of CH per tile) -> (layout positions, K rows inside the tile) of its BP rows: K rows c % CH * BP ..
    + BP in order, so x loads and W stores are contiguous (each row's 64 bytes of weights are too). Taking the
    positions in order instead (rows scattered) makes the M <= 16 GEMV ~35 % slower on an H200 (docs/benchmarks.md,
    "What was tried: AWQ kernels")."""
    q = (c % CH) * BP + tl.arange(0, BP)
    return (q % 16) * 8 + q // 16, q


@triton.jit
def _awq_dequant_repacked_kernel(wq_ptr, meta_ptr, out_ptr, N, KT, BP: tl.constexpr):
    """Program (column block, K tile, row chunk): BP rows of one tile -> W [K, N]."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    pos, rows = _repacked_rows(tl.program_id(2), 128 // BP, BP)
    tile = pid_n * KT + t
    w = _repacked_dequant_tile(wq_ptr + tile * 2048, meta_ptr + tile * 128, pos, BP)
    rn = pid_n * 128 + tl.arange(0, 128)
    tl.store(out_ptr + (t * 128 + rows)[:, None].to(tl.int64) * N + rn[None, :], w.to(out_ptr.dtype.element_ty))


@triton.jit
def _awq_gemv_repacked_dot_kernel(
    x_ptr, wq_ptr, meta_ptr, bias_ptr, out_ptr, M, N, KT, stride_xm, stride_om, stride_os, tiles,
    BLOCK_M: tl.constexpr, BP: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    SWAP: tl.constexpr = False,
):  # fmt: skip
    """x [M <= 16, K] -> [M, N] over awq_repack's layout (M padded to BLOCK_M = 16 for tl.dot). Program (pid_n,
    pid_k): column block pid_n, K tiles pid_k * tiles .. + tiles; split K as _awq_gemv_kernel (float32 partials
    [SPLIT_K, M, N], then split_k_reduce). SWAP: out^T = W^T x^T, the weight tile as the dot's first operand
    (128 rows: Hopper's wgmma instead of mma.sync; the H200's fastest config, see REPACKED_DOT_CONFIG)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rn = pid_n * 128 + tl.arange(0, 128)
    if SWAP:
        acc = tl.zeros([128, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
    CH: tl.constexpr = 128 // BP  # chunks of BP rows per tile, one loop step each
    c_lo = pid_k * tiles * CH
    for c in range(c_lo, tl.minimum(c_lo + tiles * CH, KT * CH)):
        t = c // CH
        pos, rows = _repacked_rows(c, CH, BP)
        tile = pid_n * KT + t
        w = _repacked_dequant_tile(wq_ptr + tile * 2048, meta_ptr + tile * 128, pos, BP)
        if SWAP:
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + (t * 128 + rows)[:, None], mask=m_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(tl.trans(w), xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(w).to(xt.dtype), xt, acc)
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (t * 128 + rows)[None, :], mask=m_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)
    if SWAP:
        acc = tl.trans(acc)
    ok = m_ok[:, None] & (rn < N)[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


def awq_gemv_repacked_dot(x, packed: RepackedAWQ, bias=None, config: dict | None = None) -> torch.Tensor:
    """x [M <= 16, in] -> [M, out] in x's dtype over awq_repack's copy (the tl.dot kernel: M > 1, or float32). K
    split until there are two programs per SM (at most 32 ways)."""
    m, k = x.shape
    n = packed.out_features
    assert k == packed.in_features and x.stride(-1) == 1 and m <= tuning.GEMV_MAX_M
    cfg = {**tuning.REPACKED_DOT_CONFIG, **(config or {})}
    kt, nb = k // REPACK_GROUP, n // (8 * REPACK_BLOCK_N8)
    split_k = cfg.get("SPLIT_K")
    if split_k is None:
        split_k = 1
        while nb * split_k < 2 * tuning._num_sms(x.device.index) and split_k * 2 <= min(kt, 32):
            split_k *= 2
    tiles = triton.cdiv(kt, max(1, min(split_k, kt)))
    split_k = triton.cdiv(kt, tiles)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _awq_gemv_repacked_dot_kernel[(nb, split_k)](
        x, packed.wq, packed.meta, bias if bias is not None else out, target, m, n, kt, x.stride(0),
        target.stride(-2), target.stride(0) if split_k > 1 else 0, tiles, BLOCK_M=16, BP=cfg["BP"],
        PARTIAL=split_k > 1, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, SWAP=cfg.get("SWAP", False),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if split_k > 1:
        split_k_reduce(target, bias, out)
    return out


def awq_dequantize_repacked(packed: RepackedAWQ, dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """awq_repack's copy -> W [in, out] in `dtype` (the same values as awq_dequantize of the AutoAWQ tensors)."""
    k, n = packed.in_features, packed.out_features
    cfg = {**tuning.REPACKED_DEQUANT_CONFIG, **(config or {})}
    out = torch.empty(k, n, dtype=dtype, device=packed.wq.device)
    _awq_dequant_repacked_kernel[(n // 128, k // 128, 128 // cfg["BP"])](
        packed.wq, packed.meta, out, n, k // 128, BP=cfg["BP"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out
