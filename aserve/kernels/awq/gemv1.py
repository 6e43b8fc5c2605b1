"""The M = 1 AWQ GEMV over AutoAWQ's tensors, x [1, K] (fp16 / bf16) -> out [1, N]: packed f16x2 arithmetic
(aserve/kernels/awq/f16x2.py) and the fused split-K reduction (aserve/kernels/awq/split_k.py) in one launch.

One warp per program, BLOCK_N 128 columns, `tiles` K tiles of BLOCK_K rows (_tiles_per_program) walked in a runtime
loop that issues the next tile's loads before this tile's arithmetic. PDL (aserve/kernels/pdl.py): every program
waits for the previous kernel (gdc_sync) before it touches x, the partials or the counters (launches that share
counters must not overlap; in one stream they do not, PDL included). Its first tile's weights, zeros and scales are
loaded before that wait (nothing in a decode step writes them), so their DRAM latency overlaps the previous kernel's
tail. Layers that awq_repack fits run gemv1_repacked.py's kernel instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.awq import tuning
from aserve.kernels.awq.f16x2 import _INTERPRETED, _finish, _step, _zero_consts
from aserve.kernels.awq.split_k import _gemv1_epilogue, _shared_counters


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


def _tiles_per_program(k_tiles: int, n_blocks: int) -> int:
    """The M = 1 kernels' K tiles per program: the most of 4, 2 that divides K's tiles and leaves at least
    GEMV1_MIN_PROGRAMS programs, else 1."""
    fits = [t for t in (4, 2) if k_tiles % t == 0 and n_blocks * k_tiles // t >= tuning.GEMV1_MIN_PROGRAMS]
    return fits[0] if fits else 1


def _gemv1_config(k: int, n: int, group_size: int, overrides: dict | None = None) -> dict:
    """tuning.GEMV1_CONFIG (+ overrides) resolved for one shape: BLOCK_K inside a group, R rows per asm call at most
    BLOCK_K, TILES K tiles per program where they divide K's tiles (else 1; TILES None: the most of 4, 2, 1 that
    leaves GEMV1_MIN_PROGRAMS programs), and the SPLIT_K that follows."""
    cfg = {**tuning.GEMV1_CONFIG, **(overrides or {})}
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], group_size)
    cfg["R"] = min(cfg["R"], cfg["BLOCK_K"])
    k_tiles = k // cfg["BLOCK_K"]
    if cfg["TILES"] is None:
        cfg["TILES"] = _tiles_per_program(k_tiles, -(-n // cfg["BLOCK_N"]))
    if k_tiles % cfg["TILES"]:
        cfg["TILES"] = 1
    cfg["SPLIT_K"] = k_tiles // cfg["TILES"]
    return cfg


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
