"""Triton GEMV for one row (batch-1 decode): y[1, N] = x[1, K] @ W[N, K]^T (+ bias), W row-major as nn.Linear keeps
it. Memory-bound: the kernel's only job is to stream W at the memory's read bandwidth.

Each program owns BLOCK_N output rows and walks K in BLOCK_K steps; every step loads a [BLOCK_N, BLOCK_K] tile
(each row contiguous: 16-byte loads, fully coalesced) and the matching slice of x, and keeps an element-wise
float32 accumulator, reduced over K once at the end. Rows past N are clamped to N - 1 (loaded, never stored) so the
hot loop has no masks; K must be a multiple of BLOCK_K (true of every model shape; `gemv_config` checks it).

SILU_MUL fuses a Llama MLP's activation into the down projection: x is the gate_up output [gate | up] and each
K slice of silu(gate) * up is computed in the loop (one kernel less per layer); it has its own launch configuration
(twice the x traffic per weight tile). With programmatic dependent launch (aserve/kernels/pdl.py) a GEMV's launch
overlaps the previous kernel's tail.

scaled_gemv is the same loop over 8-bit weights (int8, e4m3; one float32 scale per output row, applied after the
sum), with its launch configuration per weight shape (SCALED_GEMV_CONFIGS).

Not fused here, because each measured slower on the H200 (docs/benchmarks.md, "GPU batch-1 decode"): the add +
RMSNorm before q/k/v and gate/up (as a pre-pass over the row in every program, as a last-program step (atomic ticket)
of the GEMV before, or folded into the dot products: x * norm weight and sum(x^2) in the loop); rotary + cache write
in the q/k/v GEMV's epilogue (rotary is fused with the cache write instead: aserve/kernels/fused.py rotary_split).
Reference: torch.nn.functional.linear (after aserve/kernels/fused.py's silu_and_mul for SILU_MUL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.fused import silu_mul_rounded

# Launch configurations chosen on an H200 (bench/decode_kernels.py, docs/benchmarks.md): few output rows want
# bigger row blocks (enough work per program), many rows small ones (more programs in flight).
FEW_ROWS = 4096
GEMV_CONFIG_FEW_ROWS = dict(BLOCK_N=16, BLOCK_K=1024, num_warps=8, num_stages=2)
GEMV_CONFIG = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=2)
# SILU_MUL (down projection, [1, 2K] input): the few-rows config measured 38.5 us on 4096 x 14336, this 30.0
GEMV_CONFIG_SILU_MUL = dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3)


@triton.jit
def _x_tile(x_ptr, k, K, SILU_MUL: tl.constexpr):
    """x[k] as float32; SILU_MUL: x holds [gate | up] (2K wide) and this is silu(gate) * up, rounded to x's dtype
    where aserve/kernels/fused.py's silu_and_mul rounds."""
    dtype = x_ptr.dtype.element_ty
    if SILU_MUL:
        g = tl.load(x_ptr + k).to(tl.float32)
        u = tl.load(x_ptr + K + k).to(tl.float32)
        return silu_mul_rounded(g, u, dtype).to(tl.float32)
    else:
        return tl.load(x_ptr + k).to(tl.float32)


@triton.jit
def _gemv_rows(x_ptr, w_ptr, rows, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """float32 [BLOCK_N]: x . W[rows] (rows int64, all in range). The caller has passed its gdc_sync."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_w + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_tile in range(0, K, BLOCK_K):
        k0 = tl.multiple_of(k_tile, BLOCK_K)  # whole tiles: aligned (16-byte) loads
        w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * _x_tile(x_ptr, k0 + rk, K, SILU_MUL)[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gemv_block(x_ptr, w_ptr, bias_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """This program's output rows rn [BLOCK_N] and their float32 values (rows past N: clamped, not to be stored)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    # The first weight tile is loaded after gdc_sync: loading it before, to overlap it with the previous kernel's
    # tail, measures slower on the H200 (docs/benchmarks.md, "GPU batch-1 decode").
    pdl.gdc_sync(USE_PDL)
    y = _gemv_rows(x_ptr, w_ptr, rows, K, stride_w, BLOCK_N, BLOCK_K, SILU_MUL)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    return rn, y


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_w,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    rn, y = _gemv_block(x_ptr, w_ptr, bias_ptr, N, K, stride_w, BLOCK_N, BLOCK_K, HAS_BIAS, SILU_MUL, USE_PDL)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


def gemv_config(n: int, k: int, config: dict | None = None, silu_mul: bool = False) -> dict | None:
    """The launch configuration for an [n, k] weight (silu_mul: of the GEMV with SiLU·mul fused in), or None when
    the kernel does not apply (K not a multiple of BLOCK_K)."""
    default = GEMV_CONFIG_SILU_MUL if silu_mul else GEMV_CONFIG_FEW_ROWS if n <= FEW_ROWS else GEMV_CONFIG
    cfg = dict(config or default)
    block_k = cfg["BLOCK_K"]
    while block_k > 64 and k % block_k:
        block_k //= 2
    if k % block_k:
        return None
    cfg["BLOCK_K"] = block_k
    return cfg


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:  # fmt: skip
    """x [1, K] @ weight[N, K]^T (+ bias) -> [1, N] in x's dtype. silu_mul: x is [1, 2K] = [gate | up] and the
    product is silu(gate) * up @ weight^T (a Llama MLP's down projection with its activation fused in)."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == (2 if silu_mul else 1) * weight.shape[1]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    n, k = weight.shape
    cfg = gemv_config(n, k, config, silu_mul)
    assert cfg is not None, f"K={k} is not a multiple of 64"
    out = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


# gemv_rows: up to ROWS_PER_PROGRAM rows a program, each with its own accumulator of the one-row kernel's shape
ROWS_PER_PROGRAM = 8


@triton.jit
def _row_dot(acc, w, x_ptr, m, M, stride_x, k, USED: tl.constexpr):
    """acc + w * x[row m] (the row clamped to M - 1: computed, not stored) where this accumulator is in use."""
    if USED:
        row = tl.minimum(m, M - 1).to(tl.int64)
        acc += w * tl.load(x_ptr + row * stride_x + k).to(tl.float32)[None, :]
    return acc


@triton.jit
def _store_row(out_ptr, acc, bias, m, M, stride_out, rn, N, USED: tl.constexpr, HAS_BIAS: tl.constexpr):
    if USED:
        y = tl.sum(acc, 1)
        if HAS_BIAS:
            y += bias
        tl.store(
            out_ptr + m.to(tl.int64) * stride_out + rn, y.to(out_ptr.dtype.element_ty), mask=rn < tl.where(m < M, N, 0)
        )


@triton.jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (n, g): output rows rn of input rows g * ROWS .. + ROWS. Each input row keeps an accumulator of
    _gemv_rows' shape, fed the same weight tile in the same order: its sums are _gemv_kernel's, whatever ROWS."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m0 = tl.program_id(1) * ROWS
    w_rows = tl.minimum(rn, N - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + w_rows[:, None] * stride_w + rk[None, :]
    pdl.gdc_sync(USE_PDL)
    a0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    for k_tile in range(0, K, BLOCK_K):
        k0 = tl.multiple_of(k_tile, BLOCK_K)
        w = tl.load(w_ptrs + k0, eviction_policy="evict_first").to(tl.float32)
        k = k0 + rk
        a0 = _row_dot(a0, w, x_ptr, m0, M, stride_x, k, True)
        a1 = _row_dot(a1, w, x_ptr, m0 + 1, M, stride_x, k, ROWS > 1)
        a2 = _row_dot(a2, w, x_ptr, m0 + 2, M, stride_x, k, ROWS > 2)
        a3 = _row_dot(a3, w, x_ptr, m0 + 3, M, stride_x, k, ROWS > 3)
        a4 = _row_dot(a4, w, x_ptr, m0 + 4, M, stride_x, k, ROWS > 4)
        a5 = _row_dot(a5, w, x_ptr, m0 + 5, M, stride_x, k, ROWS > 5)
        a6 = _row_dot(a6, w, x_ptr, m0 + 6, M, stride_x, k, ROWS > 6)
        a7 = _row_dot(a7, w, x_ptr, m0 + 7, M, stride_x, k, ROWS > 7)
    bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    _store_row(out_ptr, a0, bias, m0, M, stride_out, rn, N, True, HAS_BIAS)
    _store_row(out_ptr, a1, bias, m0 + 1, M, stride_out, rn, N, ROWS > 1, HAS_BIAS)
    _store_row(out_ptr, a2, bias, m0 + 2, M, stride_out, rn, N, ROWS > 2, HAS_BIAS)
    _store_row(out_ptr, a3, bias, m0 + 3, M, stride_out, rn, N, ROWS > 3, HAS_BIAS)
    _store_row(out_ptr, a4, bias, m0 + 4, M, stride_out, rn, N, ROWS > 4, HAS_BIAS)
    _store_row(out_ptr, a5, bias, m0 + 5, M, stride_out, rn, N, ROWS > 5, HAS_BIAS)
    _store_row(out_ptr, a6, bias, m0 + 6, M, stride_out, rn, N, ROWS > 6, HAS_BIAS)
    _store_row(out_ptr, a7, bias, m0 + 7, M, stride_out, rn, N, ROWS > 7, HAS_BIAS)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None,
              rows_per_program: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N], every row summed as `gemv` sums a one-row input with the same
    config: a row's result depends on nothing but the row (not on M, nor on the rows beside it). Up to
    `rows_per_program` rows share each weight tile a program loads (min(M, that) rows: a program per row group);
    None: one row a program up to 32 rows (programs enough to stream a narrow weight), then more per program, up
    to ROWS_PER_PROGRAM from 256 rows (fewer loads of the weight). It changes the speed, not the bits."""
    if rows_per_program is None:
        rows_per_program = min(ROWS_PER_PROGRAM, max(1, x.shape[0] // 32))
    assert x.dim() == 2 and x.shape[1] == weight.shape[1] and 1 <= rows_per_program <= ROWS_PER_PROGRAM
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    (m, k), n = x.shape, weight.shape[0]
    cfg = gemv_config(n, k, config)
    assert cfg is not None, f"K={k} is not a multiple of 64"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    rows = min(m, rows_per_program)
    _gemv_rows_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, rows))](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=rows, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None, USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


# scaled_gemv over 8-bit weights (int8, float8), half the bytes of bf16: one set of launch configurations for both
SCALED_GEMV_CONFIG_FEW_ROWS = dict(BLOCK_N=16, BLOCK_K=1024, num_warps=8, num_stages=3)
SCALED_GEMV_CONFIG = dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3)
SCALED_GEMV_CONFIG_SILU_MUL = dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3)
# Per weight shape: (N, K, silu_mul) -> launch configuration (bench/fp8_bench.py --tune prints these entries); shapes
# not listed take the defaults above.
# H200, 2026-12-03, bench/fp8_bench.py --tune (e4m3 weights, M = 1, us and weight GB/s; Llama-3-8B's shapes):
SCALED_GEMV_CONFIGS: dict[tuple[int, int, bool], dict] = {
    (6144, 4096, False): dict(BLOCK_N=16, BLOCK_K=512, num_warps=8, num_stages=3),  # qkv: 12.7 us, 1976 GB/s
    (4096, 4096, False): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3),  # o: 11.1 us, 1513 GB/s
    (28672, 4096, False): dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=2),  # gate_up: 39.0 us, 3013 GB/s
    (4096, 14336, False): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3),  # down: 21.4 us, 2743 GB/s
    (4096, 14336, True): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=3),  # down + SiLU: 23.1 us, 2538 GB/s
}


def scaled_gemv_config(n: int, k: int, config: dict | None = None, silu_mul: bool = False) -> dict | None:
    """scaled_gemv's launch configuration for an [n, k] 8-bit weight (None where K is not a multiple of 64): `config`,
    else SCALED_GEMV_CONFIGS' entry for the shape, else the defaults."""
    if not config:
        few_rows = n <= FEW_ROWS
        default = (
            SCALED_GEMV_CONFIG_SILU_MUL if silu_mul else SCALED_GEMV_CONFIG_FEW_ROWS if few_rows else SCALED_GEMV_CONFIG
        )
        config = SCALED_GEMV_CONFIGS.get((n, k, silu_mul), default)
    return gemv_config(n, k, config)


@triton.jit
def _scaled_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, N, K, stride_w,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N: clamped, computed, not stored
    pdl.gdc_sync(USE_PDL)
    y = _gemv_rows(x_ptr, w_ptr, rows, K, stride_w, BLOCK_N, BLOCK_K, SILU_MUL) * tl.load(scale_ptr + rows)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


def scaled_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, cfg: dict,
                silu_mul: bool = False) -> torch.Tensor:  # fmt: skip
    """The GEMV over 8-bit weights (int8, float8) with one float32 scale per output row: x [1, K] -> (x w^T) *
    scale (+ bias) [1, N] in x's dtype, the weights widened in registers. silu_mul as in `gemv`; cfg from
    `scaled_gemv_config`."""
    n, k = w.shape
    assert x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == (2 if silu_mul else 1) * k
    assert x.stride(-1) == 1 and w.stride(-1) == 1 and scale.dtype == torch.float32
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _scaled_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, w, scale, bias if bias is not None else scale, out, n, k, w.stride(0),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
