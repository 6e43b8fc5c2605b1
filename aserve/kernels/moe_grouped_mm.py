"""Mixture-of-experts with the experts' GEMMs through torch._grouped_mm: CUTLASS's grouped GEMM (TMA loads,
warp-specialised, each expert's rows as they are) on compute capability 9.0 and 10.0, for layers of large bf16
experts (Mixtral's) past a few tokens; fewer rows, other experts and fixed launch configurations keep
aserve/kernels/moe.py.

    router logits [T, E] ─route─▶ routing weights, ids, each slot's rank within its expert, counts [E]
                                                                                  (moe_routing.route)
    x [T, H] ─sort─▶ xs [T k, H] (slot s = t k + j's row of x at pos[s], experts' rows in expert order),
                     pos [T k], offs [E] (the row past each expert's rows)         (_sort_kernel)
    xs ─grouped mm w13─▶ [T k, 2 I] ─SiLU·mul─▶ [T k, I] ─grouped mm w2─▶ y [T k, H]
    y ─each token's k rows (pos), times their routing weights, added in float32 in slot order─▶ [T, H]
                                                                                  (moe.ordered_sum)

moe.py's grouped GEMMs instead pad each expert's rows to BLOCK_M and gather x's rows inside the tile loop; this path
pays for a sorted copy of x and a separate SiLU·mul. 2026-12-06 (bench/moe_kernel.py, docs/benchmarks.md):
Mixtral-8x7B's layer 10 % faster at 256 tokens and 5 % at 1,024 on an H100 (the engine on its shape cut to 8
layers: offline throughput 1.36x), 1 % slower and 9 % faster on an H200 (the whole model: offline 1.04x);
Qwen3-30B-A3B's (experts 30x smaller) 9 % slower at 2,048 tokens on an H100, 6 % on an H200: hence the rule by
expert size. Nothing reads the routing back to the host (CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import fused, moe, moe_routing, pdl

# Experts of at least this many w13 elements (2 I x H) take the library path: Mixtral-8x7B's 117 M do,
# Qwen3-30B-A3B's 3.1 M do not (module docstring).
LARGE_EXPERT_ELEMENTS = 1 << 26
# From this many routed rows per expert on (Mixtral: 256 tokens), the library's GEMMs; below, moe.py's. moe.py's
# layer against the library's at Mixtral's 64 tokens: 22 % faster on an H200, 6 % slower on an H100; at 256: 1 %
# faster on the H200, 10 % slower on the H100 (docs/benchmarks.md, 2026-12-06).
MIN_SLOTS_PER_EXPERT = 64


def available(w13: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these experts: bf16 on a GPU of compute capability 9.x or 10.x."""
    return (
        hasattr(torch, "_grouped_mm")
        and w13.is_cuda
        and w13.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(w13.device)[0] in (9, 10)
    )


def chosen_for(w13: torch.Tensor) -> bool:
    """Whether a layer with these experts takes this path: available, experts of LARGE_EXPERT_ELEMENTS or more, rows
    of x, of the activation and of the outputs in whole 16-byte units (the GEMM's TMA loads)."""
    _, two_i, h = w13.shape
    return available(w13) and w13[0].numel() >= LARGE_EXPERT_ELEMENTS and two_i % 16 == 0 and h % 8 == 0


@triton.jit
def _sort_kernel(x_ptr, ids_ptr, ranks_ptr, counts_ptr, xs_ptr, pos_ptr, offs_ptr, num_slots, E, H, stride_x,
                 TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                 USE_PDL: tl.constexpr):  # fmt: skip
    """BLOCK_S slots per program: each slot's row (its expert's first row, from the counts' running sum, plus its
    rank) stored in pos, and x's row of its token copied there; the first program stores offs."""
    pdl.gdc_sync(USE_PDL)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    counts = tl.load(counts_ptr + e, mask=e_ok, other=0)
    ends = tl.cumsum(counts, 0)
    if tl.program_id(0) == 0:
        tl.store(offs_ptr + e, ends, mask=e_ok)
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    ok = s < num_slots
    expert = tl.load(ids_ptr + s, mask=ok, other=0)
    first = tl.sum(tl.where(expert[:, None] == e[None, :], (ends - counts)[None, :], 0), 1)
    row = first + tl.load(ranks_ptr + s, mask=ok, other=0)
    tl.store(pos_ptr + s, row, mask=ok)
    src = x_ptr + (s // TOP_K).to(tl.int64)[:, None] * stride_x
    dst = xs_ptr + row.to(tl.int64)[:, None] * H
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = ok[:, None] & (cols < H)[None, :]
        tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=mask), mask=mask)


def sort_by_expert(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """x [T, H], router logits [T, E] -> (routing weights float32 [T, k], xs [T k, H]: x's rows in expert order,
    pos int32 [T k]: slot t k + j's row of xs, offs int32 [E]: the row past each expert's rows)."""
    t, h = x.shape
    e = router_logits.shape[1]
    n, dev = t * top_k, x.device
    ranks = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    counts = torch.zeros(e, dtype=torch.int32, device=dev)
    weights, ids = moe_routing.route(router_logits, top_k, renormalize, ranks, counts)
    xs = torch.empty(n, h, dtype=x.dtype, device=dev)
    pos = torch.empty(n, dtype=torch.int32, device=dev)
    offs = torch.empty(e, dtype=torch.int32, device=dev)
    block_s = 16
    _sort_kernel[(triton.cdiv(n, block_s),)](
        x, ids, ranks, counts, xs, pos, offs, n, e, h, x.stride(0), TOP_K=top_k, BLOCK_S=block_s,
        BLOCK_E=triton.next_power_of_2(e), BLOCK_H=min(256, triton.next_power_of_2(h)), USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(),
    )  # fmt: skip
    return weights, xs, pos, offs


def fused_moe(x, router_logits, w13, w2, top_k: int, renormalize: bool, config: dict | None = None, w13_scale=None,
              w2_scale=None) -> torch.Tensor:  # fmt: skip
    """moe.fused_moe's result (same arguments), with MIN_SLOTS_PER_EXPERT or more routed rows per expert of 16-bit
    experts through torch._grouped_mm (module docstring)."""
    t = x.shape[0]
    if config is not None or w13_scale is not None or t * top_k < MIN_SLOTS_PER_EXPERT * w13.shape[0]:
        return moe.fused_moe(x, router_logits, w13, w2, top_k, renormalize, config, w13_scale, w2_scale)
    return library_moe(x, router_logits, w13, w2, top_k, renormalize)


def library_moe(x, router_logits, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
    """x [T, H], router logits [T, E], w13 [E, 2 I, H], w2 [E, H, I] -> [T, H] through torch._grouped_mm at any
    size (module docstring)."""
    weights, xs, pos, offs = sort_by_expert(x, router_logits, top_k, renormalize)
    act = fused.silu_and_mul(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
    return moe.ordered_sum(torch._grouped_mm(act, w2.transpose(1, 2), offs=offs), pos, weights)
