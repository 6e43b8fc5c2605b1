"""Fused mixture-of-experts on the GPU: routing, tokens grouped by expert, and one grouped GEMM per projection.

Each token t picks top_k experts; its `slots` are t * top_k + j. The slots are grouped by expert, each group padded
to a multiple of BLOCK_M (vLLM's moe_align_block_size), so that every BLOCK_M rows of `sorted_slots` belong to one
expert and a GEMM tile reads one expert's weights:

    router logits [T, E] ─route─▶ weights, ids [T, k]; each slot's rank among its expert's slots; counts [E]
                         ─offsets─▶ expert e's rows start at sum of padded counts before it; block -> expert
                         ─scatter─▶ sorted_slots [num_blocks * BLOCK_M] (padding: the sentinel T * k)

    sorted_slots:  | e0 s3 s8 s9 pad | e1 s0 pad pad pad | e3 s1 s2 s5 s6 | e3 s7 pad pad pad | (E: unused blocks)

    x [T, H] ─GEMM 1: rows x[slot // k] · w13[e]^T, SiLU·mul in the epilogue─▶ act [T * k, I]
    act      ─GEMM 2: rows act[slot] · w2[e]^T, times the slot's routing weight─▶ out [T * k, H] ─sum over k─▶ [T, H]

FP8 experts (w13 / w2 in e4m3 with one float32 scale per row): past fp8_gemv.MAX_ROWS tokens, where the FP8
linears quantise their activations too, each GEMM's activations are rounded to e4m3 per row first (dynamic scales:
a row's largest magnitude / 448, aserve/kernels/fp8.py) and the GEMMs run FP8 MMAs, each output scaled by its row's
and its column's scale before the epilogue; fewer tokens keep them 16-bit (weight-only: the weight tiles converted
to the activations' dtype as they load), as the few-token kernels of aserve/kernels/moe_decode.py do.

The three routing kernels (route: aserve/kernels/moe_routing.py) need no host synchronisation (the number of blocks
is the bound T * k + min(E, T * k) * (BLOCK_M - 1) rounded up, and blocks past the last expert return at once), so a
decode step captures in a CUDA graph. A slot's rank within its expert comes from an atomic counter: the order of
slots inside an expert's rows varies from run to run, each slot's result does not. Up to ROUTE_ALIGN_MAX_SLOTS
slots, one program does all three (_route_align_kernel), the ranks counted in slot order. References:
aserve/kernels/reference.py select_experts, fused_moe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import fp8, fp8_gemv, fp8_reference, moe_decode, moe_routing, pdl
from aserve.kernels.fused import silu_mul_rounded

# Launch configurations: BLOCK_M (the grouping's, shared by both GEMMs) and each GEMM's tiles, by tokens per
# expert: few (decode) stream the weights with one 16-row block per expert; many are GEMMs. The fastest of a grid
# with one tile for both GEMMs on an H200 at the Qwen3-30B-A3B shape (bench/moe_kernel.py --tune, 2026-12-02):
# 2,048 tokens 619 us for the two GEMMs (250 TFLOP/s, 38 % of cuBLAS's dense rate); one token 36 us (2.1 TB/s).
SMALL_CONFIG = dict(BLOCK_M=16, gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
                    down=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4))  # fmt: skip
LARGE_CONFIG = dict(BLOCK_M=64, gate_up=dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
                    down=dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4))  # fmt: skip


# Up to this many slots (and slots x experts, both padded to powers of two) the routing and grouping run as one
# program (_route_align_kernel: one launch for the four of route, its zeroed counters, offsets and scatter).
ROUTE_ALIGN_MAX_SLOTS = 128
ROUTE_ALIGN_MAX_ELEMENTS = 16384


def moe_config(num_slots: int, num_experts: int) -> dict:
    """The launch configuration for T * k = num_slots routed rows over num_experts experts."""
    return SMALL_CONFIG if num_slots <= 16 * num_experts else LARGE_CONFIG


@triton.jit
def _layout_blocks(counts, e_ok, block_experts_ptr, sorted_slots_ptr, num_slots, num_blocks, BLOCK_M: tl.constexpr,
                   CHUNK: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    """From the experts' counts [BLOCK_E] (e_ok: the columns below E): each block's expert (E past the last one)
    stored, every row of sorted_slots set to the sentinel num_slots (the slots then overwrite theirs), and each
    expert's first row returned (counts padded to BLOCK_M, summed)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        # experts whose rows end at or before the block's first row: the block's expert index
        before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & e_ok[None, :]
        tl.store(block_experts_ptr + b, tl.sum(before.to(tl.int32), 1), mask=b < num_blocks)
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
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_slots_ptr, block_experts_ptr, T, E, stride_l,
                        num_blocks, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                        SLOTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                        FILL: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """One program for at most SLOTS slots: the route, offsets and scatter kernels' work in one launch, each slot's
    rank within its expert counted from the slots before it (no counters to zero first)."""
    pdl.gdc_sync(USE_PDL)
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
    tl.store(ids_ptr + s, expert, mask=s_ok)
    tl.store(weights_ptr + s, tl.sum(tl.where(pick, top_w, 0.0), 1), mask=s_ok)
    rank = tl.sum(((expert[:, None] == expert[None, :]) & (s[None, :] < s[:, None])).to(tl.int32), 1)
    chose = (expert[:, None] == e[None, :]) & s_ok[:, None]  # [SLOTS, BLOCK_E]
    starts = _layout_blocks(tl.sum(chose.to(tl.int32), 0), e_ok, block_experts_ptr, sorted_slots_ptr, n, num_blocks,
                            BLOCK_M, CHUNK, FILL)  # fmt: skip
    row = tl.sum(tl.where(chose, starts[None, :], 0), 1) + rank
    tl.debug_barrier()  # the sentinels stored before any slot overwrites one
    tl.store(sorted_slots_ptr + row, s, mask=s_ok)


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int):
    """router_logits [T, E] -> (weights float32 [T, k], ids int32 [T, k], sorted_slots int32 [num_blocks *
    block_m], block_experts int32 [num_blocks]): the routing and the slots grouped by expert (module docstring)."""
    t, e = router_logits.shape
    n = t * top_k
    dev = router_logits.device
    num_blocks = triton.cdiv(n + min(e, n) * (block_m - 1), block_m)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    sorted_slots = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(e)
    chunk = max(16, 4096 // block_e)  # blocks whose experts one step of the layout finds
    slots = triton.next_power_of_2(n)
    if slots <= ROUTE_ALIGN_MAX_SLOTS and slots * block_e <= ROUTE_ALIGN_MAX_ELEMENTS:
        weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
        ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
        _route_align_kernel[(1,)](
            router_logits, weights, ids, sorted_slots, block_experts, t, e, router_logits.stride(0), num_blocks,
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, SLOTS=slots, BLOCK_E=block_e,
            BLOCK_M=block_m, CHUNK=chunk, FILL=1024, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(),
        )  # fmt: skip
        return weights, ids, sorted_slots, block_experts
    ranks = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    counts = torch.zeros(e, dtype=torch.int32, device=dev)
    starts = torch.empty(e, dtype=torch.int32, device=dev)
    weights, ids = moe_routing.route(router_logits, top_k, renormalize, ranks, counts)
    _offsets_kernel[(1,)](counts, starts, block_experts, sorted_slots, n, num_blocks, e, BLOCK_M=block_m,
                          BLOCK_E=block_e, CHUNK=chunk, FILL=1024, USE_PDL=pdl.ENABLED,
                          **pdl.launch_kwargs())  # fmt: skip
    _scatter_kernel[(triton.cdiv(n, 1024),)](ids, ranks, starts, sorted_slots, n, BLOCK=1024, USE_PDL=pdl.ENABLED,
                                             **pdl.launch_kwargs())  # fmt: skip
    return weights, ids, sorted_slots, block_experts


@triton.jit
def grouped_tile(pid, N, num_blocks, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program pid's (row block, column block) of a grouped GEMM: GROUP_M consecutive row blocks per column, so that
    consecutive programs share a column of the same expert's weights (L2 reuse)."""
    group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // group) * GROUP_M
    rows_in_group = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % group) % rows_in_group, (pid % group) // rows_in_group


@triton.jit
def store_tile(
    c_ptr,
    acc,
    acc_up,
    weights_ptr,
    slots,
    valid,
    pid_n,
    N,
    stride_c,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A grouped GEMM's epilogue: the tile's rows (slots; `valid`: not padding) of column block pid_n into c, as
    silu(acc) * acc_up (GATED), times each slot's routing weight (WEIGHTED), or as they are."""
    dtype = c_ptr.dtype.element_ty
    if GATED:  # the projections rounded to the model's dtype, as separate GEMMs then silu_and_mul would round
        out = silu_mul_rounded(acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype)
    elif WEIGHTED:
        out = (acc * tl.load(weights_ptr + slots, mask=valid, other=0.0)[:, None]).to(dtype)
    else:
        out = acc.to(dtype)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_c + cols[None, :]
    tl.store(c_ptrs, out, mask=valid[:, None] & (cols < N)[None, :])


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, a_scale_ptr, b_scale_ptr, sorted_slots_ptr,
                         block_experts_ptr, num_slots, N, K, num_blocks, stride_a, stride_be, stride_bn, stride_c,
                         stride_se, NUM_EXPERTS: tl.constexpr, ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                         WEIGHTED: tl.constexpr, A_SCALED: tl.constexpr, B_SCALED: tl.constexpr,
                         IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """c[slot, n] = a[slot // ROW_DIV] . b[expert, n] for the BLOCK_M slots of one block (one expert) and BLOCK_N
    outputs. GATED: b holds [gate (N rows) | up (N rows)] and c is silu(gate) * up; WEIGHTED: c times the slot's
    routing weight; B_SCALED: b is e4m3 and each accumulator column times its row's scale b_scale[expert, n]
    (float32, [E, rows of b]) before the epilogue, b's tiles converted to a's dtype as they load unless A_SCALED:
    a is e4m3 too (FP8 MMAs) and each accumulator row times its a row's scale a_scale[slot // ROW_DIV]. Float32
    accumulators; padding rows read row 0 and are never stored."""
    pdl.gdc_sync(USE_PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), N, num_blocks, GROUP_M, BLOCK_N)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= NUM_EXPERTS:
        return
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = tl.where(valid, slots // ROW_DIV, 0).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # columns past N repeat earlier ones, never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    up_ptrs = b_ptrs + N * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        if B_SCALED and not A_SCALED:
            b = b.to(a.dtype)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if GATED:
            if EVEN_K:
                u = tl.load(up_ptrs)
            else:
                u = tl.load(up_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
            if B_SCALED and not A_SCALED:
                u = u.to(a.dtype)
            if IEEE:
                acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, u, acc_up)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if B_SCALED:
        scale_row = b_scale_ptr + expert.to(tl.int64) * stride_se
        acc = acc * tl.load(scale_row + offs_n)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scale_row + N + offs_n)[None, :]
    if A_SCALED:
        a_scales = tl.load(a_scale_ptr + rows)[:, None]
        acc = acc * a_scales
        if GATED:
            acc_up = acc_up * a_scales
    store_tile(c_ptr, acc, acc_up, weights_ptr, slots, valid, pid_n, N, stride_c, GATED, WEIGHTED, BLOCK_N)


def grouped_gemm(a, b, out, sorted_slots, block_experts, block_m: int, config: dict, row_div: int, gated: bool,
                 weights=None, b_scale=None, a_scale=None) -> torch.Tensor:  # fmt: skip
    """out[slot] = a[slot // row_div] @ b[expert]^T for every routed slot (GATED: b is [E, 2N, K] and out is
    silu(gate) * up [slots, N]; weights: each row times its slot's routing weight), the slots grouped in blocks of
    block_m by route_and_align; `config`: the GEMM's tiles (moe_config's "gate_up" / "down"); b_scale: b is e4m3
    with one float32 scale per row, [E, rows of b] (None: b has a's dtype); a_scale: a is e4m3 too, with one
    float32 scale per row (a [rows, K], a_scale [rows]: FP8 MMAs). Returns out."""
    cfg = dict(config)
    num_experts, n_rows, k = b.shape
    n = n_rows // 2 if gated else n_rows
    assert a.stride(-1) == 1 and b.stride(-1) == 1 and out.stride(-1) == 1 and out.shape[1] == n
    if b_scale is not None:
        assert b.dtype == torch.float8_e4m3fn and b_scale.shape == b.shape[:2] and b_scale.stride(-1) == 1
    if a_scale is not None:
        assert b_scale is not None and a.dtype == torch.float8_e4m3fn and a_scale.shape == (a.shape[0],)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], max(16, triton.next_power_of_2(n)))  # small shapes (tests): no idle tiles
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(16 if a_scale is None else 32, triton.next_power_of_2(k)))  # FP8 MMA K
    num_blocks = block_experts.numel()
    assert sorted_slots.numel() == num_blocks * block_m, "route_and_align ran with another BLOCK_M"
    grid = (num_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, a_scale if a_scale is not None else out,
        b_scale if b_scale is not None else out, sorted_slots, block_experts, out.shape[0], n, k, num_blocks,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0), b_scale.stride(0) if b_scale is not None else 0,
        NUM_EXPERTS=num_experts, ROW_DIV=row_div, GATED=gated, WEIGHTED=weights is not None,
        A_SCALED=a_scale is not None, B_SCALED=b_scale is not None, IEEE=a.dtype == torch.float32,
        EVEN_K=k % cfg["BLOCK_K"] == 0, BLOCK_M=block_m, USE_PDL=pdl.ENABLED, **cfg, **pdl.launch_kwargs(),
    )  # fmt: skip
    return out


def _per_token(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [rows, K] -> (e4m3 [rows, K], float32 scales [rows]): each row's largest magnitude / 448 its scale (torch
    ops off the GPU: Triton's interpreter rounds some e4m3 casts wrongly)."""
    q, scale = (fp8.quantize_per_token if a.is_cuda else fp8_reference.quantize_per_token)(a)
    return q, scale.view(-1)


def fused_moe(x, router_logits, w13, w2, top_k: int, renormalize: bool, config: dict | None = None, w13_scale=None,
              w2_scale=None, fixed_order_sum: bool = False) -> torch.Tensor:  # fmt: skip
    """x [T, H], router logits [T, E], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] -> [T, H]: each
    token's top_k experts' outputs weighted by their routing weights and summed (module docstring). FP8 experts:
    w13 / w2 e4m3 with float32 scales per row, w13_scale [E, 2I] and w2_scale [E, H] (module docstring: past
    fp8_gemv.MAX_ROWS tokens the activations are rounded to e4m3 per row too). `config`: the grouped GEMMs' launch
    configuration; None: chosen by the number of slots, and a few tokens (moe_decode.use_decode) take aserve/
    kernels/moe_decode.py's kernels instead. fixed_order_sum: a token's k outputs added one after the other in
    float32, in an order that depends on nothing but the token (deterministic mode, with a fixed `config`: then each
    token's result is the same bits whatever else the step holds)."""
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    if config is None and moe_decode.use_decode(t, top_k, num_experts):
        act, weights, ids = moe_decode.gate_up(x, router_logits, w13, top_k, renormalize, w13_scale)
        return moe_decode.down_sum(act, w2, ids, weights, w2_scale)
    cfg = config or moe_config(t * top_k, num_experts)
    weights, _, sorted_slots, block_experts = route_and_align(router_logits, top_k, renormalize, cfg["BLOCK_M"])
    act = torch.empty(t * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    fp8_activations = w13_scale is not None and t > fp8_gemv.MAX_ROWS
    a, a_scale = _per_token(x) if fp8_activations else (x, None)
    grouped_gemm(a, w13, act, sorted_slots, block_experts, cfg["BLOCK_M"], cfg["gate_up"], top_k, gated=True,
                 b_scale=w13_scale, a_scale=a_scale)  # fmt: skip
    out = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)
    a, a_scale = _per_token(act) if fp8_activations else (act, None)
    grouped_gemm(a, w2, out, sorted_slots, block_experts, cfg["BLOCK_M"], cfg["down"], 1, False, weights, w2_scale,
                 a_scale)  # fmt: skip
    out = out.view(t, top_k, h)
    return ordered_sum(out) if fixed_order_sum else out.sum(1)


@triton.jit
def _ordered_sum_kernel(x_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, cols] = x[t, 0, cols] + x[t, 1, cols] + ... in float32, one after the other, rounded once."""
    pdl.gdc_sync(USE_PDL)
    t = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        total += tl.load(x_ptr + (t * TOP_K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """x [T, k, H] (contiguous) -> [T, H]: each row's k vectors added in order j = 0 .. k - 1 (float32, rounded
    once), whatever T: deterministic mode's sum of a token's expert outputs, in one launch."""
    t, top_k, h = x.shape
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(h))
    _ordered_sum_kernel[(triton.cdiv(h, block), t)](x, out, h, TOP_K=top_k, BLOCK=block, USE_PDL=pdl.ENABLED,
                                                    **pdl.launch_kwargs())  # fmt: skip
    return out
