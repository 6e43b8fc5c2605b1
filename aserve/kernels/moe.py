"""Fused mixture-of-experts on the GPU: routing, tokens grouped by expert, and one grouped GEMM per projection.

The routing and the grouping of each token's top_k `slots` (t * top_k + j) by expert, in blocks of BLOCK_M rows of
`sorted_slots` that each belong to one expert, are aserve/kernels/moe_align.py's route_and_align; then

    x [T, H] ─GEMM 1: rows x[slot // k] · w13[e]^T, SiLU·mul in the epilogue─▶ act [T * k, I]
    act      ─GEMM 2: rows act[slot] · w2[e]^T, times the slot's routing weight─▶ out [T * k, H] ─sum over k─▶ [T, H]

Up to FOLD_ROUTE_MAX_SLOTS slots, GEMM 1's programs route the slots themselves (_routed_gate_up_kernel: one launch
fewer).

FP8 experts (w13 / w2 in e4m3 with one float32 scale per row): past fp8_gemv.MAX_ROWS tokens, where the FP8
linears quantise their activations too, each GEMM's activations are rounded to e4m3 per row first (dynamic scales:
a row's largest magnitude / 448, aserve/kernels/fp8.py) and the GEMMs run FP8 MMAs, each output scaled by its row's
and its column's scale before the epilogue; fewer tokens keep them 16-bit (weight-only: the weight tiles converted
to the activations' dtype as they load), as the few-token kernels of aserve/kernels/moe_decode.py do.

Nothing reads the routing back to the host, so a decode step captures in a CUDA graph. Reference:
aserve/kernels/reference.py fused_moe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from aserve.kernels import fp8, fp8_gemv, fp8_reference, moe_align, moe_decode, pdl
from aserve.kernels.fused import silu_mul_rounded

# Launch configurations: BLOCK_M (the grouping's, shared by both GEMMs) and each GEMM's tiles, by tokens per
# expert: few (decode) stream the weights with one 16-row block per expert; many are GEMMs. The fastest of a grid
# with one tile for both GEMMs on an H200 at the Qwen3-30B-A3B shape (bench/moe_kernel.py --tune, 2026-12-02):
# 2,048 tokens 619 us for the two GEMMs (250 TFLOP/s, 38 % of cuBLAS's dense rate); one token 36 us (2.1 TB/s).
SMALL_CONFIG = dict(BLOCK_M=16, gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
                    down=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4))  # fmt: skip
LARGE_CONFIG = dict(BLOCK_M=64, gate_up=dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
                    down=dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4))  # fmt: skip
# From MANY_SLOTS_PER_EXPERT rows per expert on (2,048 tokens of Qwen3-30B-A3B: a prefill chunk), 16-bit experts take
# 128-row blocks and 8-warp tiles: each GEMM tuned on its own at 2,048 tokens, 559 us for the two against
# LARGE_CONFIG's 619 on an H200 (2026-12-03), 610 against 685 on an H100 (2026-12-06). FP8 experts keep LARGE_CONFIG
# (their tiles were not swept).
# SHRINK 1: an expert's last block, mostly padding where its rows are a little over a multiple of 128, runs a 64-row
# tile when its rows fit: the two GEMMs 352.8 + 200.5 us against 376.4 + 235.6 at 2,048 tokens on an H100, the same
# bits (bench/moe_kernel.py, 2026-12-07).
MANY_CONFIG = dict(BLOCK_M=128,
                   gate_up=dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, SHRINK=1),
                   down=dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, SHRINK=1))  # fmt: skip
MANY_SLOTS_PER_EXPERT = 128


# Up to this many slots on the grouped path (two tokens at top-8), every program of the gate/up GEMM routes them all
# itself and the routing's launch goes (_routed_gate_up_kernel; the same bits as the separate launch). H100,
# Qwen3-30B-A3B shape, deterministic batch 1: 0.05 ms off a 3.58 ms graph (docs/benchmarks.md, 2026-12-05).
FOLD_ROUTE_MAX_SLOTS = 16


# Deterministic mode (fused_moe's fixed_order_sum without a config): SMALL_CONFIG up to MANY_SLOTS_PER_EXPERT slots
# an expert, this from there. Both sum K in steps of 128 (SMALL_CONFIG's BLOCK_K), so a token's bits do not depend on
# which of the two its step's token count picks, where the device's MMAs sum a row's K step whatever the tile around
# it (BatchInvariantMoEMethod uses it only once deterministic_tiles_agree has shown that on the device).
DETERMINISTIC_MANY_CONFIG = dict(
    BLOCK_M=64,
    gate_up=dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    down=dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
)


def moe_config(num_slots: int, num_experts: int, fp8_experts: bool = False, deterministic: bool = False) -> dict:
    """The launch configuration for T * k = num_slots routed rows over num_experts experts."""
    many = num_slots >= MANY_SLOTS_PER_EXPERT * num_experts
    if deterministic:
        return DETERMINISTIC_MANY_CONFIG if many else SMALL_CONFIG
    if num_slots <= 16 * num_experts:
        return SMALL_CONFIG
    return LARGE_CONFIG if fp8_experts or not many else MANY_CONFIG


_TILES_AGREE: dict[tuple, bool] = {}  # deterministic_tiles_agree's answers, by shapes, dtype, routing and device


def deterministic_tiles_agree(w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool) -> bool:
    """Whether every token's output is the same bits through DETERMINISTIC_MANY_CONFIG as through SMALL_CONFIG
    (fixed-order sums) on these experts' device: random tokens enough to pick the former, run through both (once
    per shape, dtype and routing)."""
    key = (tuple(w13.shape), tuple(w2.shape), w13.dtype, top_k, renormalize, w13.device)
    if key not in _TILES_AGREE:
        _TILES_AGREE[key] = _tiles_agree(w13, w2, top_k, renormalize)
    return _TILES_AGREE[key]


def _tiles_agree(w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool) -> bool:
    num_experts, _, hidden = w13.shape
    t = triton.cdiv(MANY_SLOTS_PER_EXPERT * num_experts, top_k)
    gen = torch.Generator(device=w13.device).manual_seed(0)
    x = torch.randn(t, hidden, generator=gen, device=w13.device).to(w13.dtype)
    logits = torch.randn(t, num_experts, generator=gen, device=w13.device)
    try:
        many = fused_moe(x, logits, w13, w2, top_k, renormalize, fixed_order_sum=True)
        small = fused_moe(x, logits, w13, w2, top_k, renormalize, SMALL_CONFIG, fixed_order_sum=True)
    except (RuntimeError, OutOfResources):  # the tiles do not fit this device
        return False
    return torch.equal(many, small)


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
def _gemm_tile(a_ptr, b_ptr, c_ptr, weights_ptr, a_scale_ptr, b_scale_ptr, expert, slots, pid_n, num_slots, N, K,
               stride_a, stride_be, stride_bn, stride_c, stride_se, ROW_DIV: tl.constexpr, GATED: tl.constexpr,
               WEIGHTED: tl.constexpr, A_SCALED: tl.constexpr, B_SCALED: tl.constexpr, IEEE: tl.constexpr,
               EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One tile of a grouped GEMM: the rows `slots` [BLOCK_M] (num_slots: padding) of one expert, column block
    pid_n (_grouped_gemm_kernel)."""
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


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, a_scale_ptr, b_scale_ptr, sorted_slots_ptr,
                         block_experts_ptr, num_slots, N, K, num_blocks, stride_a, stride_be, stride_bn, stride_c,
                         stride_se, NUM_EXPERTS: tl.constexpr, ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                         WEIGHTED: tl.constexpr, A_SCALED: tl.constexpr, B_SCALED: tl.constexpr,
                         IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, SHRINK: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """c[slot, n] = a[slot // ROW_DIV] . b[expert, n] for the BLOCK_M slots of one block (one expert) and BLOCK_N
    outputs. GATED: b holds [gate (N rows) | up (N rows)] and c is silu(gate) * up; WEIGHTED: c times the slot's
    routing weight; B_SCALED: b is e4m3 and each accumulator column times its row's scale b_scale[expert, n]
    (float32, [E, rows of b]) before the epilogue, b's tiles converted to a's dtype as they load unless A_SCALED:
    a is e4m3 too (FP8 MMAs) and each accumulator row times its a row's scale a_scale[slot // ROW_DIV]. Float32
    accumulators; padding rows read row 0 and are never stored. SHRINK (0-2): a block whose routed rows (first in
    the block, padding after them) fit a half / quarter of it runs a tile of that height instead (an expert's last
    block is mostly padding)."""
    pdl.gdc_sync(USE_PDL)
    pid_m, pid_n = grouped_tile(tl.program_id(0), N, num_blocks, GROUP_M, BLOCK_N)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= NUM_EXPERTS:
        return
    first = sorted_slots_ptr + pid_m * BLOCK_M
    slots = tl.load(first + tl.arange(0, BLOCK_M))
    rows = tl.sum((slots < num_slots).to(tl.int32), 0) if SHRINK > 0 else BLOCK_M
    if SHRINK > 1 and rows <= BLOCK_M // 4:
        _gemm_tile(a_ptr, b_ptr, c_ptr, weights_ptr, a_scale_ptr, b_scale_ptr, expert,
                   tl.load(first + tl.arange(0, BLOCK_M // 4)), pid_n, num_slots, N, K, stride_a, stride_be, stride_bn,
                   stride_c, stride_se, ROW_DIV, GATED, WEIGHTED, A_SCALED, B_SCALED, IEEE, EVEN_K, BLOCK_M // 4,
                   BLOCK_N, BLOCK_K)  # fmt: skip
    elif SHRINK > 0 and rows <= BLOCK_M // 2:
        _gemm_tile(a_ptr, b_ptr, c_ptr, weights_ptr, a_scale_ptr, b_scale_ptr, expert,
                   tl.load(first + tl.arange(0, BLOCK_M // 2)), pid_n, num_slots, N, K, stride_a, stride_be, stride_bn,
                   stride_c, stride_se, ROW_DIV, GATED, WEIGHTED, A_SCALED, B_SCALED, IEEE, EVEN_K, BLOCK_M // 2,
                   BLOCK_N, BLOCK_K)  # fmt: skip
    else:
        _gemm_tile(a_ptr, b_ptr, c_ptr, weights_ptr, a_scale_ptr, b_scale_ptr, expert, slots, pid_n, num_slots, N, K,
                   stride_a, stride_be, stride_bn, stride_c, stride_se, ROW_DIV, GATED, WEIGHTED, A_SCALED, B_SCALED,
                   IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip


@triton.jit
def _routed_gate_up_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_slots_ptr, block_experts_ptr, a_ptr, b_ptr,
                           c_ptr, b_scale_ptr, T, E, stride_l, N, K, num_blocks, stride_a, stride_be, stride_bn,
                           stride_c, stride_se, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                           SLOTS: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
                           B_SCALED: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           USE_PDL: tl.constexpr):  # fmt: skip
    """_route_align_kernel and the gate/up _grouped_gemm_kernel in one launch, for at most SLOTS slots: every
    program routes all the slots in its registers (moe_align.route_rows) and takes its block's expert and rows
    from that; program 0 also stores the routing for the down GEMM. The tiles are _grouped_gemm_kernel's: each
    slot's result is the same bits."""
    pdl.gdc_sync(USE_PDL)
    pid = tl.program_id(0)
    s, s_ok, expert, weight, row, counts, e_ok = moe_align.route_rows(
        logits_ptr, T, E, stride_l, TOP_K, K_PAD, RENORMALIZE, SLOTS, BLOCK_E, BLOCK_M
    )
    if pid == 0:
        moe_align.store_routing(s, s_ok, expert, weight, row, counts, e_ok, weights_ptr, ids_ptr, sorted_slots_ptr,
                       block_experts_ptr, num_blocks, BLOCK_M, CHUNK, FILL)  # fmt: skip
    pid_m, pid_n = grouped_tile(pid, N, num_blocks, GROUP_M, BLOCK_N)
    ends, _ = moe_align.expert_ends(counts, BLOCK_M)
    block_expert = tl.sum(((ends <= pid_m * BLOCK_M) & e_ok).to(tl.int32), 0)
    if block_expert >= E:
        return
    tile_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    here = (row[None, :] == tile_rows[:, None]) & s_ok[None, :]  # [BLOCK_M, SLOTS]: the slot on each tile row
    slots = tl.sum(tl.where(here, s[None, :], 0), 1) + tl.where(tl.max(here.to(tl.int32), 1) > 0, 0, T * TOP_K)
    _gemm_tile(a_ptr, b_ptr, c_ptr, c_ptr, c_ptr, b_scale_ptr, block_expert, slots, pid_n, T * TOP_K, N, K, stride_a,
               stride_be, stride_bn, stride_c, stride_se, TOP_K, True, False, False, B_SCALED, IEEE, EVEN_K, BLOCK_M,
               BLOCK_N, BLOCK_K)  # fmt: skip


def _gemm_config(config: dict, n: int, k: int, fp8_mma: bool) -> dict:
    """A grouped GEMM's tiles for n outputs over k inputs: `config`'s, no wider than the shape needs."""
    cfg = dict(config)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], max(16, triton.next_power_of_2(n)))  # small shapes (tests): no idle tiles
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(32 if fp8_mma else 16, triton.next_power_of_2(k)))  # FP8 MMA K
    cfg["EVEN_K"] = k % cfg["BLOCK_K"] == 0
    return cfg


def routed_gate_up(x, router_logits, w13, act, top_k: int, renormalize: bool, block_m: int, config: dict,
                   w13_scale=None):  # fmt: skip
    """route_and_align and the gate/up grouped_gemm (x 16-bit or float32: no FP8 activations) in one launch where
    one program routes all the slots (moe_align.one_program_routing); otherwise the two. -> (weights, ids, sorted_slots,
    block_experts) as route_and_align's, act [T * k, I] written."""
    t, e = router_logits.shape
    one_program = moe_align.one_program_routing(t, e, top_k, renormalize, block_m)
    if one_program is None:
        routing = moe_align.route_and_align(router_logits, top_k, renormalize, block_m)
        grouped_gemm(x, w13, act, routing[2], routing[3], block_m, config, top_k, gated=True, b_scale=w13_scale)
        return routing
    num_experts, two_i, k = w13.shape
    n = two_i // 2
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and act.stride(-1) == 1 and act.shape == (t * top_k, n)
    num_blocks, block_experts, sorted_slots, weights, ids = moe_align.routing_buffers(t, e, top_k, block_m, x.device)
    cfg = _gemm_config(config, n, k, False)
    cfg.pop("SHRINK", None)  # (its blocks hold a few slots: the grouped GEMM's full height)
    _routed_gate_up_kernel[(num_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)](
        router_logits, weights, ids, sorted_slots, block_experts, x, w13, act,
        w13_scale if w13_scale is not None else act, t, e, router_logits.stride(0), n, k, num_blocks, x.stride(0),
        w13.stride(0), w13.stride(1), act.stride(0), w13_scale.stride(0) if w13_scale is not None else 0,
        B_SCALED=w13_scale is not None, IEEE=x.dtype == torch.float32, USE_PDL=pdl.ENABLED,
        **one_program, **cfg, **pdl.launch_kwargs(),
    )  # fmt: skip
    return weights, ids, sorted_slots, block_experts


def grouped_gemm(a, b, out, sorted_slots, block_experts, block_m: int, config: dict, row_div: int, gated: bool,
                 weights=None, b_scale=None, a_scale=None) -> torch.Tensor:  # fmt: skip
    """out[slot] = a[slot // row_div] @ b[expert]^T for every routed slot (GATED: b is [E, 2N, K] and out is
    silu(gate) * up [slots, N]; weights: each row times its slot's routing weight), the slots grouped in blocks of
    block_m by route_and_align; `config`: the GEMM's tiles (moe_config's "gate_up" / "down"); b_scale: b is e4m3
    with one float32 scale per row, [E, rows of b] (None: b has a's dtype); a_scale: a is e4m3 too, with one
    float32 scale per row (a [rows, K], a_scale [rows]: FP8 MMAs). Returns out."""
    num_experts, n_rows, k = b.shape
    n = n_rows // 2 if gated else n_rows
    assert a.stride(-1) == 1 and b.stride(-1) == 1 and out.stride(-1) == 1 and out.shape[1] == n
    if b_scale is not None:
        assert b.dtype == torch.float8_e4m3fn and b_scale.shape == b.shape[:2] and b_scale.stride(-1) == 1
    if a_scale is not None:
        assert b_scale is not None and a.dtype == torch.float8_e4m3fn and a_scale.shape == (a.shape[0],)
    cfg = {"SHRINK": 0, **_gemm_config(config, n, k, a_scale is not None)}
    num_blocks = block_experts.numel()
    assert sorted_slots.numel() == num_blocks * block_m, "route_and_align ran with another BLOCK_M"
    grid = (num_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, a_scale if a_scale is not None else out,
        b_scale if b_scale is not None else out, sorted_slots, block_experts, out.shape[0], n, k, num_blocks,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0), b_scale.stride(0) if b_scale is not None else 0,
        NUM_EXPERTS=num_experts, ROW_DIV=row_div, GATED=gated, WEIGHTED=weights is not None,
        A_SCALED=a_scale is not None, B_SCALED=b_scale is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m, USE_PDL=pdl.ENABLED, **cfg, **pdl.launch_kwargs(),
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
    float32, in an order that depends on nothing but the token (deterministic mode: then each token's result is the
    same bits whatever else the step holds, with a fixed `config`, or without one (the deterministic
    configurations by slots, no decode kernels) where deterministic_tiles_agree)."""
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    if config is None and not fixed_order_sum and moe_decode.use_decode(t, top_k, num_experts):
        act, weights, ids = moe_decode.gate_up(x, router_logits, w13, top_k, renormalize, w13_scale)
        return moe_decode.down_sum(act, w2, ids, weights, w2_scale)
    cfg = config or moe_config(t * top_k, num_experts, w13_scale is not None, fixed_order_sum)
    act = torch.empty(t * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    fp8_activations = w13_scale is not None and t > fp8_gemv.MAX_ROWS
    if t * top_k <= FOLD_ROUTE_MAX_SLOTS and not fp8_activations:
        weights, _, sorted_slots, block_experts = routed_gate_up(x, router_logits, w13, act, top_k, renormalize,
                                                                 cfg["BLOCK_M"], cfg["gate_up"], w13_scale)  # fmt: skip
    else:
        routing = moe_align.route_and_align(router_logits, top_k, renormalize, cfg["BLOCK_M"])
        weights, _, sorted_slots, block_experts = routing
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
def _ordered_sum_kernel(x_ptr, pos_ptr, weights_ptr, out_ptr, H, TOP_K: tl.constexpr, GATHERED: tl.constexpr,
                        BLOCK: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """out[t, cols] = x[t k, cols] + x[t k + 1, cols] + ... in float32, one after the other, rounded once; GATHERED:
    row pos[t k + j] of x instead, times weights[t, j]."""
    pdl.gdc_sync(USE_PDL)
    t = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(pos_ptr + t * TOP_K + j).to(tl.int64) if GATHERED else t * TOP_K + j
        value = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        total += tl.load(weights_ptr + t * TOP_K + j) * value if GATHERED else value
    tl.store(out_ptr + t * H + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def ordered_sum(x: torch.Tensor, pos: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, k, H] (contiguous) -> [T, H]: each row's k vectors added in order j = 0 .. k - 1 (float32, rounded
    once), whatever T: deterministic mode's sum of a token's expert outputs, in one launch. With pos [T k] and
    weights [T, k]: x is [T k, H] and token t's j-th vector is x[pos[t k + j]] times weights[t, j]
    (aserve/kernels/moe_grouped_mm.py's rows in expert order)."""
    h = x.shape[-1]
    t, top_k = weights.shape if weights is not None else x.shape[:2]
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(h))
    _ordered_sum_kernel[(triton.cdiv(h, block), t)](
        x, pos if pos is not None else x, weights if weights is not None else x, out, h, TOP_K=top_k,
        GATHERED=pos is not None, BLOCK=block, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(),
    )  # fmt: skip
    return out
