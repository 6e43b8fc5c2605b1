"""The f16x2 GEMV over awq_repack's copy (aserve/kernels/awq/repack.py has the layout), x [M, K] (fp16 / bf16, M up
to tuning.REPACKED_GEMV1_MAX_M) -> out [M, N]: gemv1.py's arithmetic and fused split-K reduction, with the zero
points and scales read in the form the asm uses and the inputs as row pairs. Programs over one tile run together (rows
are the fastest grid axis), so all but the first find its weights in L2; with two rows per program
(tuning.REPACKED_GEMV1_ROWS) each weight is unpacked once for both. One-row launches take the fewest K tiles per
program whose programs fit one wave (_repacked_tiles_m1). With silu_mul_out an MLP's gate/up projection applies
SiLU·mul in its last programs (split_k.py's _silu_mul_epilogue).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.awq import tuning
from aserve.kernels.awq.f16x2 import _FIRST_STEP2_ASM, _I32X8, _INTERPRETED, _STEP2_ASM, _f16_bits, _f16_pack, _step
from aserve.kernels.awq.gemv1 import _tiles_per_program
from aserve.kernels.awq.repack import REPACK_BLOCK_N8, REPACK_GROUP, RepackedAWQ
from aserve.kernels.awq.split_k import _gemv1_epilogue, _shared_counters, _silu_mul_epilogue

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
    wait. Split K as gemv1.py's _awq_gemv1_kernel (float32 partials [M, SPLIT_K, N], one counter per row and column
    block, the last program sums them in a fixed order and resets the counter). Rows are the fastest grid axis, so
    the M programs of a tile run together and all but the first find its weights in L2 (M > 1: small decode
    batches). ROWS = 2: each program takes rows 2 pid_m and 2 pid_m + 1 (if < M) and unpacks each weight once for
    both. SILU_OUT: the N outputs are [gate | up] and out [M, N / 2] gets silu(gate) * up (_silu_mul_epilogue;
    partials even without a K split)."""
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


def _repacked_tiles_m1(k_tiles: int, n_blocks: int, sms: int) -> int:
    """K tiles per program of the one-row repacked kernel: the fewest of 1, 2, 4, 8, 16 (dividing K's tiles) whose
    programs fit one wave, REPACKED_GEMV1_PER_SM one-warp programs per SM (the kernel's 254 registers allow 8);
    else the most of them that divides. H200, graphs with PDL (docs/benchmarks.md, "AWQ kernel speed"): the fastest of
    1 / 2 / 4 / 8 tiles at each of the five Llama-3-8B layer shapes is the one this picks (896-1024 programs)."""
    fits = [t for t in (1, 2, 4, 8, 16) if k_tiles % t == 0]
    wave = tuning.REPACKED_GEMV1_PER_SM * sms
    return next((t for t in fits if n_blocks * k_tiles // t <= wave), fits[-1])


def awq_gemv_repacked(x, packed: RepackedAWQ, bias=None, counters=None, tiles: int | None = None,
                      rows: int | None = None, silu_mul_out: bool = False) -> torch.Tensor:  # fmt: skip
    """x [M <= 16, in] (fp16 / bf16) -> [M, out] over awq_repack's copy (one program per `rows` rows (1 or 2;
    default tuning.REPACKED_GEMV1_ROWS for M > 1), column block and K split). `tiles`: K tiles per program (default:
    M = 1 _repacked_tiles_m1, else _tiles_per_program as for awq_gemv); `counters`: gemv_counters (default one set
    shared per (device, out)).
    silu_mul_out: the outputs are [gate | up] (out / 2 a multiple of 128) and the result is silu(gate) * up
    [M, out / 2], bit-identical to aserve/kernels/fused.py's silu_and_mul of this GEMV's output at the same K split (an
    MLP's activation in the gate/up projection's last programs: one kernel less per layer)."""
    k, n = packed.in_features, packed.out_features
    m = x.shape[0]
    assert x.shape[1] == k and m <= tuning.GEMV_MAX_M and x.stride(-1) == 1 and x.dtype in tuning.F16X2_DTYPES
    assert not silu_mul_out or n % 256 == 0
    kt, nb = k // REPACK_GROUP, n // (8 * REPACK_BLOCK_N8)
    if tiles is None:
        tiles = _tiles_per_program(kt, nb) if m > 1 else _repacked_tiles_m1(kt, nb, tuning._num_sms(x.device.index))
    assert kt % tiles == 0
    split_k = kt // tiles
    if counters is None:
        counters = _shared_counters(n, x.device)
    assert counters.dtype == torch.int32 and counters.numel() >= m * nb
    out = torch.empty(m, n // 2 if silu_mul_out else n, dtype=x.dtype, device=x.device)
    partials = torch.empty(m, split_k, n, dtype=torch.float32, device=x.device) if split_k > 1 or silu_mul_out else out
    x32 = x.view(torch.int32)  # row pairs
    rows = 1 if m == 1 else rows or tuning.REPACKED_GEMV1_ROWS
    assert rows in (1, 2)
    _awq_gemv1_repacked_kernel[(triton.cdiv(m, rows), nb, split_k)](
        x32, packed.wq, packed.meta, bias if bias is not None else out, out, partials, counters, m, n, kt, split_k,
        tiles, x32.stride(0), SPLIT=split_k > 1, SPLIT_PAD=max(8, triton.next_power_of_2(split_k)),
        HAS_BIAS=bias is not None, X_BF16=x.dtype == torch.bfloat16, ROWS=rows, ASM=not _INTERPRETED,
        USE_PDL=pdl.ENABLED, SILU_OUT=silu_mul_out, num_warps=1, num_stages=1, **pdl.launch_kwargs(),
    )  # fmt: skip
    return out
