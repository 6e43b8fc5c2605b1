"""Mixture-of-experts routing, grouped by expert: the layout the grouped GEMMs of aserve/kernels/moe.py read.

Each token t picks top_k experts (aserve/kernels/moe_routing.py); its `slots` are t * top_k + j. The slots are
grouped by expert, each group padded to a multiple of BLOCK_M (vLLM's moe_align_block_size), so that every BLOCK_M
rows of `sorted_slots` belong to one expert and a GEMM tile reads one expert's weights:

    router logits [T, E] ─route─▶ weights, ids [T, k]; each slot's rank among its expert's slots; counts [E]
                         ─offsets─▶ expert e's rows start at sum of padded counts before it; block -> expert
                         ─scatter─▶ sorted_slots [num_blocks * BLOCK_M] (padding: the sentinel T * k)

    sorted_slots:  | e0 s3 s8 s9 pad | e1 s0 pad pad pad | e3 s1 s2 s5 s6 | e3 s7 pad pad pad | (E: unused blocks)

The three kernels need no host synchronisation (the number of blocks is the bound T * k + min(E, T * k) *
(BLOCK_M - 1) rounded up, and blocks past the last expert return at once), so a decode step captures in a CUDA
graph. A slot's rank within its expert comes from an atomic counter: the order of slots inside an expert's rows
varies from run to run, each slot's result does not. Up to ROUTE_ALIGN_MAX_SLOTS slots, one program does all three
(_route_align_kernel), the ranks counted in slot order: route_rows, which a kernel may also call to route the slots
in its own registers (moe.py's routed gate/up GEMM). Reference: aserve/kernels/reference.py select_experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import moe_routing, pdl

# Up to this many slots (and slots x experts, both padded to powers of two) the routing and grouping run as one
# program (_route_align_kernel: one launch for the four of route, its zeroed counters, offsets and scatter).
ROUTE_ALIGN_MAX_SLOTS = 128
ROUTE_ALIGN_MAX_ELEMENTS = 16384


@triton.jit
def expert_ends(counts, BLOCK_M: tl.constexpr):
    """The experts' counts [BLOCK_E] -> (the row past each expert's rows, its count padded to BLOCK_M): expert e's
    rows are [ends[e] - padded[e], ends[e])."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    return tl.cumsum(padded, 0), padded


@triton.jit
def _expert_starts(counts, BLOCK_M: tl.constexpr):
    ends, padded = expert_ends(counts, BLOCK_M)
    return ends - padded


@triton.jit
def _block_expert(ends, e_ok, first_row):
    """The expert whose rows hold first_row (any shape): the number of experts whose rows end at or before it (E: past
    the last expert's rows)."""
    before = (ends[None, :] <= first_row[:, None]) & e_ok[None, :]
    return tl.sum(before.to(tl.int32), 1)


@triton.jit
def _layout_blocks(counts, e_ok, block_experts_ptr, sorted_slots_ptr, num_slots, num_blocks, BLOCK_M: tl.constexpr,
                   CHUNK: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    """From the experts' counts [BLOCK_E] (e_ok: the columns below E): each block's expert (E past the last one)
    stored, every row of sorted_slots set to the sentinel num_slots (the slots then overwrite theirs), and each
    expert's first row returned (counts padded to BLOCK_M, summed)."""
    ends, padded = expert_ends(counts, BLOCK_M)
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        tl.store(block_experts_ptr + b, _block_expert(ends, e_ok, b * BLOCK_M), mask=b < num_blocks)
    for r0 in range(0, num_blocks * BLOCK_M, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(sorted_slots_ptr + r, tl.full([FILL], 0, tl.int32) + num_slots, mask=r < num_blocks * BLOCK_M)
    return ends - padded


@triton.jit
def _offsets_kernel(counts_ptr, starts_ptr, block_experts_ptr, sorted_slots_ptr, num_slots, num_blocks, E,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
                    USE_PDL: tl.constexpr):  # fmt: skip
    """One program: _layout_blocks from the route kernel's counts, each expert's first row stored for the
    scatter."""
    pdl.gdc_sync(USE_PDL)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    counts = tl.load(counts_ptr + e, mask=e_ok, other=0)
    starts = _layout_blocks(counts, e_ok, block_experts_ptr, sorted_slots_ptr, num_slots, num_blocks, BLOCK_M, CHUNK,
                            FILL)  # fmt: skip
    tl.store(starts_ptr + e, starts, mask=e_ok)


@triton.jit
def _scatter_kernel(ids_ptr, ranks_ptr, starts_ptr, sorted_slots_ptr, num_slots, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):  # fmt: skip
    pdl.gdc_sync(USE_PDL)
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = slots < num_slots
    expert = tl.load(ids_ptr + slots, mask=ok, other=0)
    row = tl.load(starts_ptr + expert, mask=ok, other=0) + tl.load(ranks_ptr + slots, mask=ok, other=0)
    tl.store(sorted_slots_ptr + row, slots, mask=ok)


@triton.jit
def route_rows(logits_ptr, T, E, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                SLOTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """The routing and grouping of at most SLOTS slots in one program's registers: -> (slots s [SLOTS], s_ok (below
    T * TOP_K), each slot's expert and routing weight, its row of sorted_slots, the experts' counts [BLOCK_E], e_ok
    (the columns below E)); a slot's rank within its expert counted from the slots before it."""
    n = T * TOP_K
    s = tl.arange(0, SLOTS)
    s_ok = s < n
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    x = tl.load(logits_ptr + (s // TOP_K)[:, None].to(tl.int64) * stride_l + e[None, :],
                mask=s_ok[:, None] & e_ok[None, :], other=float("-inf")).to(tl.float32)  # fmt: skip
    x = tl.where(s_ok[:, None], x, 0.0)  # slots past n: finite, never stored
    top_w, top_i = moe_routing.select_top_k(x, e_ok, TOP_K, K_PAD, RENORMALIZE)
    pick = tl.arange(0, K_PAD)[None, :] == (s % TOP_K)[:, None]
    expert = tl.sum(tl.where(pick, top_i, 0), 1)
    weight = tl.sum(tl.where(pick, top_w, 0.0), 1)
    rank = tl.sum(((expert[:, None] == expert[None, :]) & (s[None, :] < s[:, None])).to(tl.int32), 1)
    chose = (expert[:, None] == e[None, :]) & s_ok[:, None]  # [SLOTS, BLOCK_E]
    counts = tl.sum(chose.to(tl.int32), 0)
    starts = _expert_starts(counts, BLOCK_M)
    row = tl.sum(tl.where(chose, starts[None, :], 0), 1) + rank
    return s, s_ok, expert, weight, row, counts, e_ok


@triton.jit
def store_routing(s, s_ok, expert, weight, row, counts, e_ok, weights_ptr, ids_ptr, sorted_slots_ptr,
                  block_experts_ptr, num_blocks, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  FILL: tl.constexpr):  # fmt: skip
    """route_rows' results stored: ids, weights, block_experts and sorted_slots as route_and_align returns them."""
    tl.store(ids_ptr + s, expert, mask=s_ok)
    tl.store(weights_ptr + s, weight, mask=s_ok)
    _layout_blocks(counts, e_ok, block_experts_ptr, sorted_slots_ptr, tl.sum(s_ok.to(tl.int32), 0), num_blocks,
                   BLOCK_M, CHUNK, FILL)  # fmt: skip
    tl.debug_barrier()  # the sentinels stored before any slot overwrites one
    tl.store(sorted_slots_ptr + row, s, mask=s_ok)


@triton.jit
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_slots_ptr, block_experts_ptr, T, E, stride_l,
                        num_blocks, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                        SLOTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                        FILL: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """One program for at most SLOTS slots: the route, offsets and scatter kernels' work in one launch."""
    pdl.gdc_sync(USE_PDL)
    s, s_ok, expert, weight, row, counts, e_ok = route_rows(logits_ptr, T, E, stride_l, TOP_K, K_PAD, RENORMALIZE,
                                                             SLOTS, BLOCK_E, BLOCK_M)  # fmt: skip
    store_routing(s, s_ok, expert, weight, row, counts, e_ok, weights_ptr, ids_ptr, sorted_slots_ptr,
                   block_experts_ptr, num_blocks, BLOCK_M, CHUNK, FILL)  # fmt: skip


def routing_buffers(t: int, e: int, top_k: int, block_m: int, device) -> tuple:
    """-> (num_blocks, block_experts, sorted_slots, weights, ids) for T = t tokens over E = e experts, empty."""
    n = t * top_k
    num_blocks = triton.cdiv(n + min(e, n) * (block_m - 1), block_m)
    return (num_blocks, torch.empty(num_blocks, dtype=torch.int32, device=device),
            torch.empty(num_blocks * block_m, dtype=torch.int32, device=device),
            torch.empty(t, top_k, dtype=torch.float32, device=device),
            torch.empty(t, top_k, dtype=torch.int32, device=device))  # fmt: skip


def _layout_chunk(block_e: int) -> int:
    """Blocks whose experts one step of _layout_blocks finds (a [CHUNK, BLOCK_E] comparison)."""
    return max(16, 4096 // block_e)


def one_program_routing(t: int, e: int, top_k: int, renormalize: bool, block_m: int) -> dict | None:
    """The constants of route_rows for t tokens over e experts, or None past what one program routes."""
    slots, block_e = triton.next_power_of_2(t * top_k), triton.next_power_of_2(e)
    if slots > ROUTE_ALIGN_MAX_SLOTS or slots * block_e > ROUTE_ALIGN_MAX_ELEMENTS:
        return None
    return dict(TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, SLOTS=slots,
                BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=_layout_chunk(block_e), FILL=1024)  # fmt: skip


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int):
    """router_logits [T, E] -> (weights float32 [T, k], ids int32 [T, k], sorted_slots int32 [num_blocks *
    block_m], block_experts int32 [num_blocks]): the routing and the slots grouped by expert (module docstring)."""
    t, e = router_logits.shape
    n = t * top_k
    dev = router_logits.device
    num_blocks, block_experts, sorted_slots, weights, ids = routing_buffers(t, e, top_k, block_m, dev)
    one_program = one_program_routing(t, e, top_k, renormalize, block_m)
    if one_program is not None:
        _route_align_kernel[(1,)](router_logits, weights, ids, sorted_slots, block_experts, t, e,
                                  router_logits.stride(0), num_blocks, USE_PDL=pdl.ENABLED, **one_program,
                                  **pdl.launch_kwargs())  # fmt: skip
        return weights, ids, sorted_slots, block_experts
    block_e = triton.next_power_of_2(e)
    ranks = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    counts = torch.zeros(e, dtype=torch.int32, device=dev)
    starts = torch.empty(e, dtype=torch.int32, device=dev)
    moe_routing.route(router_logits, top_k, renormalize, ranks, counts, weights, ids)
    _offsets_kernel[(1,)](counts, starts, block_experts, sorted_slots, n, num_blocks, e, BLOCK_M=block_m,
                          BLOCK_E=block_e, CHUNK=_layout_chunk(block_e), FILL=1024, USE_PDL=pdl.ENABLED,
                          **pdl.launch_kwargs())  # fmt: skip
    _scatter_kernel[(triton.cdiv(n, 1024),)](ids, ranks, starts, sorted_slots, n, BLOCK=1024, USE_PDL=pdl.ENABLED,
                                             **pdl.launch_kwargs())  # fmt: skip
    return weights, ids, sorted_slots, block_experts
