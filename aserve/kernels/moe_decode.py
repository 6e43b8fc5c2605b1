"""Mixture-of-experts for a few tokens (decode): each slot and each token its own programs, no grouping by expert.

With T tokens of top_k experts each and T * k well below the number of experts, the grouped GEMMs of
aserve/kernels/moe.py run one mostly empty tile per routed expert, after three routing and alignment kernels, and a
fourth kernel sums each token's k outputs. Here two launches do the layer:

    x [T, H], router logits [T, E]
        ─gate/up: program (N block, slot s = t k + j): the j-th of token t's top_k experts e (every program chooses
         them from the logits: aserve/kernels/moe_routing.py select_top_k), x[t] · w13[e]^T, SiLU·mul─▶ act [T k, I]
         (and each slot's expert and routing weight, written by its first program)
    act ─down: program (N block, token t): Σ_j weights[t, j] · act[t k + j] · w2[ids[t, j]]^T─▶ out [T, H]

Each program streams weight rows like aserve/kernels/gemv.py (a float32 partial product per row, summed over K at
the end; programmatic dependent launch where enabled); the down kernel holds the rows of all k slots in one tile, so
their loads are in flight together. A slot whose expert another slot also picked reads it again (from L2 when the
two run together), so this pays while T * k is small against E (`use_decode`). Rounding as the grouped path: gate
and up rounded to the model's dtype before SiLU·mul; each slot's weighted down projection rounded to it, the k of a
token added in float32 and rounded once. FP8 experts (e4m3 with a float32 scale per row) are widened as they load
and scaled per output. Reference: aserve/kernels/reference.py fused_moe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.fused import silu_mul_rounded
from aserve.kernels.moe_routing import slot_expert

# Launch configurations of the two kernels: the fastest of bench/moe_decode.py --tune's grid on an H200 at the
# Qwen3-30B-A3B shape, one token (2026-12-03: gate/up with the choice of experts 24.4 us, down and sum 13.1 us).
GATE_UP = dict(BLOCK_N=4, BLOCK_K=256, num_warps=2, num_stages=2)
DOWN = dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=2)
# The decode kernels run while T * k <= E * SLOTS_PER_EXPERT: a few duplicate reads of an expert cost less than the
# grouped path's alignment launches and 16-row tiles.
SLOTS_PER_EXPERT = 0.25


def use_decode(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether fused_moe takes this module's kernels for num_tokens tokens (module docstring)."""
    return num_tokens * top_k <= max(top_k, num_experts * SLOTS_PER_EXPERT)


@triton.jit
def _row_dots(a_rows, w_rows, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Σ_k a[r, k] w[r, k] for the rows r whose first elements a_rows / w_rows [R] point to: float32 [R]."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([a_rows.shape[0], BLOCK_K], dtype=tl.float32)
    for k_tile in range(0, K, BLOCK_K):
        k0 = tl.multiple_of(k_tile, BLOCK_K)
        k = k0 + offs_k[None, :]
        if EVEN:
            a = tl.load(a_rows[:, None] + k)
            w = tl.load(w_rows[:, None] + k, eviction_policy="evict_first")
        else:
            a = tl.load(a_rows[:, None] + k, mask=k < K, other=0.0)
            w = tl.load(w_rows[:, None] + k, mask=k < K, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * a.to(tl.float32)
    return tl.sum(acc, 1)


@triton.jit
def _gate_up_kernel(x_ptr, logits_ptr, w_ptr, act_ptr, ids_ptr, weights_ptr, scale_ptr, N, K, E, stride_x, stride_l,
                    stride_we, stride_wn, stride_act, stride_se, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, SCALED: tl.constexpr, EVEN: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """Slot s = t k + j: its expert e (the j-th of token t's router logits' top_k; the first N block's program
    writes it to ids / weights) and act[s, n] = silu(x[t] . gate[e, n]) * (x[t] . up[e, n]) for BLOCK_N outputs n."""
    pdl.gdc_sync(USE_PDL)
    slot = tl.program_id(1)
    token = slot // TOP_K
    expert = slot_expert(logits_ptr, ids_ptr, weights_ptr, slot, E, stride_l, TOP_K, K_PAD, RENORMALIZE, BLOCK_E)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # past N: clamped, never stored
    gate_rows = w_ptr + expert.to(tl.int64) * stride_we + rows * stride_wn
    x_rows = x_ptr + token.to(tl.int64) * stride_x + tl.zeros([BLOCK_N], dtype=tl.int64)
    gate = _row_dots(x_rows, gate_rows, K, BLOCK_K, EVEN)
    up = _row_dots(x_rows, gate_rows + N * stride_wn, K, BLOCK_K, EVEN)
    if SCALED:
        scales = scale_ptr + expert.to(tl.int64) * stride_se + rows
        gate = gate * tl.load(scales)
        up = up * tl.load(scales + N)
    dtype = act_ptr.dtype.element_ty
    out = silu_mul_rounded(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    tl.store(act_ptr + slot.to(tl.int64) * stride_act + offs_n, out, mask=offs_n < N)


@triton.jit
def slot_rows(ids_ptr, token, N, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """The down kernel's [K_PAD * BLOCK_N] rows of token's k slots (row r: slot j = r // BLOCK_N, output r % BLOCK_N)
    -> (slot, used, expert, weight row): rows past TOP_K or N read a real row (clamped) and are not used."""
    r = tl.arange(0, K_PAD * BLOCK_N)
    j = r // BLOCK_N
    offs_n = tl.program_id(0) * BLOCK_N + r % BLOCK_N
    used = (j < TOP_K) & (offs_n < N)
    slot = token * TOP_K + tl.minimum(j, TOP_K - 1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    return slot, used, expert, tl.minimum(offs_n, N - 1).to(tl.int64)


@triton.jit
def sum_slots(out_ptr, y, used, weights_ptr, slot, token, N, stride_out, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[token, n] = the sum over the k slots of round(weight * y) for the rows slot_rows laid out."""
    dtype = out_ptr.dtype.element_ty
    y = tl.where(used, (y * tl.load(weights_ptr + slot)).to(dtype).to(tl.float32), 0.0)
    total = tl.sum(tl.reshape(y, (K_PAD, BLOCK_N)), 0)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, total.to(dtype), mask=cols < N)


@triton.jit
def _down_sum_kernel(act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, scale_ptr, N, K, stride_act, stride_we,
                     stride_wn, stride_out, stride_se, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                     SCALED: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_PDL: tl.constexpr):  # fmt: skip
    """out[t, n] = Σ_j round(weights[t, j] * act[t k + j] . w2[ids[t, j], n]) for BLOCK_N outputs n: the k slots'
    rows in one [K_PAD * BLOCK_N, BLOCK_K] tile (row r: slot j = r // BLOCK_N, output r % BLOCK_N)."""
    pdl.gdc_sync(USE_PDL)
    token = tl.program_id(1)
    slot, used, expert, rows = slot_rows(ids_ptr, token, N, TOP_K, K_PAD, BLOCK_N)
    y = _row_dots(act_ptr + slot.to(tl.int64) * stride_act, w_ptr + expert * stride_we + rows * stride_wn, K,
                  BLOCK_K, EVEN)  # fmt: skip
    if SCALED:
        y = y * tl.load(scale_ptr + expert * stride_se + rows)
    sum_slots(out_ptr, y, used, weights_ptr, slot, token, N, stride_out, K_PAD, BLOCK_N)


def _tiles(config: dict, n: int, k: int) -> tuple[dict, bool]:
    """config's tiles, narrowed to small shapes (tests), and whether K needs no mask."""
    cfg = dict(config)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], triton.next_power_of_2(n))
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(16, triton.next_power_of_2(k)))
    return cfg, k % cfg["BLOCK_K"] == 0


def gate_up(x, router_logits, w13, top_k: int, renormalize: bool, w13_scale=None, config: dict = GATE_UP):
    """x [T, H], router logits [T, E], w13 [E, 2 I, H] -> (act [T k, I], weights float32 [T, k], ids int32 [T, k])
    (module docstring); w13_scale [E, 2 I]: w13 is e4m3 with float32 row scales."""
    t, e = router_logits.shape
    _, two_i, h = w13.shape
    n = two_i // 2
    act = torch.empty(t * top_k, n, dtype=x.dtype, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    cfg, even = _tiles(config, n, h)
    scale = w13_scale if w13_scale is not None else act
    _gate_up_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), t * top_k)](
        x, router_logits, w13, act, ids, weights, scale, n, h, e, x.stride(0), router_logits.stride(0),
        w13.stride(0), w13.stride(1), act.stride(0), scale.stride(0), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(e),
        SCALED=w13_scale is not None, EVEN=even, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(), **cfg,
    )  # fmt: skip
    return act, weights, ids


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
        scale.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), SCALED=w2_scale is not None,
        EVEN=even, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(), **cfg,
    )  # fmt: skip
    return out
