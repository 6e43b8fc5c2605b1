"""Unpacking AutoAWQ int4 tiles to float32 for the tl.dot and dequantise kernels (aserve/kernels/awq/autoawq.py,
aserve/kernels/awq/repack.py), without per-weight shifts or int-to-float conversions.

For nibble i < 5 of an int32 v, (v & (15 << 4i)) | 0x4B000000 read as a float32 is exactly 2**23 + q * 16**i (the
nibble lands in the mantissa of 2**23), so (that - the same for the zero point) = (q - z) * 16**i exactly, and
16**-i is folded into the scale; the three top nibbles do the same on v >> 20. One AND-OR (a single LOP3) and one
subtraction per weight. Joining the eight nibble planes as
join(join(join(n0, n2), join(n1, n3)), join(join(n4, n6), join(n5, n7))) (AutoAWQ's interleave is exactly that tree)
gives tiles [BLOCK_K, BLOCK_N] in natural column order. Every K tile lies inside one quantisation group (BLOCK_K
divides the group size), so a tile needs one row of zeros and scales.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
