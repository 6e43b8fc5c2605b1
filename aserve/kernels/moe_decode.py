"""Mixture-of-experts for a few tokens (decode): each slot and each token its own programs, no grouping by expert.

With T tokens of top_k experts each and T * k well below the number of experts, the grouped GEMMs of
aserve/kernels/moe.py run one mostly empty tile per routed expert, after two alignment kernels, and a third kernel
sums each token's k outputs. Here three launches do the layer, and none waits on another's counts:

    router logits [T, E] ─route (moe.py's, without the ranks)─▶ weights, ids [T, k]
    x [T, H]  ─gate/up: program (N block, slot s): x[s // k] · w13[ids[s]]^T, SiLU·mul─▶ act [T k, I]
    act       ─down: program (N block, token t): Σ_j weights[t, j] · act[t k + j] · w2[ids[t, j]]^T─▶ out [T, H]

Each program streams its expert's rows like aserve/kernels/gemv.py (a [BLOCK_N, BLOCK_K] float32 partial product
summed over K at the end; programmatic dependent launch where enabled); a slot whose expert another slot also picked
reads it again (from L2 when the two run together), so this pays while T * k is small against E (`use_decode`).
Rounding as the grouped path: gate and up rounded to the model's dtype before SiLU·mul; each slot's weighted down
projection rounded to it, the k of a token then added in float32 in the order j = 0 .. k - 1, rounded once. FP8
experts (e4m3 with a float32 scale per row) are widened as they load and scaled per output.
Reference: aserve/kernels/reference.py fused_moe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.fused import silu_mul_rounded

# Launch configurations of the two kernels: the fastest of bench/moe_decode.py --tune's grid on an H200 at the
# Qwen3-30B-A3B shape, one token (2026-12-03: gate/up 19.6 us, down and sum 15.5 us).
GATE_UP = dict(BLOCK_N=4, BLOCK_K=256, num_warps=4, num_stages=2)
DOWN = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=3)
# The decode kernels run while T * k <= E * SLOTS_PER_EXPERT: a few duplicate reads of an expert cost less than the
# grouped path's alignment launches and 16-row tiles.
SLOTS_PER_EXPERT = 0.25


def use_decode(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether fused_moe takes this module's kernels for num_tokens tokens (module docstring)."""
    return num_tokens * top_k <= max(top_k, num_experts * SLOTS_PER_EXPERT)


@triton.jit
def _row_dots(a_ptr, w_ptrs, n_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Σ_k a[k] w[n, k] for the BLOCK_N rows that w_ptrs (at k = 0) point to: float32 [BLOCK_N]."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_tile in range(0, K, BLOCK_K):
        k0 = tl.multiple_of(k_tile, BLOCK_K)
        if EVEN:
            a = tl.load(a_ptr + k0 + offs_k)
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptr + k0 + offs_k, mask=k_ok, other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, ids_ptr, scale_ptr, N, K, stride_x, stride_we, stride_wn, stride_act,
                    stride_se, TOP_K: tl.constexpr, SCALED: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """act[s, n] = silu(x[s // k] . gate[e, n]) * (x[s // k] . up[e, n]), e = ids[s], for BLOCK_N outputs n."""
    pdl.gdc_sync(USE_PDL)
    slot = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    x_row = x_ptr + (slot // TOP_K).to(tl.int64) * stride_x
    gate = _row_dots(x_row, rows, n_ok, K, BLOCK_N, BLOCK_K, EVEN)
    up = _row_dots(x_row, rows + N * stride_wn, n_ok, K, BLOCK_N, BLOCK_K, EVEN)
    if SCALED:
        scales = scale_ptr + expert * stride_se + offs_n
        gate = gate * tl.load(scales, mask=n_ok, other=0.0)
        up = up * tl.load(scales + N, mask=n_ok, other=0.0)
    dtype = act_ptr.dtype.element_ty
    out = silu_mul_rounded(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    tl.store(act_ptr + slot.to(tl.int64) * stride_act + offs_n, out, mask=n_ok)


@triton.jit
def _down_sum_kernel(act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, scale_ptr, N, K, stride_act, stride_we,
                     stride_wn, stride_out, stride_se, TOP_K: tl.constexpr, SCALED: tl.constexpr, EVEN: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """out[t, n] = Σ_j round(weights[t, j] * act[t k + j] . w2[ids[t, j], n]), j in order, for BLOCK_N outputs n."""
    pdl.gdc_sync(USE_PDL)
    token = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = token * TOP_K + j
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K)[None, :]
        y = _row_dots(act_ptr + slot.to(tl.int64) * stride_act, rows, n_ok, K, BLOCK_N, BLOCK_K, EVEN)
        if SCALED:
            y = y * tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_ok, other=0.0)
        total += (y * tl.load(weights_ptr + slot)).to(dtype).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + offs_n, total.to(dtype), mask=n_ok)


def _tiles(config: dict, n: int, k: int) -> dict:
    """config's tiles, narrowed to small shapes (tests), and whether K needs no mask."""
    cfg = dict(config)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], triton.next_power_of_2(n))
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(16, triton.next_power_of_2(k)))
    even = k % cfg["BLOCK_K"] == 0 and n % cfg["BLOCK_N"] == 0
    return cfg, even


def gate_up(x, w13, ids, w13_scale=None, config: dict = GATE_UP) -> torch.Tensor:
    """x [T, H], w13 [E, 2 I, H], ids int32 [T, k] -> act [T k, I] (module docstring); w13_scale [E, 2 I]: w13 is
    e4m3 with float32 row scales."""
    t, top_k = ids.shape
    _, two_i, h = w13.shape
    n = two_i // 2
    act = torch.empty(t * top_k, n, dtype=x.dtype, device=x.device)
    cfg, even = _tiles(config, n, h)
    scale = w13_scale if w13_scale is not None else act
    _gate_up_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), t * top_k)](
        x, w13, act, ids, scale, n, h, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        scale.stride(0), TOP_K=top_k, SCALED=w13_scale is not None, EVEN=even, USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(), **cfg,
    )  # fmt: skip
    return act


def down_sum(act, w2, ids, weights, w2_scale=None, config: dict = DOWN) -> torch.Tensor:
    """act [T k, I], w2 [E, H, I], ids int32 / weights float32 [T, k] -> out [T, H] (module docstring); w2_scale
    [E, H]: w2 is e4m3 with float32 row scales."""
    t, top_k = ids.shape
    _, h, i = w2.shape
    out = torch.empty(t, h, dtype=act.dtype, device=act.device)
    cfg, even = _tiles(config, h, i)
    scale = w2_scale if w2_scale is not None else out
    _down_sum_kernel[(triton.cdiv(h, cfg["BLOCK_N"]), t)](
        act, w2, out, ids, weights, scale, h, i, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        scale.stride(0), TOP_K=top_k, SCALED=w2_scale is not None, EVEN=even, USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(), **cfg,
    )  # fmt: skip
    return out
