"""Packed f16x2 arithmetic for the M = 1 AWQ GEMVs (aserve/kernels/awq/gemv1.py, gemv1_repacked.py): inline PTX
that unpacks two int4 weights per instruction and multiplies-accumulates them in f16x2, and its twins in plain tl ops.

Nibble i of an int32 holds column AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i], so nibbles p and p + 4 hold the column
pair (2p, 2p + 1), 16 bits apart: the two halves of an f16x2.

  * lop3(v, 0x000F000F, 0x64006400) is (1024 + q0, 1024 + q4) as f16x2 (the nibble lands in the mantissa of
    1024.0 = 0x6400); mask 0x00F000F0 gives (1024 + 16 q1, 1024 + 16 q5); v >> 8 and the same two masks give the
    pairs (2, 6) and (3, 7). One shift and four LOP3 per int32 (8 weights).
  * Zero points, once per tile and column group: the same on the group's qzeros int32 gives 1024 + z (pairs 0, 2)
    and, times -1/16, -(64 + z) (pairs 1, 3). Then q - z exactly: sub.f16x2 (pairs 0, 2) or
    fma.f16x2(1024 + 16 q, 1/16, -(64 + z)) (pairs 1, 3). One instruction per 2 weights.
  * acc = fma.f16x2(q - z, (x/16, x/16), acc) over R rows of one column group (rows k0 + r BLOCK_K/R + i, r < R),
    then cvt to eight float32, times the group's scale * 16, summed element-wise in float32 over the program's
    tiles and reduced over rows once at the end. Per weight ~(5 + 4 + 4) / 8 + 2 / R instructions.
  * Overflow: an f16 partial is at most R * 15 * |x| / 16 (|q - z| <= 15), so it stays finite (< 65504) while the
    R inputs of one asm call (R rows BLOCK_K / R apart inside one group) are below 69871 / R in magnitude: 4367 for
    R = 16 (tuning.GEMV1_CONFIG; R is a config key: 1, 2, 4, 8, 16). A single input may go up to ~69000
    (|x| >= 2**20 overflows the conversion of x / 16 itself).
  * Error: fp16 rounding of the R-row partials, ~1.8e-3 relative against float64 at Llama-3-8B shapes with bf16
    activations (mostly the bf16 output rounding).

Triton's interpreter (the tests on CPU) cannot run inline asm: there the asm helpers have twins in plain tl ops
(same interface, f16 rounding after every multiply-add), so the tests check indexing, nibble order, scales and the
counter logic on CPU, and the asm itself on a GPU. The launchers pass ASM=not _INTERPRETED.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Outputs of the asm are written only by its last instructions, after every input was read: LLVM may give an output
# the register of an input. Pair p of an int32 v = nibbles (p, p + 4) = columns (2p, 2p + 1), 16 bits apart.

# qzeros int32 -> z0 = (1024 + z) of pair 0, z1 = -(64 + z) of pair 1, z2 = (1024 + z) of pair 2, z3 = -(64 + z) of
# pair 3, each as f16x2 (0xAC00 = -1/16)
_ZEROS_ASM = tl.constexpr("""
{
.reg .b32 t1, t3, u, c, r0, r1, r2, r3;
mov.b32 c, 0xAC00AC00;
lop3.b32 r0, $4, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t1, $4, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 u, $4, 8;
lop3.b32 r2, u, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t3, u, 0x00F000F0, 0x64006400, 0xEA;
mul.rn.f16x2 r1, t1, c;
mul.rn.f16x2 r3, t3, c;
mov.b32 $0, r0;
mov.b32 $1, r1;
mov.b32 $2, r2;
mov.b32 $3, r3;
}
""")


def _unpack_ptx(q: int, z: int, ops: list[str], outputs: int) -> str:
    """The unpacking shared by all steps: w0..w3 = (q - z) of the four pairs as f16x2 (q int32 at $q, z0..z3 at
    $z..$z+3, 0x2C00 = 1/16), then `ops` (accumulating fmas or a first row's muls into r0 .. r{outputs - 1}), then
    those to $0 .. $(outputs - 1)."""
    regs = ", ".join(f"r{k}" for k in range(outputs))
    return (
        "\n{\n"
        f".reg .b32 t, c, w0, w1, w2, w3, {regs};\n"
        "mov.b32 c, 0x2C002C00;\n"
        f"lop3.b32 w0, ${q}, 0x000F000F, 0x64006400, 0xEA;\n"
        f"lop3.b32 w1, ${q}, 0x00F000F0, 0x64006400, 0xEA;\n"
        f"shr.u32 t, ${q}, 8;\n"
        "lop3.b32 w2, t, 0x000F000F, 0x64006400, 0xEA;\n"
        "lop3.b32 w3, t, 0x00F000F0, 0x64006400, 0xEA;\n"
        f"sub.f16x2 w0, w0, ${z};\n"
        f"fma.rn.f16x2 w1, w1, c, ${z + 1};\n"
        f"sub.f16x2 w2, w2, ${z + 2};\n"
        f"fma.rn.f16x2 w3, w3, c, ${z + 3};\n"
        + "\n".join(ops)
        + "\n"
        + "".join(f"mov.b32 ${k}, r{k};\n" for k in range(outputs))
        + "}\n"
    )


# (a0..a3 $4..$7, q $8, x $9, z0..z3 $10..$13) -> a + x * (q - z)
_STEP_ASM = tl.constexpr(_unpack_ptx(8, 10, [f"fma.rn.f16x2 r{p}, w{p}, $9, ${4 + p};" for p in range(4)], 4))
# the first row, no accumulator (q $4, x $5, z0..z3 $6..$9) -> x * (q - z)
_FIRST_STEP_ASM = tl.constexpr(_unpack_ptx(4, 6, [f"mul.rn.f16x2 r{p}, w{p}, $5;" for p in range(4)], 4))
# Two rows at once, one unpack: (a0..a3 $8..$11, b0..b3 $12..$15, q $16, x $17, y $18, z0..z3 $19..$22) ->
# (a + x * (q - z), b + y * (q - z)) in $0..$3, $4..$7; the first row of a tile (q $8, x $9, y $10, z0..z3 $11..$14)
# -> (x * (q - z), y * (q - z))
_STEP2_ASM = tl.constexpr(_unpack_ptx(16, 19, [op for p in range(4) for op in (
    f"fma.rn.f16x2 r{p}, w{p}, $17, ${8 + p};", f"fma.rn.f16x2 r{p + 4}, w{p}, $18, ${12 + p};")], 8))  # fmt: skip
_FIRST_STEP2_ASM = tl.constexpr(_unpack_ptx(8, 11, [op for p in range(4) for op in (
    f"mul.rn.f16x2 r{p}, w{p}, $9;", f"mul.rn.f16x2 r{p + 4}, w{p}, $10;")], 8))  # fmt: skip
_I32X8 = tl.constexpr((tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32))

# 4 f16x2 accumulators ($8..$11) -> 8 float32 ($0..$7), columns 0..7 in order
_FINISH_ASM = tl.constexpr("""
{
.reg .b16 l0, h0, l1, h1, l2, h2, l3, h3;
.reg .f32 f0, f1, f2, f3, f4, f5, f6, f7;
mov.b32 {l0, h0}, $8;
mov.b32 {l1, h1}, $9;
mov.b32 {l2, h2}, $10;
mov.b32 {l3, h3}, $11;
cvt.f32.f16 f0, l0;
cvt.f32.f16 f1, h0;
cvt.f32.f16 f2, l1;
cvt.f32.f16 f3, h1;
cvt.f32.f16 f4, l2;
cvt.f32.f16 f5, h2;
cvt.f32.f16 f6, l3;
cvt.f32.f16 f7, h3;
mov.b32 $0, f0;
mov.b32 $1, f1;
mov.b32 $2, f2;
mov.b32 $3, f3;
mov.b32 $4, f4;
mov.b32 $5, f5;
mov.b32 $6, f6;
mov.b32 $7, f7;
}
""")


@triton.jit
def _f16_bits(v):
    """The f16 in the low 16 bits of an int32, as float32."""
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_pack(v):
    """float32 -> its f16 bits in the low 16 bits of an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


# Twins of the asm helpers in plain tl ops, for Triton's interpreter (which cannot run inline asm). Same interface
# and the same f16 rounding after every multiply-add, but their own encoding of the zero points (pair p of qz as
# integers, (qz >> 4p) & 0x000F000F), so on CPU the tests check everything but the asm itself.


@triton.jit
def _f16x2(lo, hi):
    """float32 lo, hi -> one int32 holding (lo, hi) rounded to f16."""
    return _f16_pack(lo) | (_f16_pack(hi) << 16)


@triton.jit
def _twin_pair_step(a, q, x, z, P: tl.constexpr, FIRST: tl.constexpr):
    """Pair P: a + x * (q - z) (FIRST: x * (q - z)) with f16 rounding, a and x f16x2, z = (qz >> 4P) & 0x000F000F."""
    qp = (q >> (4 * P)) & 0x000F000F
    xv = _f16_bits(x)
    lo = xv * ((qp & 0xF) - (z & 0xF)).to(tl.float32)
    hi = xv * ((qp >> 16) - (z >> 16)).to(tl.float32)
    if not FIRST:
        lo += _f16_bits(a)
        hi += _f16_bits(a >> 16)
    return _f16x2(lo, hi)


@triton.jit
def _zero_consts(qz, ASM: tl.constexpr):
    """The group's zero points ([BN8] int32) in the form _step takes (4 int32s per column group)."""
    if ASM:
        return tl.inline_asm_elementwise(_ZEROS_ASM, "=r,=r,=r,=r,r", [qz], dtype=(tl.int32, tl.int32, tl.int32,
                                         tl.int32), is_pure=True, pack=1)  # fmt: skip
    else:
        return qz & 0x000F000F, (qz >> 4) & 0x000F000F, (qz >> 8) & 0x000F000F, (qz >> 12) & 0x000F000F


@triton.jit
def _step(a0, a1, a2, a3, q, x, z0, z1, z2, z3, FIRST: tl.constexpr, ASM: tl.constexpr):
    """One row of packed weights q [BKR, BN8] times x [BKR, 1] (f16x2 (x/16, x/16)) into the four f16x2 accumulators
    (pair p: columns 2p, 2p + 1 of each column group); FIRST: a0..a3 are ignored (the first row)."""
    if ASM:
        if FIRST:
            return tl.inline_asm_elementwise(
                _FIRST_STEP_ASM,
                "=r,=r,=r,=r,r,r,r,r,r,r",
                [q, x, z0, z1, z2, z3],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True,
                pack=1,
            )
        else:
            return tl.inline_asm_elementwise(
                _STEP_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r", [a0, a1, a2, a3, q, x, z0, z1, z2, z3],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
            )  # fmt: skip
    else:
        return (_twin_pair_step(a0, q, x, z0, 0, FIRST), _twin_pair_step(a1, q, x, z1, 1, FIRST),
                _twin_pair_step(a2, q, x, z2, 2, FIRST), _twin_pair_step(a3, q, x, z3, 3, FIRST))  # fmt: skip


@triton.jit
def _finish(a0, a1, a2, a3, ASM: tl.constexpr):
    """Four f16x2 accumulators -> eight float32 [BKR, BN8], column 8j + c in the c-th."""
    if ASM:
        return tl.inline_asm_elementwise(
            _FINISH_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [a0, a1, a2, a3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return (_f16_bits(a0), _f16_bits(a0 >> 16), _f16_bits(a1), _f16_bits(a1 >> 16), _f16_bits(a2),
                _f16_bits(a2 >> 16), _f16_bits(a3), _f16_bits(a3 >> 16))  # fmt: skip


# Triton's interpreter (TRITON_INTERPRET=1, the tests on CPU) runs the tl twins of the asm helpers
_INTERPRETED = isinstance(_step, InterpretedFunction)
