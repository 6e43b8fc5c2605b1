"""Triton kernels for AWQ int4 linear layers (AutoAWQ "gemm" layout; see aserve/kernels/awq_reference.py for the layout
and the pure-torch reference they are tested against). `awq_linear` picks one by the number of rows M (an AWQ layer
on a GPU: the same kernels' twins over awq_repack's layout, *_repacked, which is all it keeps of the weights):

    M == 1       awq_gemv     batch-1 decode: memory-bound. fp16 / bf16 activations: packed f16x2 arithmetic in
                              inline PTX (below) and a split-K reduction fused into the same launch (below).
                              float32 activations take the M <= 16 kernel (f16 would round them). Over the
                              repacked copy up to REPACKED_GEMV1_MAX_M = 6 rows, two rows per program (each
                              weight unpacked once for both; a tile's programs run together, so its weights come
                              from DRAM once).
    1 < M <= 16  awq_gemv     small batches / speculative verification: a dequantised K tile, then tl.dot.
    M > 16       dequantise the whole weight once (awq_dequantize, at ~3.3 TB/s of bytes moved on an H200), then
                 cuBLAS. A fused dequantise + tl.dot GEMM was 2-4x slower than this on the H200 at every M from
                 64 to 2048 (bench/awq_bench.py, docs/benchmarks.md), so there is none.

M = 1, f16x2. Unpacking and multiplying each weight alone in float32 took ~6 instructions per weight and left the
GEMV instruction-bound; here the work is done two columns at a time in f16x2 (two halves of a 32-bit register):

  * Nibble i of an int32 holds column AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i], so nibbles p and p + 4 hold the
    column pair (2p, 2p + 1), 16 bits apart: exactly the two halves of an f16x2.
  * lop3(v, 0x000F000F, 0x64006400) is (1024 + q0, 1024 + q4) as f16x2 (the nibble lands in the mantissa of
    1024.0 = 0x6400); mask 0x00F000F0 gives (1024 + 16 q1, 1024 + 16 q5); v >> 8 and the same two masks give the
    pairs (2, 6) and (3, 7). One shift and four LOP3 per int32 (8 weights).
  * Zero points: the same on the group's qzeros int32 gives 1024 + z (pairs 0, 2) and, times -1/16, -(64 + z)
    (pairs 1, 3), once per tile and column group. Then q - z exactly: sub.f16x2 (pairs 0, 2) or
    fma.f16x2(1024 + 16 q, 1/16, -(64 + z)) (pairs 1, 3). One instruction per 2 weights.
  * acc = fma.f16x2(q - z, (x/16, x/16), acc) over R rows of one column group (rows k0 + r BLOCK_K/R + i, r < R),
    then cvt to eight float32, times the group's scale * 16, summed element-wise in float32 over the program's
    tiles and reduced over rows once at the end. Per weight ~(5 + 4 + 4) / 8 + 2 / R instructions.
  * Overflow: an f16 partial is at most R * 15 * |x| / 16 (|q - z| <= 15), so it stays finite (< 65504) while the
    R inputs of one asm call (R rows BLOCK_K / R apart inside one group) are below 69871 / R in magnitude: 4367 for
    R = 16. A single input may go up to ~69000 (and |x| >= 2**20 overflows the conversion of x / 16 itself). Outlier
    channels of LLM activations are few (on an H200, 8 outliers up to 3e4 stayed finite), but a whole group of 128
    consecutive inputs at ~1e4 gives inf. R = 8 doubles the bound (8734; that group then has 1-3 inf outputs) but
    cost ~30 % (H200, R = 8 vs 16 at the same tiles: 10.0 / 22.2 / 22.0 vs 7.9 / 16.9 / 16.5 us on 4096x4096 /
    4096x14336 / 14336x4096), so GEMV1_CONFIG has R = 16; R is a config key (1, 2, 4, 8, 16).
  * Error: fp16 rounding of the R-row partials; relative error 1.8e-3 against a float64 reference with bf16
    activations at Llama-3-8B shapes (the float32 kernel before it: 1.7e-3; both mostly the bf16 output rounding).

M = 1, fused split-K. Programs split K (TILES tiles of BLOCK_K rows each) and write float32 partials [SPLIT_K, N];
each then increments its column block's int32 counter (atomic, acq_rel, after a barrier so the whole program's
partials are released). The program that takes it to SPLIT_K - 1 sums the partials in a fixed order (so results do
not depend on scheduling), adds the bias, writes the output and sets the counter back to 0: one launch instead of a
GEMV and a reduce kernel, and the counters are zero again for the next launch or CUDA-graph replay. Counters are
allocated once (gemv_counters: an AWQ layer keeps its own set; plain awq_gemv calls share one per device and
output size), never during graph capture. Two launches that share counters must not overlap: kernels in one stream
do not, also with programmatic dependent launch (aserve/kernels/pdl.py), which this kernel uses like the rest of
kernels/: every program waits for the previous kernel (gdc_sync) before it touches x, the partials or the counters. Its
first tile's weights, zeros and scales are loaded before that wait (nothing in a decode step writes them), so with PDL
their DRAM latency overlaps the previous kernel's tail.

M = 1 over a repacked copy (awq_repack, built once at load time; AWQLinearMethod.repack then frees the AutoAWQ tensors,
and the M <= 16 tl.dot GEMV and the dequantise kernel read the copy too): the same arithmetic and reduction over a
layout where each warp load is 512 contiguous bytes, a program's tiles are one contiguous chunk, zero points
(already in the asm's form) and scales sit beside the weights (16-byte loads) and inputs come as row pairs; 9-13 %
faster on an H200 (docs/benchmarks.md, session 10). Group size 128 and outputs a multiple of 128 only; other layers
keep the AutoAWQ tensors and awq_gemv's kernels.

M = 1, memory-level parallelism (H200, docs/benchmarks.md session 9). A load-only kernel reaches ~3.2 TB/s in CUDA
graphs (9.0 us for 4096x14336's 29 MB of packed weights) with one-warp programs reading rows of 64 bytes, and
flat streaming, cp.async (num_stages) and TMA descriptor loads were no faster; programs of 4-8 warps were much
slower for the GEMV (2-4x). What separated the GEMV from that: loads issued late (x and scales after the first
arithmetic: serial round trips), the split-K reduction (a program's atomic round trip, and the last program's
partials: ~6 us at SPLIT_K 56 vs ~1 us at 16) and per-program instruction overhead. So: one warp per program,
BLOCK_N 128, each tile's loads (weights, zeros, scales, x) issued together, the next tile's before this one's
arithmetic in a loop the compiler does not unroll, and 2-4 tiles per program to keep SPLIT_K at 8-28. Over the
repacked copy (session 14): the fewest tiles per program whose programs fit one wave of 8 per SM (_repacked_tiles_m1;
the kernel's 254 registers allow 8 one-warp programs per SM); TMA into a shared-memory pipeline and 2-4 warps per
program (fewer registers, more warps per SM) were no faster, and the arithmetic is not the bound either: with the
f16x2 step reduced to an XOR of the weights the kernel is only 0.4-1.7 us faster (bench/awq_alu_diag.py).

Triton's interpreter (the tests on CPU) cannot run inline asm: there the asm helpers have twins in plain tl ops
(same interface, f16 rounding after every multiply-add), so the tests check indexing, nibble order, scales and the
counter logic on CPU, and the asm itself on a GPU.

M <= 16 and the dequantise kernel unpack without per-weight shifts or int-to-float conversions (a slow path on
NVIDIA GPUs): for nibble i < 5 of an int32 v, (v & (15 << 4i)) | 0x4B000000 read as a float32 is exactly
2**23 + q * 16**i (the nibble lands in the mantissa of 2**23), so (that - the same for the zero point) =
(q - z) * 16**i exactly, and 16**-i is folded into the scale. The three top nibbles do the same on v >> 20. One
AND-OR (a single LOP3) and one subtraction per weight. Joining the eight nibble planes as a binary tree,
join(join(join(n0, n2), join(n1, n3)), join(join(n4, n6), join(n5, n7))), puts them in column order (AutoAWQ's
interleave is exactly that tree), so tiles come out [BLOCK_K, BLOCK_N] with natural columns.

Every K tile lies inside one quantisation group (BLOCK_K divides the group size), so a tile needs one row of zeros
and scales.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from aserve.kernels import pdl
from aserve.kernels.awq_reference import unpack_int4
from aserve.kernels.fused import silu_mul_rounded

GEMV_MAX_M = 16  # more rows: dequantise + cuBLAS
# Launch configurations chosen on an H200 (bench/awq_bench.py --sections tune); awq_bench may override them.
# M = 1 (f16x2): BLOCK_N columns and TILES K tiles of BLOCK_K rows per program, R rows per asm call (overflow: see
# the module docstring); TILES None: 4 or 2 where that leaves GEMV1_MIN_PROGRAMS programs (one warp each), else 1.
# The fastest of the configurations tried on an H200 (docs/benchmarks.md, session 9): rows of 64 bytes per program
# (BLOCK_N 128), 4 tiles for 4096x14336 and 14336x4096 (896 programs), 2 for 4096x4096 (512).
GEMV1_CONFIG = dict(BLOCK_N=128, BLOCK_K=128, R=16, TILES=None, num_warps=1, num_stages=1)
GEMV1_MIN_PROGRAMS = 512
F16X2_DTYPES = (torch.float16, torch.bfloat16)  # float32 activations take the tl.dot kernel (f16 would round them)
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


# -- M = 1: packed f16x2 arithmetic (inline PTX) and a fused split-K reduction -----------------------------------
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


# Twins of the asm helpers in plain tl ops, for Triton's interpreter (which cannot run inline asm). Same interface
# and the same f16 rounding after every multiply-add, but their own encoding of the zero points (pair p of qz as
# integers, (qz >> 4p) & 0x000F000F), so on CPU the tests check everything but the asm itself.


@triton.jit
def _f16_lo(v):
    """The low f16 of an f16x2 in an int32, as float32."""
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16x2(lo, hi):
    """float32 lo, hi -> one int32 holding (lo, hi) rounded to f16."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo16 | (hi16 << 16)


@triton.jit
def _twin_pair_step(a, q, x, z, P: tl.constexpr, FIRST: tl.constexpr):
    """Pair P: a + x * (q - z) (FIRST: x * (q - z)) with f16 rounding, a and x f16x2, z = (qz >> 4P) & 0x000F000F."""
    qp = (q >> (4 * P)) & 0x000F000F
    xv = _f16_lo(x)
    lo = xv * ((qp & 0xF) - (z & 0xF)).to(tl.float32)
    hi = xv * ((qp >> 16) - (z >> 16)).to(tl.float32)
    if not FIRST:
        lo += _f16_lo(a)
        hi += _f16_lo(a >> 16)
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
        return (_f16_lo(a0), _f16_lo(a0 >> 16), _f16_lo(a1), _f16_lo(a1 >> 16), _f16_lo(a2), _f16_lo(a2 >> 16),
                _f16_lo(a3), _f16_lo(a3 >> 16))  # fmt: skip


@triton.jit
def _load_weights(qw_ptr, qz_ptr, s_ptr, k0, rj, j_ok, N, N8, ok, GROUP: tl.constexpr, BKR: tl.constexpr,
                  R: tl.constexpr, EVEN_N: tl.constexpr):  # fmt: skip
    """One K tile's weight-side loads, all issued together: the packed weights of rows k0 + r BKR + i as R slices
    [BKR, BN8] (a 16-tuple; slots r >= R repeat slice 0 and are never used), the group's zeros [BN8] and its 8
    scale vectors [BN8] (column 8j + c in the c-th). `ok` (a [1] mask) masks the whole tile: the tile after a
    program's last loads nothing. int32 offsets (the launcher checks K * N / 8 < 2**31)."""
    p = qw_ptr + (k0 + tl.arange(0, BKR))[:, None] * N8 + rj[None, :]
    m = ok if EVEN_N else j_ok[None, :] & ok  # EVEN_N: a scalar mask, so the loads stay 16-byte vectors
    d = BKR * N8
    q0 = tl.load(p, mask=m, other=0)
    q1 = q0
    q2 = q0
    q3 = q0
    q4 = q0
    q5 = q0
    q6 = q0
    q7 = q0
    q8 = q0
    q9 = q0
    q10 = q0
    q11 = q0
    q12 = q0
    q13 = q0
    q14 = q0
    q15 = q0
    if R > 1:
        q1 = tl.load(p + d, mask=m, other=0)
    if R > 2:
        q2 = tl.load(p + 2 * d, mask=m, other=0)
        q3 = tl.load(p + 3 * d, mask=m, other=0)
    if R > 4:
        q4 = tl.load(p + 4 * d, mask=m, other=0)
        q5 = tl.load(p + 5 * d, mask=m, other=0)
        q6 = tl.load(p + 6 * d, mask=m, other=0)
        q7 = tl.load(p + 7 * d, mask=m, other=0)
    if R > 8:
        q8 = tl.load(p + 8 * d, mask=m, other=0)
        q9 = tl.load(p + 9 * d, mask=m, other=0)
        q10 = tl.load(p + 10 * d, mask=m, other=0)
        q11 = tl.load(p + 11 * d, mask=m, other=0)
        q12 = tl.load(p + 12 * d, mask=m, other=0)
        q13 = tl.load(p + 13 * d, mask=m, other=0)
        q14 = tl.load(p + 14 * d, mask=m, other=0)
        q15 = tl.load(p + 15 * d, mask=m, other=0)
    g = k0 // GROUP
    mj = ok if EVEN_N else j_ok & ok
    qz = tl.load(qz_ptr + g * N8 + rj, mask=mj, other=0)
    sp = s_ptr + g * N + rj * 8
    s = (tl.load(sp, mask=mj, other=0.0), tl.load(sp + 1, mask=mj, other=0.0), tl.load(sp + 2, mask=mj, other=0.0),
         tl.load(sp + 3, mask=mj, other=0.0), tl.load(sp + 4, mask=mj, other=0.0), tl.load(sp + 5, mask=mj, other=0.0),
         tl.load(sp + 6, mask=mj, other=0.0), tl.load(sp + 7, mask=mj, other=0.0))  # fmt: skip
    return (q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15), qz, s


@triton.jit
def _x_pair(x_ptr, rows, ok):
    """x[rows] / 16 as an f16x2 (x/16, x/16) in an int32, [BKR, 1]."""
    xb = (tl.load(x_ptr + rows, mask=ok, other=0.0).to(tl.float32) * 0.0625).to(tl.float16).to(tl.int16, bitcast=True)
    xb = xb.to(tl.int32) & 0xFFFF
    return (xb | (xb << 16))[:, None]


@triton.jit
def _load_x(x_ptr, k0, ok, BKR: tl.constexpr, R: tl.constexpr):
    """The inputs of one K tile, slice by slice as _load_weights (a 16-tuple, slots r >= R repeat slice 0)."""
    ri = k0 + tl.arange(0, BKR)
    x0 = _x_pair(x_ptr, ri, ok)
    x1 = x0
    x2 = x0
    x3 = x0
    x4 = x0
    x5 = x0
    x6 = x0
    x7 = x0
    x8 = x0
    x9 = x0
    x10 = x0
    x11 = x0
    x12 = x0
    x13 = x0
    x14 = x0
    x15 = x0
    if R > 1:
        x1 = _x_pair(x_ptr, ri + BKR, ok)
    if R > 2:
        x2 = _x_pair(x_ptr, ri + 2 * BKR, ok)
        x3 = _x_pair(x_ptr, ri + 3 * BKR, ok)
    if R > 4:
        x4 = _x_pair(x_ptr, ri + 4 * BKR, ok)
        x5 = _x_pair(x_ptr, ri + 5 * BKR, ok)
        x6 = _x_pair(x_ptr, ri + 6 * BKR, ok)
        x7 = _x_pair(x_ptr, ri + 7 * BKR, ok)
    if R > 8:
        x8 = _x_pair(x_ptr, ri + 8 * BKR, ok)
        x9 = _x_pair(x_ptr, ri + 9 * BKR, ok)
        x10 = _x_pair(x_ptr, ri + 10 * BKR, ok)
        x11 = _x_pair(x_ptr, ri + 11 * BKR, ok)
        x12 = _x_pair(x_ptr, ri + 12 * BKR, ok)
        x13 = _x_pair(x_ptr, ri + 13 * BKR, ok)
        x14 = _x_pair(x_ptr, ri + 14 * BKR, ok)
        x15 = _x_pair(x_ptr, ri + 15 * BKR, ok)
    return (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)


@triton.jit
def _f16x2_tile(c, w, x, R: tl.constexpr, ASM: tl.constexpr):
    """c (8 float32 [BKR, BN8], column 8j + c in the c-th, element-wise) + one K tile: rows k0 + r BKR + i (r < R)
    of each slice into f16x2 accumulators, then float32 times the group's scales * 16."""
    q, qz, s = w
    z0, z1, z2, z3 = _zero_consts(qz, ASM)
    z0 = z0[None, :]
    z1 = z1[None, :]
    z2 = z2[None, :]
    z3 = z3[None, :]
    a0, a1, a2, a3 = _step(q[0], q[0], q[0], q[0], q[0], x[0], z0, z1, z2, z3, True, ASM)
    for r in tl.static_range(1, R):
        a0, a1, a2, a3 = _step(a0, a1, a2, a3, q[r], x[r], z0, z1, z2, z3, False, ASM)
    f0, f1, f2, f3, f4, f5, f6, f7 = _finish(a0, a1, a2, a3, ASM)
    return (
        c[0] + f0 * (s[0].to(tl.float32) * 16.0)[None, :],
        c[1] + f1 * (s[1].to(tl.float32) * 16.0)[None, :],
        c[2] + f2 * (s[2].to(tl.float32) * 16.0)[None, :],
        c[3] + f3 * (s[3].to(tl.float32) * 16.0)[None, :],
        c[4] + f4 * (s[4].to(tl.float32) * 16.0)[None, :],
        c[5] + f5 * (s[5].to(tl.float32) * 16.0)[None, :],
        c[6] + f6 * (s[6].to(tl.float32) * 16.0)[None, :],
        c[7] + f7 * (s[7].to(tl.float32) * 16.0)[None, :],
    )


@triton.jit
def _column_sums(c, BLOCK_N8: tl.constexpr):
    """c (8 float32 [rows, BLOCK_N8], column 8j + c in the c-th) summed over rows -> [BLOCK_N8 * 8] in column order."""
    # [BN8, 2, 2, 2] flattened: index 4a + 2b + c of join(join(join(c0, c4), join(c2, c6)), join(join(c1, c5), ...))
    # is column 8j + (4a + 2b + c)
    y = tl.join(
        tl.join(tl.join(tl.sum(c[0], 0), tl.sum(c[4], 0)), tl.join(tl.sum(c[2], 0), tl.sum(c[6], 0))),
        tl.join(tl.join(tl.sum(c[1], 0), tl.sum(c[5], 0)), tl.join(tl.sum(c[3], 0), tl.sum(c[7], 0))),
    )
    return tl.reshape(y, [BLOCK_N8 * 8])


@triton.jit
def _sum_partials(part_ptr, rn, n_ok, N, split_k, SPLIT_PAD: tl.constexpr, RED_CH: tl.constexpr):
    """Columns rn of the float32 partials [split_k, N] summed in a fixed order (chunks of RED_CH rows, unrolled so
    all loads can be in flight; .cg: other programs wrote them)."""
    y = tl.zeros(rn.shape, dtype=tl.float32)
    for ch in tl.static_range(SPLIT_PAD // RED_CH):
        rs = ch * RED_CH + tl.arange(0, RED_CH)
        p = tl.load(part_ptr + rs[:, None] * N + rn[None, :], mask=(rs < split_k)[:, None] & n_ok[None, :],
                    other=0.0, cache_modifier=".cg")  # fmt: skip
        y += tl.sum(p, 0)
    return y


@triton.jit
def _gemv1_epilogue(c, pid_n, pid_k, N, split_k, bias_ptr, out_ptr, part_ptr, cnt_ptr, BLOCK_N8: tl.constexpr,
                    SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, RED_CH: tl.constexpr, EVEN_N: tl.constexpr,
                    HAS_BIAS: tl.constexpr):  # fmt: skip
    """The M = 1 kernels' end: c (8 float32 [rows, BLOCK_N8], column 8j + c in the c-th) summed over rows -> out,
    directly (+ bias) or through the float32 partials and the column block's counter (SPLIT)."""
    y = _column_sums(c, BLOCK_N8)
    rn = pid_n * BLOCK_N8 * 8 + tl.arange(0, BLOCK_N8 * 8)
    if EVEN_N:  # a constant mask, folded away
        n_ok = tl.full([BLOCK_N8 * 8], 1, tl.int1)
    else:
        n_ok = rn < N
    if SPLIT:
        tl.store(part_ptr + pid_k * N + rn, y, mask=n_ok)
        tl.debug_barrier()  # every thread's partial is stored before the (one-thread) release below
        cnt = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if cnt == split_k - 1:  # the last program of this column block
            y = _sum_partials(part_ptr, rn, n_ok, N, split_k, SPLIT_PAD, RED_CH)
            if HAS_BIAS:
                y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.store(cnt_ptr + pid_n, 0)  # ready for the next launch
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _silu_mul_epilogue(c, pid_n, pid_k, N, split_k, bias_ptr, out_ptr, part_ptr, cnt_ptr, SPLIT_PAD: tl.constexpr,
                       RED_CH: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """The end of a GEMV whose N outputs are [gate | up] (an MLP's gate/up projection; N / 2 a multiple of 128):
    c's column sums -> the float32 partials; the last of the 2 split_k programs of column block pid_n and its
    partner N / 256 blocks away (the pair's counter: pid_n mod N / 256) writes silu(gate) * up for their 128
    columns (out: [N / 2]), rounded as the GEMV's output and then aserve/kernels/fused.py's silu_and_mul would round
    it."""
    y = _column_sums(c, 16)
    tl.store(part_ptr + pid_k * N + pid_n * 128 + tl.arange(0, 128), y)
    tl.debug_barrier()  # every thread's partial is stored before the (one-thread) release below
    pair = pid_n % (N // 256)
    cnt = tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel", scope="gpu")
    if cnt == 2 * split_k - 1:  # the last program of the pair
        rg = pair * 128 + tl.arange(0, 128)
        ru = N // 2 + rg
        all_ok = tl.full([128], 1, tl.int1)
        g = _sum_partials(part_ptr, rg, all_ok, N, split_k, SPLIT_PAD, RED_CH)
        u = _sum_partials(part_ptr, ru, all_ok, N, split_k, SPLIT_PAD, RED_CH)
        if HAS_BIAS:
            g += tl.load(bias_ptr + rg).to(tl.float32)
            u += tl.load(bias_ptr + ru).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + rg, silu_mul_rounded(g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32), dtype))
        tl.store(cnt_ptr + pair, 0)  # ready for the next launch


@triton.jit
def _awq_gemv1_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, N, N8, split_k, tiles,
    GROUP: tl.constexpr, BLOCK_N8: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, RED_CH: tl.constexpr, EVEN_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """x [K] -> out [N]. Program (pid_n, pid_k): columns pid_n * 8 BLOCK_N8 ..., the `tiles` K tiles from
    pid_k * tiles (each BLOCK_K rows inside one group), in a loop that is not unrolled: tile t + 1's loads are
    issued before tile t's arithmetic (two tiles in registers; unrolled, the compiler hoisted every tile's loads
    and spilled). The first tile's weights are loaded before waiting for the previous kernel (PDL): weights are
    never written by the kernels before it. SPLIT (split_k > 1): float32 partials [split_k, N] and the column
    block's counter; the program that takes it to split_k - 1 sums the partials in a fixed order, writes out, and
    sets the counter back to 0 for the next launch (or graph replay)."""
    BKR: tl.constexpr = BLOCK_K // R
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rj = pid_n * BLOCK_N8 + tl.arange(0, BLOCK_N8)
    j_ok = rj < N8
    k_first = pid_k * tiles * BLOCK_K
    one = tl.full([1], 1, tl.int1)  # tile masks as [1] tensors (the interpreter takes no Python bool as a mask)
    w = _load_weights(qw_ptr, qz_ptr, s_ptr, k_first, rj, j_ok, N, N8, one, GROUP, BKR, R, EVEN_N)
    pdl.gdc_sync(USE_PDL)  # x, the partials and the counters only from here on
    x = _load_x(x_ptr, k_first, one, BKR, R)
    zero = tl.zeros([BKR, BLOCK_N8], dtype=tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero)  # summed over rows at the end
    for t in range(tiles):
        k_next = k_first + (t + 1) * BLOCK_K
        more = one & (t + 1 < tiles)
        w_next = _load_weights(qw_ptr, qz_ptr, s_ptr, k_next, rj, j_ok, N, N8, more, GROUP, BKR, R, EVEN_N)
        x_next = _load_x(x_ptr, k_next, more, BKR, R)
        c = _f16x2_tile(c, w, x, R, ASM)
        w = w_next
        x = x_next
    _gemv1_epilogue(c, pid_n, pid_k, N, split_k, bias_ptr, out_ptr, part_ptr, cnt_ptr, BLOCK_N8, SPLIT, SPLIT_PAD,
                    RED_CH, EVEN_N, HAS_BIAS)  # fmt: skip


# -- M = 1 over a repacked copy of the weights (awq_repack) ------------------------------------------------------
# The same f16x2 arithmetic and fused split-K reduction as _awq_gemv1_kernel, over a layout built once at load time
# (docs/benchmarks.md session 10: 9-13 % faster on an H200 at the three Llama-3-8B shapes, with PDL):
#
#   wq    int32 [N/128, K/128, 16, 8, 16]: column block b (128 columns), K tile t (128 rows = one group), slice r,
#         row group i, column group j  <-  qweight[128 t + 16 i + r, 16 b + j]
#   meta  int32 [N/128, K/128, 8, 16]: per tile and column group, words 0-3 the zero points as _ZEROS_ASM makes
#         them (f16x2 1024 + z for column pairs 0, 2; -(64 + z) for pairs 1, 3), words 4-7 the scales * 16 as
#         f16x2 pairs (columns 2p, 2p + 1)
#
# A slice [8, 16] is 512 contiguous bytes (one 16-byte load per lane of a warp) and a program's tiles one contiguous
# chunk; a lane's 16 rows of a tile are consecutive, so its inputs come as 8 bf16 / fp16 pairs (one 4-byte load
# each), and zero points and scales as 8 16-byte loads per tile instead of 8 scalar 2-byte scale loads and a zero
# point decode.
REPACK_BLOCK_N8 = 16  # column groups (of 8) per program
REPACK_GROUP = 128  # the layout's K tile: one group

# (x/16, x/16) as f16x2 for the two rows of a bf16x2 ($2) -> $0 (low row), $1 (high row)
_XPAIR_BF16_ASM = tl.constexpr("""
{
.reg .b32 l, h;
shl.b32 l, $2, 16;
and.b32 h, $2, 0xFFFF0000;
mul.f32 l, l, 0f3D800000;
mul.f32 h, h, 0f3D800000;
cvt.rn.f16x2.f32 $0, l, l;
cvt.rn.f16x2.f32 $1, h, h;
}
""")
# the same for an f16x2 ($2): 0x2C00 = 1/16
_XPAIR_F16_ASM = tl.constexpr("""
{
.reg .b16 l, h;
.reg .b32 a, b, c;
mov.b32 c, 0x2C002C00;
mov.b32 {l, h}, $2;
mov.b32 a, {l, l};
mov.b32 b, {h, h};
mul.rn.f16x2 $0, a, c;
mul.rn.f16x2 $1, b, c;
}
""")
# c0..c7 ($8..$15, float32 bits) + float32(a_p) * float32(s_p) for the four f16x2 accumulators a ($16..$19) and
# scale pairs s ($20..$23): column 2p from the low halves, 2p + 1 from the high ones (outputs written last)
_SCALE_ACC_ASM = tl.constexpr(
    """
{
.reg .b16 al, ah, sl, sh;
.reg .f32 fa, fs, o0, o1, o2, o3, o4, o5, o6, o7;
"""
    + "".join(
        f"""mov.b32 {{al, ah}}, ${16 + p};
mov.b32 {{sl, sh}}, ${20 + p};
cvt.f32.f16 fa, al;
cvt.f32.f16 fs, sl;
fma.rn.f32 o{2 * p}, fa, fs, ${8 + 2 * p};
cvt.f32.f16 fa, ah;
cvt.f32.f16 fs, sh;
fma.rn.f32 o{2 * p + 1}, fa, fs, ${9 + 2 * p};
"""
        for p in range(4)
    )
    + "".join(f"mov.b32 ${c}, o{c};\n" for c in range(8))
    + "}\n"
)


@triton.jit
def _f16_bits(v):
    """The f16 in the low 16 bits of an int32, as float32."""
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_pack(v):
    """float32 -> its f16 bits in the low 16 bits of an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _x_pairs(v, X_BF16: tl.constexpr, ASM: tl.constexpr):
    """Two rows of x (a bf16x2 / f16x2 in an int32) -> ((x0/16, x0/16), (x1/16, x1/16)) as f16x2."""
    if ASM:
        if X_BF16:
            return tl.inline_asm_elementwise(_XPAIR_BF16_ASM, "=r,=r,r", [v], dtype=(tl.int32, tl.int32),
                                             is_pure=True, pack=1)  # fmt: skip
        else:
            return tl.inline_asm_elementwise(_XPAIR_F16_ASM, "=r,=r,r", [v], dtype=(tl.int32, tl.int32),
                                             is_pure=True, pack=1)  # fmt: skip
    else:
        if X_BF16:
            lo = (v << 16).to(tl.float32, bitcast=True)
            hi = (v & -65536).to(tl.float32, bitcast=True)
        else:
            lo = _f16_bits(v)
            hi = _f16_bits(v >> 16)
        lo = _f16_pack(lo * 0.0625)
        hi = _f16_pack(hi * 0.0625)
        return lo | (lo << 16), hi | (hi << 16)


@triton.jit
def _twin_half_zc(a, q, x, zc, P: tl.constexpr, SH: tl.constexpr, FIRST: tl.constexpr):
    """_STEP_ASM for one half (SH 0 / 16) of pair P with the zero-point words of the repacked meta (f16 bits)."""
    qn = ((q >> (4 * P + SH)) & 15).to(tl.float32)
    if P % 2 == 0:
        w = (1024.0 + qn) - _f16_bits(zc >> SH)  # (1024 + q) - (1024 + z)
    else:
        w = (64.0 + qn) + _f16_bits(zc >> SH)  # (1024 + 16 q) / 16 - (64 + z)
    r = _f16_bits(x) * w
    if not FIRST:
        r += _f16_bits(a >> SH)
    return _f16_pack(r)


@triton.jit
def _step_zc(a0, a1, a2, a3, q, x, z0, z1, z2, z3, FIRST: tl.constexpr, ASM: tl.constexpr):
    """_step with zero points already in _ZEROS_ASM's form (the repacked meta); the twins decode those."""
    if ASM:
        return _step(a0, a1, a2, a3, q, x, z0, z1, z2, z3, FIRST, True)
    else:
        return (
            _twin_half_zc(a0, q, x, z0, 0, 0, FIRST) | (_twin_half_zc(a0, q, x, z0, 0, 16, FIRST) << 16),
            _twin_half_zc(a1, q, x, z1, 1, 0, FIRST) | (_twin_half_zc(a1, q, x, z1, 1, 16, FIRST) << 16),
            _twin_half_zc(a2, q, x, z2, 2, 0, FIRST) | (_twin_half_zc(a2, q, x, z2, 2, 16, FIRST) << 16),
            _twin_half_zc(a3, q, x, z3, 3, 0, FIRST) | (_twin_half_zc(a3, q, x, z3, 3, 16, FIRST) << 16),
        )


@triton.jit
def _scale_acc(c, a0, a1, a2, a3, s, ASM: tl.constexpr):
    """c (8 float32, column 8j + c in the c-th) + the four f16x2 accumulators times the f16x2 scale pairs s."""
    if ASM:
        return tl.inline_asm_elementwise(
            _SCALE_ACC_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [c[0].to(tl.int32, bitcast=True), c[1].to(tl.int32, bitcast=True), c[2].to(tl.int32, bitcast=True),
             c[3].to(tl.int32, bitcast=True), c[4].to(tl.int32, bitcast=True), c[5].to(tl.int32, bitcast=True),
             c[6].to(tl.int32, bitcast=True), c[7].to(tl.int32, bitcast=True), a0, a1, a2, a3, s[0], s[1], s[2],
             s[3]],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        return (
            c[0] + _f16_bits(a0) * _f16_bits(s[0]),
            c[1] + _f16_bits(a0 >> 16) * _f16_bits(s[0] >> 16),
            c[2] + _f16_bits(a1) * _f16_bits(s[1]),
            c[3] + _f16_bits(a1 >> 16) * _f16_bits(s[1] >> 16),
            c[4] + _f16_bits(a2) * _f16_bits(s[2]),
            c[5] + _f16_bits(a2 >> 16) * _f16_bits(s[2] >> 16),
            c[6] + _f16_bits(a3) * _f16_bits(s[3]),
            c[7] + _f16_bits(a3 >> 16) * _f16_bits(s[3] >> 16),
        )


@triton.jit
def _load_repacked(w_ptr, m_ptr, woff, moff, ok):
    """One tile's weight-side loads: 16 slices [8, 16] and the 8 meta words [1, 16]. `ok` (a [1] mask) masks the
    whole tile; masked-off lanes are left undefined (the tile after a program's last is never used)."""
    p = w_ptr + woff
    q = (tl.load(p, mask=ok), tl.load(p + 128, mask=ok), tl.load(p + 256, mask=ok), tl.load(p + 384, mask=ok),
         tl.load(p + 512, mask=ok), tl.load(p + 640, mask=ok), tl.load(p + 768, mask=ok), tl.load(p + 896, mask=ok),
         tl.load(p + 1024, mask=ok), tl.load(p + 1152, mask=ok), tl.load(p + 1280, mask=ok),
         tl.load(p + 1408, mask=ok), tl.load(p + 1536, mask=ok), tl.load(p + 1664, mask=ok),
         tl.load(p + 1792, mask=ok), tl.load(p + 1920, mask=ok))  # fmt: skip
    m = m_ptr + moff
    z = (tl.load(m, mask=ok), tl.load(m + 16, mask=ok), tl.load(m + 32, mask=ok), tl.load(m + 48, mask=ok))
    s = (tl.load(m + 64, mask=ok), tl.load(m + 80, mask=ok), tl.load(m + 96, mask=ok), tl.load(m + 112, mask=ok))
    return q, z, s


@triton.jit
def _load_x_pairs(x_ptr, xoff, ok):
    """One tile's inputs: 8 row pairs [8, 1] (rows 16 i + 2p, + 1 as one int32)."""
    p = x_ptr + xoff
    return (
        tl.load(p, mask=ok),
        tl.load(p + 1, mask=ok),
        tl.load(p + 2, mask=ok),
        tl.load(p + 3, mask=ok),
        tl.load(p + 4, mask=ok),
        tl.load(p + 5, mask=ok),
        tl.load(p + 6, mask=ok),
        tl.load(p + 7, mask=ok),
    )


@triton.jit
def _x_pair_rows(xp, X_BF16: tl.constexpr, ASM: tl.constexpr):
    """A tile's 8 input row pairs -> its 16 rows as f16x2 (x/16, x/16)."""
    x0, x1 = _x_pairs(xp[0], X_BF16, ASM)
    x2, x3 = _x_pairs(xp[1], X_BF16, ASM)
    x4, x5 = _x_pairs(xp[2], X_BF16, ASM)
    x6, x7 = _x_pairs(xp[3], X_BF16, ASM)
    x8, x9 = _x_pairs(xp[4], X_BF16, ASM)
    x10, x11 = _x_pairs(xp[5], X_BF16, ASM)
    x12, x13 = _x_pairs(xp[6], X_BF16, ASM)
    x14, x15 = _x_pairs(xp[7], X_BF16, ASM)
    return (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)


@triton.jit
def _repacked_tile(c, w, xp, X_BF16: tl.constexpr, ASM: tl.constexpr):
    q, z, s = w
    x = _x_pair_rows(xp, X_BF16, ASM)
    a0, a1, a2, a3 = _step_zc(q[0], q[0], q[0], q[0], q[0], x[0], z[0], z[1], z[2], z[3], True, ASM)
    for r in tl.static_range(1, 16):
        a0, a1, a2, a3 = _step_zc(a0, a1, a2, a3, q[r], x[r], z[0], z[1], z[2], z[3], False, ASM)
    return _scale_acc(c, a0, a1, a2, a3, s, ASM)


@triton.jit
def _step2_zc(a, b, q, x, y, z, FIRST: tl.constexpr, ASM: tl.constexpr):
    """_step_zc for two rows (inputs x and y, accumulators a and b: 4-tuples), unpacking q once."""
    if ASM:
        if FIRST:
            r = tl.inline_asm_elementwise(_FIRST_STEP2_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r",
                                          [q, x, y, z[0], z[1], z[2], z[3]], dtype=_I32X8, is_pure=True,
                                          pack=1)  # fmt: skip
        else:
            r = tl.inline_asm_elementwise(
                _STEP2_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], q, x, y, z[0], z[1], z[2], z[3]],
                dtype=_I32X8, is_pure=True, pack=1,
            )  # fmt: skip
        return (r[0], r[1], r[2], r[3]), (r[4], r[5], r[6], r[7])
    else:
        a = _step_zc(a[0], a[1], a[2], a[3], q, x, z[0], z[1], z[2], z[3], FIRST, False)
        b = _step_zc(b[0], b[1], b[2], b[3], q, y, z[0], z[1], z[2], z[3], FIRST, False)
        return a, b


@triton.jit
def _repacked_tile2(c, d, w, xp, yp, X_BF16: tl.constexpr, ASM: tl.constexpr):
    """_repacked_tile for two input rows (x pairs xp, yp; float32 accumulators c, d) over one load of the tile."""
    q, z, s = w
    x = _x_pair_rows(xp, X_BF16, ASM)
    y = _x_pair_rows(yp, X_BF16, ASM)
    a, b = _step2_zc(z, z, q[0], x[0], y[0], z, True, ASM)
    for r in tl.static_range(1, 16):
        a, b = _step2_zc(a, b, q[r], x[r], y[r], z, False, ASM)
    return _scale_acc(c, a[0], a[1], a[2], a[3], s, ASM), _scale_acc(d, b[0], b[1], b[2], b[3], s, ASM)


@triton.jit
def _repacked_epilogue(c, pid_n, pid_k, row, N, split_k, bias_ptr, out_ptr, part_ptr, cnt_ptr, SPLIT: tl.constexpr,
                       SPLIT_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_OUT: tl.constexpr):  # fmt: skip
    """Row `row`'s end of _awq_gemv1_repacked_kernel: _gemv1_epilogue, or _silu_mul_epilogue (out rows N / 2 wide)."""
    part_ptr = part_ptr + row * split_k * N
    cnt_ptr = cnt_ptr + row * (N // 128)
    if SILU_OUT:
        _silu_mul_epilogue(c, pid_n, pid_k, N, split_k, bias_ptr, out_ptr + row * (N // 2), part_ptr, cnt_ptr,
                           SPLIT_PAD, 8, HAS_BIAS)  # fmt: skip
    else:
        _gemv1_epilogue(c, pid_n, pid_k, N, split_k, bias_ptr, out_ptr + row * N, part_ptr, cnt_ptr, 16, SPLIT,
                        SPLIT_PAD, 8, True, HAS_BIAS)  # fmt: skip


@triton.jit
def _awq_gemv1_repacked_kernel(
    x_ptr, wq_ptr, meta_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, M, N, KT, split_k, tiles, stride_xm,
    SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, X_BF16: tl.constexpr,
    ROWS: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr, SILU_OUT: tl.constexpr = False,
):  # fmt: skip
    """x [M, K] (row pairs as int32s, stride_xm of them per row) -> out [M, N] over awq_repack's layout. Program
    (pid_m, pid_n, pid_k): row pid_m, column block pid_n, the `tiles` K tiles from pid_k * tiles, one warp, in a
    runtime loop with tile t + 1's loads issued before tile t's arithmetic; the first tile's weights before the PDL
    wait. Split K as _awq_gemv1_kernel (float32 partials [M, SPLIT_K, N], one counter per row and column block, the
    last program sums them in a fixed order and resets the counter). Rows are the fastest grid axis, so the M
    programs of a tile run together and all but the first find its weights in L2 (M > 1: small decode batches).
    ROWS = 2: each program takes rows 2 pid_m and 2 pid_m + 1 (if < M) and unpacks each weight once for both.
    SILU_OUT: the N outputs are [gate | up] and out [M, N / 2] gets silu(gate) * up (_silu_mul_epilogue; partials
    even without a K split)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    t0 = pid_k * tiles
    iv = tl.arange(0, 8)[:, None]
    jv = tl.arange(0, 16)[None, :]
    w_ptr = wq_ptr + (pid_n * KT + t0) * 2048
    m_ptr = meta_ptr + (pid_n * KT + t0) * 128
    row = pid_m * ROWS
    x_ptr = x_ptr + row * stride_xm + t0 * 64
    woff = iv * 16 + jv  # [8, 16]
    moff = jv  # [1, 16]
    xoff = iv * 8  # [8, 1]
    one = tl.full([1], 1, tl.int1)  # tile masks as [1] tensors (the interpreter takes no Python bool as a mask)
    w = _load_repacked(w_ptr, m_ptr, woff, moff, one)
    pdl.gdc_sync(USE_PDL)  # x, the partials and the counters only from here on
    xp = _load_x_pairs(x_ptr, xoff, one)
    zero = tl.zeros([8, 16], dtype=tl.float32)
    c = (zero, zero, zero, zero, zero, zero, zero, zero)  # summed over rows at the end
    d = c  # ROWS = 2: the second row's accumulators and input pairs
    y_ptr = x_ptr + stride_xm
    second = one & (row + 1 < M)
    if ROWS == 2:
        yp = _load_x_pairs(y_ptr, xoff, second)
    for t in range(tiles):
        tn = t + 1
        more = one & (t + 1 < tiles)
        w_next = _load_repacked(w_ptr + tn * 2048, m_ptr + tn * 128, woff, moff, more)
        xp_next = _load_x_pairs(x_ptr + tn * 64, xoff, more)
        if ROWS == 1:
            c = _repacked_tile(c, w, xp, X_BF16, ASM)
        else:
            yp_next = _load_x_pairs(y_ptr + tn * 64, xoff, more & second)
            c, d = _repacked_tile2(c, d, w, xp, yp, X_BF16, ASM)
            yp = yp_next
        w = w_next
        xp = xp_next
    if ROWS == 2 and row + 1 < M:
        _repacked_epilogue(d, pid_n, pid_k, row + 1, N, split_k, bias_ptr, out_ptr, part_ptr, cnt_ptr, SPLIT,
                           SPLIT_PAD, HAS_BIAS, SILU_OUT)  # fmt: skip
    _repacked_epilogue(c, pid_n, pid_k, row, N, split_k, bias_ptr, out_ptr, part_ptr, cnt_ptr, SPLIT, SPLIT_PAD,
                       HAS_BIAS, SILU_OUT)  # fmt: skip


# Triton's interpreter (TRITON_INTERPRET=1, the tests on CPU) runs the tl twins of the asm helpers
_INTERPRETED = isinstance(_awq_gemv1_kernel, InterpretedFunction)


# -- launchers --------------------------------------------------------------------------------------------------


@functools.cache
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


def _tiles_per_program(k_tiles: int, n_blocks: int) -> int:
    """The M = 1 kernels' K tiles per program: the most of 4, 2 that divides K's tiles and leaves at least
    GEMV1_MIN_PROGRAMS programs, else 1."""
    fits = [t for t in (4, 2) if k_tiles % t == 0 and n_blocks * k_tiles // t >= GEMV1_MIN_PROGRAMS]
    return fits[0] if fits else 1


def _gemv1_config(k: int, n: int, group_size: int, overrides: dict | None = None) -> dict:
    """GEMV1_CONFIG (+ overrides) resolved for one shape: BLOCK_K inside a group, R rows per asm call at most
    BLOCK_K, TILES K tiles per program where they divide K's tiles (else 1; TILES None: the most of 4, 2, 1 that
    leaves GEMV1_MIN_PROGRAMS programs), and the SPLIT_K that follows."""
    cfg = {**GEMV1_CONFIG, **(overrides or {})}
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], group_size)
    cfg["R"] = min(cfg["R"], cfg["BLOCK_K"])
    k_tiles = k // cfg["BLOCK_K"]
    if cfg["TILES"] is None:
        cfg["TILES"] = _tiles_per_program(k_tiles, -(-n // cfg["BLOCK_N"]))
    if k_tiles % cfg["TILES"]:
        cfg["TILES"] = 1
    cfg["SPLIT_K"] = k_tiles // cfg["TILES"]
    return cfg


def gemv_config(m: int, n: int, k: int, group_size: int, device_index: int | None = None,
                dtype: torch.dtype = torch.bfloat16) -> dict:  # fmt: skip
    """The launch configuration of awq_gemv. M = 1 in fp16 / bf16: the f16x2 kernel (GEMV1_CONFIG resolved, see
    _gemv1_config). Otherwise (M > 1, or float32 activations, which f16 arithmetic would round): the tl.dot
    kernel, BLOCK_N / BLOCK_K / SPLIT_K / warps / stages, K split until there are two programs per SM."""
    if m == 1 and dtype in F16X2_DTYPES:
        return _gemv1_config(k, n, group_size)
    cfg = dict(BLOCK_N=128 if n >= 2048 else 64, BLOCK_K=min(64, group_size), num_warps=4, num_stages=3)
    tiles_n = triton.cdiv(n, cfg["BLOCK_N"])
    num_tiles_k = k // cfg["BLOCK_K"]
    split_k = 1
    while tiles_n * split_k < 2 * _num_sms(device_index) and split_k * 2 <= min(num_tiles_k, 32):
        split_k *= 2
    cfg["SPLIT_K"] = split_k
    return cfg


_COUNTERS: dict[tuple, torch.Tensor] = {}


def gemv_counters(n: int, device) -> torch.Tensor:
    """Zeroed int32 counters for the M = 1 kernel's fused split-K reduction of an [.., n] output: one per column
    block at any BLOCK_N (n / 8 of them). Each launch leaves them at zero again, so one set serves every launch
    that cannot overlap with another user of it: an AWQ layer keeps its own; awq_gemv without `counters` shares
    one per (device, n). Not during CUDA graph capture (the graph's memory pool would hold them)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("AWQ M = 1 GEMV: run it once before CUDA graph capture (a warm-up), or pass `counters`")
    return torch.zeros(max(1, n // 8), dtype=torch.int32, device=device)


def _shared_counters(n: int, device: torch.device) -> torch.Tensor:
    key = (device.type, device.index, n)
    if key not in _COUNTERS:
        _COUNTERS[key] = gemv_counters(n, device)
    return _COUNTERS[key]


def _awq_gemv1(x, qweight, qzeros, scales, group_size: int, bias, config: dict | None, counters) -> torch.Tensor:
    k, n8 = qweight.shape
    n = n8 * 8
    cfg = _gemv1_config(k, n, group_size, config)
    block_n, block_k, r, split_k = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["R"], cfg["SPLIT_K"]
    assert group_size % block_k == 0 and block_k % r == 0 and r in (1, 2, 4, 8, 16) and block_n % 8 == 0
    assert k * n8 < 2**31, "int32 offsets"
    n_blocks = triton.cdiv(n, block_n)
    if counters is None:
        counters = _shared_counters(n, x.device)
    assert counters.dtype == torch.int32 and counters.numel() >= n_blocks
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    partials = torch.empty(split_k, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    split_pad = triton.next_power_of_2(split_k)
    red_ch = max(1, min(split_pad, 1024 * cfg["num_warps"] // block_n))  # <= 32 partials per thread at a time
    _awq_gemv1_kernel[(n_blocks, split_k)](
        x, qweight, qzeros, scales, bias if bias is not None else scales, out, partials, counters, n, n8, split_k,
        cfg["TILES"], GROUP=group_size, BLOCK_N8=block_n // 8, BLOCK_K=block_k, R=r, SPLIT=split_k > 1,
        SPLIT_PAD=split_pad, RED_CH=red_ch, EVEN_N=n % block_n == 0,
        HAS_BIAS=bias is not None, ASM=not _INTERPRETED, USE_PDL=pdl.ENABLED, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl.launch_kwargs(),
    )  # fmt: skip
    return out


def awq_gemv(x, qweight, qzeros, scales, group_size: int, bias=None, config: dict | None = None,
             counters: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [M <= 16, in] -> [M, out] in x's dtype. `config` overrides gemv_config (tuning, tests). `counters`
    (gemv_counters) for M = 1: the call site's own; default one shared per (device, out)."""
    _check(x, qweight, qzeros, scales, group_size)
    m, k = x.shape
    n = scales.shape[1]
    assert m <= GEMV_MAX_M
    if m == 1 and x.dtype in F16X2_DTYPES:
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
    cfg = {**DEQUANT_CONFIG, **(config or {})}
    block_k, block_n = min(group_size, cfg["BLOCK_K"]), cfg["BLOCK_N"]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _awq_dequant_kernel[(k // block_k, triton.cdiv(n, block_n))](
        qweight, qzeros, scales, out, n, GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


class RepackedAWQ(NamedTuple):
    """awq_repack's copy of one layer's weights (layout above _awq_gemv1_repacked_kernel)."""

    wq: torch.Tensor  # int32 [N/128 * K/128 * 2048]
    meta: torch.Tensor  # int32 [N/128 * K/128 * 128]
    in_features: int
    out_features: int


def awq_repack(qweight, qzeros, scales, group_size: int) -> RepackedAWQ | None:
    """AutoAWQ gemm tensors -> the M = 1 kernel's layout (once, at load time); None where it does not apply (group
    size other than 128, output size not a multiple of 128: those keep awq_gemv's kernel)."""
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


def _repacked_tiles_m1(k_tiles: int, n_blocks: int, sms: int) -> int:
    """K tiles per program of the one-row repacked kernel: the fewest of 1, 2, 4, 8, 16 (dividing K's tiles) whose
    programs fit one wave, REPACKED_GEMV1_PER_SM one-warp programs per SM (the kernel's 254 registers allow 8);
    else the most of them that divides. H200, graphs with PDL (docs/benchmarks.md, session 14): the fastest of 1 / 2
    / 4 / 8 tiles at each of the five Llama-3-8B layer shapes was the one this picks (896-1024 programs)."""
    fits = [t for t in (1, 2, 4, 8, 16) if k_tiles % t == 0]
    wave = REPACKED_GEMV1_PER_SM * sms
    return next((t for t in fits if n_blocks * k_tiles // t <= wave), fits[-1])


def awq_gemv_repacked(x, packed: RepackedAWQ, bias=None, counters=None, tiles: int | None = None,
                      rows: int | None = None, silu_mul_out: bool = False) -> torch.Tensor:  # fmt: skip
    """x [M <= 16, in] (fp16 / bf16) -> [M, out] over awq_repack's copy (one program per `rows` rows (1 or 2;
    default REPACKED_GEMV1_ROWS for M > 1), column block and K split). `tiles`: K tiles per program (default: M = 1
    _repacked_tiles_m1, else _tiles_per_program as for awq_gemv); `counters`: gemv_counters (default one set shared
    per (device, out)).
    silu_mul_out: the outputs are [gate | up] (out / 2 a multiple of 128) and the result is silu(gate) * up
    [M, out / 2], bit-identical to aserve/kernels/fused.py's silu_and_mul of this GEMV's output at the same K split (an
    MLP's activation in the gate/up projection's last programs: one kernel less per layer)."""
    k, n = packed.in_features, packed.out_features
    m = x.shape[0]
    assert x.shape[1] == k and m <= GEMV_MAX_M and x.stride(-1) == 1 and x.dtype in F16X2_DTYPES
    assert not silu_mul_out or n % 256 == 0
    kt, nb = k // REPACK_GROUP, n // (8 * REPACK_BLOCK_N8)
    if tiles is None:
        tiles = _tiles_per_program(kt, nb) if m > 1 else _repacked_tiles_m1(kt, nb, _num_sms(x.device.index))
    assert kt % tiles == 0
    split_k = kt // tiles
    if counters is None:
        counters = _shared_counters(n, x.device)
    assert counters.dtype == torch.int32 and counters.numel() >= m * nb
    out = torch.empty(m, n // 2 if silu_mul_out else n, dtype=x.dtype, device=x.device)
    partials = torch.empty(m, split_k, n, dtype=torch.float32, device=x.device) if split_k > 1 or silu_mul_out else out
    x32 = x.view(torch.int32)  # row pairs
    rows = 1 if m == 1 else rows or REPACKED_GEMV1_ROWS
    assert rows in (1, 2)
    _awq_gemv1_repacked_kernel[(triton.cdiv(m, rows), nb, split_k)](
        x32, packed.wq, packed.meta, bias if bias is not None else out, out, partials, counters, m, n, kt, split_k,
        tiles, x32.stride(0), SPLIT=split_k > 1, SPLIT_PAD=max(8, triton.next_power_of_2(split_k)),
        HAS_BIAS=bias is not None, X_BF16=x.dtype == torch.bfloat16, ROWS=rows, ASM=not _INTERPRETED,
        USE_PDL=pdl.ENABLED, SILU_OUT=silu_mul_out, num_warps=1, num_stages=1, **pdl.launch_kwargs(),
    )  # fmt: skip
    return out


# -- M > 1 over the repacked copy: tl.dot GEMV (M <= 16) and the dequantise kernel (M > 16) ---------------------
# With these, a layer that awq_repack fits needs no AutoAWQ tensors on the GPU: repacking drops them, so the
# int4 weights are held once. Both decode awq_repack's meta back to (z, s) per column and unpack nibbles with the
# float32 mantissa trick of _diff (exact: (q - z) * 16**e, then times s * 16**-e), so the weights they produce are
# bit-identical to the AutoAWQ kernels' (and the reference's). K row 16 i + r of a tile sits at layout position
# 8 r + i; the kernels gather rows in K order (_repacked_rows), so x loads and W stores stay contiguous.


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
    positions in order instead (rows scattered) made the M <= 16 GEMV ~35 % slower on an H200 (docs/benchmarks.md,
    session 11)."""
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


# Launch configurations (H200, bench/awq_bench.py; awq_bench may override them)
# Up to REPACKED_GEMV1_MAX_M rows (fp16 / bf16) the f16x2 kernel, REPACKED_GEMV1_ROWS rows per program (2: each
# weight unpacked once for both); more rows: tl.dot. H200, CUDA graphs (docs/benchmarks.md, session 11 run 8): two
# rows per program beat one at M = 4 (9.9 / 26.1 / 26.0 vs 11.7 / 32.2 / 32.2 us), both beat tl.dot up to M = 6.
REPACKED_GEMV1_MAX_M = 6
REPACKED_GEMV1_ROWS = 2
REPACKED_GEMV1_PER_SM = 8  # one-row programs per SM in one wave (_repacked_tiles_m1)
# tl.dot kernel: bench section tune_repacked, session 13 (209.8 us summed over M 4 + 16 and the three shapes; the
# best without SWAP 215.1 us, the previous default BP 64 / 4 warps / 3 stages without SWAP > 238.3 us)
REPACKED_DOT_CONFIG = dict(BP=64, num_warps=4, num_stages=1, SWAP=True)
REPACKED_DEQUANT_CONFIG = dict(BP=64, num_warps=4)


def awq_gemv_repacked_dot(x, packed: RepackedAWQ, bias=None, config: dict | None = None) -> torch.Tensor:
    """x [M <= 16, in] -> [M, out] in x's dtype over awq_repack's copy (the tl.dot kernel: M > 1, or float32). K
    split until there are two programs per SM (at most 32 ways)."""
    m, k = x.shape
    n = packed.out_features
    assert k == packed.in_features and x.stride(-1) == 1 and m <= GEMV_MAX_M
    cfg = {**REPACKED_DOT_CONFIG, **(config or {})}
    kt, nb = k // REPACK_GROUP, n // (8 * REPACK_BLOCK_N8)
    split_k = cfg.get("SPLIT_K")
    if split_k is None:
        split_k = 1
        while nb * split_k < 2 * _num_sms(x.device.index) and split_k * 2 <= min(kt, 32):
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
    cfg = {**REPACKED_DEQUANT_CONFIG, **(config or {})}
    out = torch.empty(k, n, dtype=dtype, device=packed.wq.device)
    _awq_dequant_repacked_kernel[(n // 128, k // 128, 128 // cfg["BP"])](
        packed.wq, packed.meta, out, n, k // 128, BP=cfg["BP"], num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def awq_linear(x, qweight, qzeros, scales, group_size: int, bias=None, counters=None,
               packed: RepackedAWQ | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, in] -> [M, out]: the kernel for M (see the module docstring); `counters`: awq_gemv's; `packed`
    (awq_repack's copy of the same weights): every M runs over it, so qweight / qzeros / scales are not read then
    (after AWQLinearMethod.repack they are empty)."""
    m = x.shape[0]
    if packed is not None:
        if m <= REPACKED_GEMV1_MAX_M and x.dtype in F16X2_DTYPES:
            return awq_gemv_repacked(x, packed, bias, counters)
        if m <= GEMV_MAX_M:
            return awq_gemv_repacked_dot(x, packed, bias)
        w = awq_dequantize_repacked(packed, x.dtype)
    elif m <= GEMV_MAX_M:
        return awq_gemv(x, qweight, qzeros, scales, group_size, bias, counters=counters)
    else:
        w = awq_dequantize(qweight, qzeros, scales, group_size, x.dtype)
    return torch.addmm(bias.to(x.dtype), x, w) if bias is not None else x @ w
