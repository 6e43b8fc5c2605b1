"""Batch-invariant matmul (deterministic mode's GPU linear layers): y [M, N] = x [M, K] W^T (+ bias), W [N, K]
row-major as nn.Linear keeps it, each output element summed in one order that does not depend on M.

cuBLAS picks its kernel (tile shape, split-K, stream-K) by the problem's shape, M included, and the Triton GEMV runs
one-row inputs; each sums a row's products in another order, so a request's logits changed with the batch around it.

An output element's order of summation is fixed by BLOCK_K (64) and SPLIT_K, the number of consecutive K ranges of
K_SPLIT columns (a multiple of BLOCK_K), both from the weight's shape and dtype alone (`config_for`): each range is
summed by tl.dot in BLOCK_K steps into a float32 accumulator that starts at zero; the ranges' sums are then added in
range order to a float32 total that starts at zero; the bias is added to the total, which is rounded to x's dtype
once. Two configurations:

    flat (DEFAULT, 16-bit weights)   SPLIT_K 1: one accumulator and one loop over K ("flat_split": 2 for the
                 few weights that flat_split names, computed as below). The tile (BLOCK_M x BLOCK_N,
                 warps, stages) is chosen by M from flat_row_tiles (made per N): 16 x 16 tiles for a few rows, so
                 that enough programs stream the weight without split-K, one wave of deep-pipelined programs for
                 hundreds, up to 128 x 256 for thousands. That holds the order only where
                 tl.dot's sum of a row's K step does not depend on the tile around it (true of the H200's MMAs at
                 every tile here, measured bit for bit by bench/batch_invariant_matmul.py), so the engine uses it
                 for a weight only once `checked_config` has shown it on the device, else the split configuration
    split (float32, and the fallback)   one BLOCK_M 64 tile for every M and SPLIT_K ranges, computed in one of two
                 ways chosen by M (which changes the speed, not the bits):

    in-program   one program per output tile walks the ranges one after the other, a loop per range (the only
                 way when SPLIT_K = 1); for many rows, whose tiles alone fill the GPU. (One loop over K adding each
                 range's sum at its end gives the same bits and ran up to 5 % slower from 256 rows on the H200.)
    across       SPLIT_K programs per output tile, one per range, write float32 partial sums [SPLIT_K, M, N];
                 _combine_kernel adds them in range order (no atomics); for few rows, where the tiles alone would
                 leave most of the GPU idle while the weight streams (batch-1 decode)

K is masked in every step only where it is not a multiple of BLOCK_K (K_MASK). Rows past M are loaded as zeros and
not stored; programs are ordered in groups of GROUP_M row blocks for L2 reuse (which changes nothing in any sum).

CANDIDATES are the configurations bench/batch_invariant_matmul.py compares (DEFAULT is config_for's): "old" is the
single-tile kernel without split-K; ROW_TILES entries (min_rows, BLOCK_M, num_warps[, BLOCK_N, num_stages]) change
the tile with M. Reference: torch.nn.functional.linear.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl

logger = logging.getLogger("aserve")

# Programs that keep an H200 (132 SMs, two tiles of the split configurations resident on each) streaming the weight:
# SPLIT_K is the smallest power of two giving the [N / BLOCK_N] column blocks this many programs at one row block.
TARGET_PROGRAMS = 256
MIN_K_SPLIT = 512  # columns of K per range, at least
MAX_SPLIT_K = 16
ACROSS_MAX_ROWS = 64  # "across" only for batches of up to this many rows (use_across)
ACROSS_MAX_TILES_FRACTION = 0.5  # ... and at most this fraction of PROGRAMS output tiles
COMBINE_BLOCK = 1024
# The flat configuration's tiles by M, (min_rows, BLOCK_M, num_warps, BLOCK_N, num_stages): up to 64 rows
# FLAT_FEW_TILES, narrow column tiles so that enough programs stream the weight without split-K; from
# FLAT_MANY_ROWS, FLAT_MANY_TILE; in between, by N as well (flat_row_tiles: the weight's, so still not by M alone):
# the first of FLAT_MID_TILES giving at least FLAT_MIN_PROGRAMS output tiles, 128 x 128 for 128 x 256 past one wave
# (as many programs as the GPU has SMs), 8 warps from 128 x 128, and as many stages as fit (at most 6) within one
# wave, 3 past it (two programs resident on an SM); every tile's stages at most what the GPU's shared memory holds
# (device_limits). (H200, 2026-12-04, a sweep of BLOCK_M 32-128 x BLOCK_N 32-256, 4 / 8 warps and 3-6 stages over
# Llama-3-8B's four linears at 96-384 rows: at 128 rows the four 1.13x cuBLAS's time with the tile best for each,
# 1.45x with one 64 x 128 tile whose BLOCK_N halved towards 132 programs; one wave of fewer, deeper programs won for
# qkv / o / down, 128 x 256 or two waves of 128 x 128 for gate_up.)
# More than 6 stages only while the programs fit two per SM (a row of gate_up, 896 programs: 59 us at 6, 68 at 8;
# qkv / o / down's 128-192 programs gain from 8).
# Up to 16 rows one warp a 16 x 16 tile: twice the programs of 16 x 32 tiles, which the narrow weights need (H200,
# 2026-12-05, a sweep of BLOCK_N 16-64, 1-4 warps, 4-12 stages at 1-16 rows: Qwen3-30B-A3B's qkv + o + router 24.1 us
# at one row against 27.1, Llama-3-8B's o 11.8 against 12.5, its qkv unchanged; the same bits at every tile).
DEEP_STAGES_MAX_PROGRAMS = 264
# A weight whose 16 x 16 few-row tiles give fewer programs than the GPU has SMs (Qwen3-30B-A3B's o, [2048, 4096]: 128
# on the H200's 132) may wait, at a few rows, on each program's chain of K / 16 dependent MMAs rather than on memory.
# The "flat_split" candidate sums such a weight of at least this many columns in two K ranges (SPLIT_K 2, at every M),
# each range by one program up to ACROSS_MAX_ROWS rows ("across"): chains half as long and twice as many, for one
# more launch (the combine) and, from 65 rows, two accumulators a program (tiles of at most 128 x 128).
FLAT_SPLIT_MIN_K = 4096
FLAT_FEW_TILES = ((1, 16, 1, 16, 8), (17, 32, 4, 32, 8), (33, 64, 4, 32, 6))
FLAT_MID_TILES = ((128, 256), (128, 128), (128, 64), (64, 64))
FLAT_MID_ROWS = 65
FLAT_MIN_PROGRAMS = 96
FLAT_MANY_ROWS = 1024
FLAT_MANY_TILE = (FLAT_MANY_ROWS, 128, 8, 256, 3)
H200_LIMITS = (132, 227 * 1024)  # SMs, shared memory one program may use (bytes)


@functools.cache
def device_limits() -> tuple[int, int]:
    """(SMs, shared memory one program may use) of the current CUDA device; the H200's without one (Triton's
    interpreter in tests)."""
    if not torch.cuda.is_available():
        return H200_LIMITS
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    smem = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
    return props.multi_processor_count, smem or H200_LIMITS[1]


def _fitting(block_m: int, block_n: int, stages: int, smem: int) -> int:
    """At most `stages` (at least 1) K steps of 16-bit x and weight tiles in `smem` bytes."""
    return max(1, min(stages, smem // ((block_m + block_n) * 64 * 2)))


def _mid_tile(m: int, n: int, sms: int, smem: int) -> tuple:
    """(BLOCK_M, num_warps, BLOCK_N, num_stages) of the flat configuration for m rows (FLAT_MID_ROWS ..
    FLAT_MANY_ROWS - 1) of an [n, K] 16-bit weight on a GPU of `sms` SMs and `smem` bytes of shared memory a program
    (the comment above FLAT_FEW_TILES)."""
    for block_m, block_n in FLAT_MID_TILES:
        programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        if programs >= FLAT_MIN_PROGRAMS:
            break
    if block_n == 256 and programs > sms:
        block_n = 128
        programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    stages = _fitting(block_m, block_n, 6 if programs <= sms else 3, smem)
    return block_m, 8 if block_m * block_n >= 128 * 128 else 4, block_n, stages


@functools.cache
def flat_row_tiles(n: int, sms: int = H200_LIMITS[0], smem: int = H200_LIMITS[1]) -> tuple:
    """The flat configuration's ROW_TILES for an [n, K] 16-bit weight on a GPU of `sms` SMs and `smem` bytes of
    shared memory a program: FLAT_FEW_TILES, an entry wherever _mid_tile changes from FLAT_MID_ROWS rows,
    FLAT_MANY_TILE (each with its stages cut to what smem holds)."""
    entries = [(m0, bm, warps, bn, _fitting(bm, bn, stages, smem)) for m0, bm, warps, bn, stages in FLAT_FEW_TILES]
    for m in range(FLAT_MID_ROWS, FLAT_MANY_ROWS):
        tile = _mid_tile(m, n, sms, smem)
        if tile != entries[-1][1:]:
            entries.append((m, *tile))
    m0, bm, warps, bn, stages = FLAT_MANY_TILE
    return tuple(entries) + ((m0, bm, warps, bn, _fitting(bm, bn, stages, smem)),)


def split_config(n: int, k: int, dtype: torch.dtype | None = None, block_n: int = 128,
                 programs: int = TARGET_PROGRAMS, num_warps: int = 4) -> dict:  # fmt: skip
    """A tile of BLOCK_M 64 x block_n (64 in float32; num_warps) over BLOCK_K 64 and the SPLIT_K giving about `programs`
    programs for one row block: from n, k and the dtype alone."""
    block_k = 64
    if dtype == torch.float32:
        block_n = min(block_n, 64)  # two float32 accumulators of 64 x 128 spill registers
    blocks_n = triton.cdiv(n, block_n)
    split = 1
    while blocks_n * split < programs and split < MAX_SPLIT_K and k // (2 * split) >= MIN_K_SPLIT:
        split *= 2
    k_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    split = triton.cdiv(k, k_split)  # no empty ranges
    stages = 3 if dtype == torch.float32 else 4
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, K_SPLIT=k_split, GROUP_M=8,
                num_warps=num_warps, num_stages=stages, PROGRAMS=programs)  # fmt: skip


def old_config(n: int, k: int, dtype: torch.dtype | None = None) -> dict:
    """One tile shape (BLOCK_N 64, 128 from 16384 columns), no split-K, K masked in every step: few programs for few
    rows (a baseline)."""
    block_n = 128 if n >= 16384 else 64
    k_split = triton.cdiv(k, 64) * 64
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=64, SPLIT_K=1, K_SPLIT=k_split, GROUP_M=8, num_warps=4,
                num_stages=4, PROGRAMS=0, K_MASK=True)  # fmt: skip


def _with_row_tiles(base, row_tiles: tuple, n: int, k: int, dtype: torch.dtype | None = None) -> dict:
    return dict(base(n, k, dtype), ROW_TILES=row_tiles)


def flat_split(n: int, k: int, sms: int) -> int:
    """SPLIT_K of the "flat_split" candidate: 2 for a weight of at least FLAT_SPLIT_MIN_K columns whose few-row
    tiles give fewer programs than the GPU has SMs, else 1 (the comment above FLAT_SPLIT_MIN_K)."""
    few_programs = triton.cdiv(n, FLAT_FEW_TILES[0][3])
    return 2 if k >= FLAT_SPLIT_MIN_K and few_programs < sms else 1


def _two_accumulators(row_tiles: tuple, smem: int) -> tuple:
    """row_tiles with BLOCK_N cut to 128 where the tile is larger than 128 x 128 (a float32 total beside each K
    range's accumulator must stay in registers), stages refitted."""
    out = []
    for m0, bm, warps, bn, stages in row_tiles:
        if bm * bn > 128 * 128:
            bn = 128
            stages = _fitting(bm, bn, stages, smem)
        out.append((m0, bm, warps, bn, stages))
    return tuple(out)


def flat_config(n: int, k: int, dtype: torch.dtype | None = None, row_tiles: tuple | None = None,
                split_k: bool = False) -> dict:  # fmt: skip
    """One K range (SPLIT_K 1: one float32 accumulator, one loop over K in BLOCK_K 64 steps; split_k: flat_split's
    ranges) and the tile chosen by M from row_tiles (default flat_row_tiles for n and this GPU; float32: the split
    configuration instead, whose tiles keep its two accumulators in registers)."""
    if dtype == torch.float32:
        return split_config(n, k, dtype)
    sms, smem = device_limits()
    split = flat_split(n, k, sms) if split_k else 1
    k_split = triton.cdiv(triton.cdiv(k, 64), split) * 64
    tiles = row_tiles or flat_row_tiles(n, sms, smem)
    if split > 1:
        tiles = _two_accumulators(tiles, smem)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=split, K_SPLIT=k_split, GROUP_M=8, num_warps=4,
                num_stages=4, PROGRAMS=TARGET_PROGRAMS if split > 1 else 0, ROW_TILES=tiles)  # fmt: skip


CANDIDATES = {
    "old": old_config,
    "split128": split_config,
    "split64": functools.partial(split_config, block_n=64),
    "split128x2": functools.partial(split_config, programs=2 * TARGET_PROGRAMS),
    "split256": functools.partial(split_config, block_n=256, num_warps=8),
    # BLOCK_M by M: allowed only where the bench shows tl.dot's sums of a row independent of BLOCK_M
    "split128_m16": functools.partial(_with_row_tiles, split_config, ((1, 16, 4), (17, 64, 4))),
    "split128_m128": functools.partial(_with_row_tiles, split_config, ((128, 128, 8),)),
    "flat": flat_config,
    "flat_split": functools.partial(flat_config, split_k=True),
}
DEFAULT = "flat"


def config_for(n: int, k: int, dtype: torch.dtype | None = None) -> dict:
    """The launch configuration of a [n, k] weight: from its shape and dtype alone, never from the rows of x (the
    engine takes it through checked_config)."""
    return CANDIDATES[DEFAULT](n, k, dtype)


@triton.jit
def _range_sum(x_ptrs, w_ptrs, m_ok, n_ok, rk, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, K_MASK: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """float32 [BLOCK_M, BLOCK_N]: the tile's products over K columns k_lo..k_hi-1, in BLOCK_K steps from zero.
    K_MASK: mask the K columns (K not a multiple of BLOCK_K); without it the masks are constant along K, so the
    loads are 16-byte vectors that the compiler can pipeline (cp.async)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if K_MASK:
            k_ok = rk + k0 < k_hi
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        else:
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, p_ptr, M, N, K, SPLIT_K, K_SPLIT, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, MULTI: tl.constexpr, ACROSS: tl.constexpr, K_MASK: tl.constexpr,
    IEEE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """MULTI: SPLIT_K > 1 (a constexpr, so that one K range compiles to a single accumulator); M and SPLIT_K are
    not specialised on (one compiled kernel for every number of rows)."""
    pdl.gdc_sync(USE_PDL)
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = pid // per_group * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
    if ACROSS:  # this program's range only; _combine_kernel adds the ranges
        split = tl.program_id(1)
        k_lo = split * K_SPLIT
        acc = _range_sum(x_ptrs, w_ptrs, m_ok, n_ok, rk, k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_M, BLOCK_N,
                         BLOCK_K, K_MASK, IEEE)  # fmt: skip
        p_ptrs = p_ptr + (split.to(tl.int64) * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
        tl.store(p_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        if not MULTI:
            total = _range_sum(x_ptrs, w_ptrs, m_ok, n_ok, rk, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, K_MASK, IEEE)
        else:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in range(SPLIT_K):
                k_lo = split * K_SPLIT
                total += _range_sum(x_ptrs, w_ptrs, m_ok, n_ok, rk, k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_M,
                                    BLOCK_N, BLOCK_K, K_MASK, IEEE)  # fmt: skip
        if HAS_BIAS:
            total = total + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["size", "SPLIT_K"])
def _combine_kernel(p_ptr, b_ptr, y_ptr, size, N, SPLIT_K, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):  # fmt: skip
    """y (contiguous [M, N], size = M * N elements) = the SPLIT_K partial sums [SPLIT_K, M, N] added in range order
    to a float32 zero (+ bias)."""
    pdl.gdc_sync(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(SPLIT_K):
        total += tl.load(p_ptr + split * size + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        total = total + tl.load(b_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=ok)


def _programs(m: int, n: int, tile: dict) -> int:
    """Output tiles (programs per K range) of an [m, n] result."""
    return triton.cdiv(m, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"])


def row_tile(cfg: dict, m: int, n: int) -> dict:
    """The tile for m rows of an [n, K] weight (BLOCK_M, BLOCK_N, num_warps, num_stages): the configuration's, as
    its last ROW_TILES entry with min_rows <= m sets it ((min_rows, BLOCK_M, num_warps[, BLOCK_N, num_stages]))."""
    tile = {key: cfg[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    entries = [entry for entry in cfg.get("ROW_TILES", ()) if m >= entry[0]]
    if entries:
        tile.update(zip(("BLOCK_M", "num_warps", "BLOCK_N", "num_stages"), entries[-1][1:]))
    if _programs(m, n, tile) > DEEP_STAGES_MAX_PROGRAMS:
        tile["num_stages"] = min(tile["num_stages"], 6)
    return tile


def use_across(cfg: dict, m: int, n: int, tile: dict) -> bool:
    """Whether m rows run "across" (one program per K range), a choice of speed with the same bits either way: for
    up to ACROSS_MAX_ROWS rows whose output tiles alone are at most ACROSS_MAX_TILES_FRACTION of the configuration's
    PROGRAMS. (H200, 2026-12-03, bench/batch_invariant_matmul.py: at 1-64 rows "across" ran 1.5-3x faster on
    Llama-3-8B's qkv / o / down projections, 32-48 tiles, and 2-15 % slower on gate_up's 224.)"""
    tiles = _programs(m, n, tile)
    return cfg["SPLIT_K"] > 1 and m <= ACROSS_MAX_ROWS and tiles <= cfg["PROGRAMS"] * ACROSS_MAX_TILES_FRACTION


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None,
           across: bool | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] (rows with unit stride), weight [N, K] contiguous, bias [N] or None -> x @ weight^T + bias [M, N] in
    x's dtype. `config`: config_for(N, K, dtype) unless given (it must not depend on M for batch invariance).
    `across`: force the launch mode (None: chosen by M; either gives the same bits)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    cfg = config or config_for(n, k, weight.dtype)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    tile = row_tile(cfg, m, n)
    split = cfg["SPLIT_K"]
    if across is None:
        across = use_across(cfg, m, n, tile)
    across = across and split > 1
    tiles = _programs(m, n, tile)
    assert not across or split * m * n < 2**31
    k_mask = cfg.get("K_MASK", False) or k % cfg["BLOCK_K"] != 0
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if across else y
    _matmul_kernel[(tiles, split if across else 1)](
        x, weight, weight if bias is None else bias, y, partial, m, n, k, split, cfg["K_SPLIT"], x.stride(0),
        weight.stride(0), y.stride(0), HAS_BIAS=bias is not None and not across, BLOCK_M=tile["BLOCK_M"],
        BLOCK_N=tile["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], MULTI=split > 1, ACROSS=across,
        K_MASK=k_mask, IEEE=x.dtype == torch.float32, USE_PDL=pdl.ENABLED, num_warps=tile["num_warps"],
        num_stages=tile["num_stages"], **pdl.launch_kwargs(),
    )  # fmt: skip
    if across:
        _combine_kernel[(triton.cdiv(m * n, COMBINE_BLOCK),)](
            partial, weight if bias is None else bias, y, m * n, n, split, HAS_BIAS=bias is not None,
            BLOCK=COMBINE_BLOCK, USE_PDL=pdl.ENABLED, num_warps=4, **pdl.launch_kwargs(),
        )  # fmt: skip
    return y


def differing_row_counts(weight: torch.Tensor, cfg: dict, probes: int = 4, seed: int = 0) -> list[int]:
    """The row counts at which a probe row's result differs in any bit from the same row's alone (M = 1): wherever
    the tile changes with M (row_tile: the ROW_TILES entries and the stages cut past DEEP_STAGES_MAX_PROGRAMS; the
    count before and the count at the change), the probes at the first, last and evenly spread rows of a batch of
    random rows. Empty: the tiles that cfg picks by M sum every output element of `weight` the same way on this GPU
    and compiler."""
    n, k = weight.shape
    gen = torch.Generator(device=weight.device).manual_seed(seed)

    def rows(m: int) -> torch.Tensor:
        return torch.randn(m, k, generator=gen, device=weight.device).to(weight.dtype)

    probe = rows(probes)
    alone = torch.cat([matmul(probe[i : i + 1], weight, None, cfg) for i in range(probes)])
    last = max((entry[0] for entry in cfg.get("ROW_TILES", ())), default=1)
    tiles = [row_tile(cfg, m, n) for m in range(last + 1)]
    counts = sorted({c for m in range(2, last + 1) if tiles[m] != tiles[m - 1] for c in (m - 1, m) if c > 1})
    differ = []
    for m in counts:
        x = rows(m)
        places = torch.linspace(0, m - 1, min(probes, m), device=weight.device).long()
        x[places] = probe[: len(places)]
        y = matmul(x, weight, None, cfg)[places]
        if not torch.equal(y.view(torch.uint8), alone[: len(places)].contiguous().view(torch.uint8)):
            differ.append(m)
    return differ


_VERDICTS: dict[tuple, bool] = {}


def checked_config(weight: torch.Tensor) -> dict:
    """config_for(weight's shape and dtype) where its tiles by M are shown, on this device, to give every row the
    same bits at every M (differing_row_counts, once per weight shape, dtype and device); else the split
    configuration, whose tile does not change with M, with a warning."""
    n, k = weight.shape
    cfg = config_for(n, k, weight.dtype)
    if not cfg.get("ROW_TILES"):
        return cfg
    key = (n, k, weight.dtype, weight.device)
    if key not in _VERDICTS:
        differ = differing_row_counts(weight, cfg)
        if differ:
            logger.warning("deterministic mode: the %s matmul of a [%d, %d] %s weight gave other bits at %s rows than "
                           "at one on this device; that shape runs the split configuration (one tile for every M)",
                           DEFAULT, n, k, weight.dtype, differ)  # fmt: skip
        _VERDICTS[key] = not differ
    return cfg if _VERDICTS[key] else split_config(n, k, weight.dtype)
