"""Mixture-of-experts routing on the GPU: each token's top_k experts from its router logits, as transformers'
Mixtral / Qwen3-MoE routers choose them (softmax over all E logits in float32, the top_k largest probabilities with
the lowest index on ties, renormalised to sum to 1 where the family asks).

select_top_k is the choice itself, on logits a kernel has loaded: the route kernel writes each token's experts and
weights with it (and, for the grouped path of aserve/kernels/moe.py, each slot's rank among its expert's slots), and
the few-token gate/up kernel of aserve/kernels/moe_decode.py calls it in every program instead of reading them.
(Ranking all experts against each other in one step, for the few-token kernel, measured slower on an H200: 44.7
against 28.3 us for a Qwen3-30B-A3B layer at one token, 2026-12-03.) Reference: aserve/kernels/reference.py
select_experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl


@triton.jit
def select_top_k(x, col_ok, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    """x float32 [ROWS, BLOCK_E] router logits (-inf in the columns past E, where col_ok [BLOCK_E] is False)
    -> (weights float32, expert ids int32), each [ROWS, K_PAD]: column j < TOP_K the j-th choice."""
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where(col_ok[None, :], p, float("-inf"))
    cols = tl.arange(0, x.shape[1])
    ks = tl.arange(0, K_PAD)
    top_w = tl.zeros([x.shape[0], K_PAD], dtype=tl.float32)
    top_i = tl.zeros([x.shape[0], K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        idx = tl.argmax(p, 1, tie_break_left=True).to(tl.int32)
        top_w = tl.where(ks[None, :] == j, best[:, None], top_w)
        top_i = tl.where(ks[None, :] == j, idx[:, None], top_i)
        p = tl.where(cols[None, :] == idx[:, None], float("-inf"), p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 1)[:, None]
    return top_w, top_i


@triton.jit
def slot_expert(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    slot,
    E,
    stride_l,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The expert of slot s = t k + j: the j-th of token t's router logits' top_k (select_top_k). The program of the
    first column block writes it and its routing weight to ids / weights."""
    cols = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + (slot // TOP_K).to(tl.int64) * stride_l + cols[None, :], mask=cols[None, :] < E,
                     other=float("-inf")).to(tl.float32)  # fmt: skip
    top_w, top_i = select_top_k(logits, cols < E, TOP_K, K_PAD, RENORMALIZE)
    pick = tl.arange(0, K_PAD)[None, :] == slot % TOP_K
    expert = tl.sum(tl.where(pick, top_i, 0))
    if tl.program_id(0) == 0:
        tl.store(ids_ptr + slot, expert)
        tl.store(weights_ptr + slot, tl.sum(tl.where(pick, top_w, 0.0)))
    return expert


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, ranks_ptr, counts_ptr, T, E, stride_l,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, RANKS: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """BLOCK_T tokens per program: select_top_k; RANKS: each slot's rank among its expert's slots from the
    expert's counter."""
    pdl.gdc_sync(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=float("-inf")).to(tl.float32)  # fmt: skip
    x = tl.where(row_ok[:, None], x, 0.0)  # rows past T: finite, never stored
    top_w, top_i = select_top_k(x, col_ok, TOP_K, K_PAD, RENORMALIZE)
    ks = tl.arange(0, K_PAD)
    slots = rows[:, None] * TOP_K + ks[None, :]
    ok = row_ok[:, None] & (ks[None, :] < TOP_K)
    tl.store(weights_ptr + slots, top_w, mask=ok)
    tl.store(ids_ptr + slots, top_i, mask=ok)
    if RANKS:
        rank = tl.atomic_add(counts_ptr + top_i, 1, mask=ok)
        tl.store(ranks_ptr + slots, rank, mask=ok)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, ranks=None, counts=None, weights=None,
          ids=None):  # fmt: skip
    """router_logits [T, E] -> (weights float32 [T, k], ids int32 [T, k]) (into `weights` / `ids` where given); with
    `ranks` / `counts` (int32 [T, k] / zeros [E]) each slot's rank among its expert's slots and the experts' counts
    too."""
    t, e = router_logits.shape
    if weights is None:
        weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
        ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(16, 4096 // block_e))
    _route_kernel[(triton.cdiv(t, block_t),)](
        router_logits, weights, ids, ids if ranks is None else ranks, ids if counts is None else counts, t, e,
        router_logits.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        RANKS=ranks is not None, BLOCK_T=block_t, BLOCK_E=block_e, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(),
    )  # fmt: skip
    return weights, ids
