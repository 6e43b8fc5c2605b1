"""The fused MoE layer's grouped GEMMs with the intermediate rows in sorted order: opt-in, for many tokens per expert.

aserve/kernels/moe.py's grouped GEMMs gather their A rows by slot (x[slot // k] for gate/up, act[slot] for down) and
store by slot. Here the gate/up GEMM stores its activation at the row of `sorted_slots` that holds the slot (the
padded, expert-grouped layout of aserve/kernels/moe_align.py), so the down GEMM reads each tile's A rows as one
contiguous [BLOCK_M, BLOCK_K] block, and only the down GEMM's epilogue scatters, by slot, times the routing weight:

    x [T, H] ─gather by slot // k (or gather_x: a copy in sorted order first)─▶ GEMM 1 ─▶ act_sorted [rows, I]
    act_sorted (row r of the layout: contiguous tiles) ─GEMM 2, times the weight─▶ out[slot] [T * k, H] ─sum over k─▶

    sorted rows:  | e0: s3 s8 s9 pad | e1: s0 pad pad pad | e3: s1 s2 s5 s6 | ...   (BLOCK_M rows a block, one expert)
    act_sorted:   the same rows; padding rows keep whatever the buffer held (an MMA row never reaches another
                  row's result, and padding rows are never stored)

With `tma` on, the contiguous operands load as TMA tensor descriptors (Hopper's bulk copies, host-side
triton.tools.tensor_descriptor): the experts' weights as [E * rows, K] (a tile's rows past the expert's N belong to
the next expert or lie past the end, zero-filled: their columns are never stored), act_sorted, and with `gather_x`
the copy of x in sorted order (gather_rows: T * k rows of H, one launch) so that GEMM 1's A is contiguous too. With
`tma` off the same rows load through pointers (the layout's effect alone).

Padding: an expert with c rows takes ceil(c / BLOCK_M) * BLOCK_M. At Qwen3-30B-A3B's shape and 2,048 tokens (16,384
slots over 128 experts, c about 128 +- 11) that is about 191 rows an expert at BLOCK_M 128 (a third of the MMA work
is padding) and 159 at BLOCK_M 64 (a fifth); smaller blocks are no option for Hopper's MMAs (64 rows a warpgroup).
Either way the two GEMMs read every expert's weights once (1.2 GB at that shape: ~250 us at an H200's 4.8 TB/s).

Each slot's row is computed alone (no sum across rows), so with a fixed configuration a token's result is the same
bits whatever else the step holds, as with moe.py's layout. 16-bit or float32 experts only (no FP8 scales).
Called directly (fused_moe below, with a configuration holding a "sorted" entry: SORTED_CONFIG); no model layer uses it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from aserve.kernels import moe, moe_align, pdl

# BLOCK_M 128 with the tiles bench/moe_kernel.py --tune chose for moe.py's GEMMs on an H200 (2026-12-03); "sorted":
# tma (descriptors for the contiguous operands) and gather_x (x copied into sorted order before GEMM 1).
SORTED_CONFIG = dict(BLOCK_M=128, sorted=dict(tma=True, gather_x=False),
                     gate_up=dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
                     down=dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4))  # fmt: skip


@triton.jit
def _gather_rows_kernel(x_ptr, xs_ptr, sorted_slots_ptr, block_experts_ptr, num_slots, H, stride_x, stride_xs,
                        NUM_EXPERTS: tl.constexpr, ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """xs[r] = x[sorted_slots[r] // ROW_DIV] for the rows of block program_id(0) that hold a slot, BLOCK_H columns."""
    pdl.gdc_sync(USE_PDL)
    pid_m = tl.program_id(0)
    if tl.load(block_experts_ptr + pid_m) >= NUM_EXPERTS:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    src = tl.where(valid, slots // ROW_DIV, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = valid[:, None] & (cols < H)[None, :]
    vals = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=ok)
    tl.store(xs_ptr + rows[:, None].to(tl.int64) * stride_xs + cols[None, :], vals, mask=ok)


@triton.jit
def _sorted_gemm_kernel(a_ptr, a_desc, b_ptr, b_desc, c_ptr, weights_ptr, sorted_slots_ptr, block_experts_ptr,
                        num_slots, N, K, num_blocks, stride_a, stride_be, stride_bn, stride_c,
                        NUM_EXPERTS: tl.constexpr, ROW_DIV: tl.constexpr, A_SORTED: tl.constexpr,
                        A_TMA: tl.constexpr, B_TMA: tl.constexpr, C_SORTED: tl.constexpr, GATED: tl.constexpr,
                        WEIGHTED: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        USE_PDL: tl.constexpr):  # fmt: skip
    """One tile of a grouped GEMM over the sorted layout: rows r of block pid_m (one expert), BLOCK_N outputs.
    A row: a[r] (A_SORTED) or a[sorted_slots[r] // ROW_DIV]; A_TMA / B_TMA: a / b through their descriptors
    (a_desc [rows, K], b_desc [E * rows of b, K]); the result stored at row r of c (C_SORTED) or at the slot's row,
    as moe.store_tile does it (GATED: silu(gate) * up, b holding N gate rows then N up rows an expert; WEIGHTED: times
    the slot's routing weight). Float32 accumulators; padding rows are never stored."""
    pdl.gdc_sync(USE_PDL)
    pid_m, pid_n = moe.grouped_tile(tl.program_id(0), N, num_blocks, GROUP_M, BLOCK_N)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= NUM_EXPERTS:
        return
    first = pid_m * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows)
    valid = slots < num_slots
    offs_k = tl.arange(0, BLOCK_K)
    if A_SORTED:
        a_rows = rows.to(tl.int64)
    else:
        a_rows = tl.where(valid, slots // ROW_DIV, 0).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # columns past N repeat earlier ones, never stored
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    up_ptrs = b_ptrs + N * stride_bn
    b_row = expert * (2 * N if GATED else N) + pid_n * BLOCK_N  # the tile's first row of b_desc
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A_TMA:
            a = a_desc.load([first, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
        if B_TMA:
            b = b_desc.load([b_row, k0]).T
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if GATED:
            if B_TMA:
                u = b_desc.load([b_row + N, k0]).T
            elif EVEN_K:
                u = tl.load(up_ptrs)
            else:
                u = tl.load(up_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
            if IEEE:
                acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, u, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    c_rows = rows if C_SORTED else slots
    moe.store_tile(c_ptr, acc, acc_up, weights_ptr, c_rows, valid, pid_n, N, stride_c, GATED, WEIGHTED, BLOCK_N)


def _descriptor(t: torch.Tensor, block_rows: int, block_k: int) -> TensorDescriptor:
    """A 2-D descriptor over t's rows (t [..., K], contiguous rows of 16-byte multiples: TMA's alignment)."""
    assert t.is_contiguous() and (t.shape[-1] * t.element_size()) % 16 == 0, "TMA needs 16-byte aligned rows"
    t = t.view(-1, t.shape[-1])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [block_rows, block_k])


def gather_rows(x: torch.Tensor, sorted_slots, block_experts, block_m: int, row_div: int,
                num_experts: int) -> torch.Tensor:  # fmt: skip
    """x [rows, H] -> xs [num_blocks * block_m, H]: xs[r] = x[sorted_slots[r] // row_div] on every row that holds a
    slot (padding rows left as allocated; blocks marked num_experts, unused, skipped)."""
    num_blocks, h = block_experts.numel(), x.shape[1]
    assert x.stride(-1) == 1 and sorted_slots.numel() == num_blocks * block_m
    xs = torch.empty(num_blocks * block_m, h, dtype=x.dtype, device=x.device)
    block_h = min(triton.next_power_of_2(h), 16384 // block_m)  # 16k elements a program: 128 a thread
    _gather_rows_kernel[(num_blocks, triton.cdiv(h, block_h))](
        x, xs, sorted_slots, block_experts, x.shape[0] * row_div, h, x.stride(0), xs.stride(0),
        NUM_EXPERTS=num_experts, ROW_DIV=row_div, BLOCK_M=block_m, BLOCK_H=block_h,
        USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(),
    )  # fmt: skip
    return xs


def sorted_gemm(a, b, out, sorted_slots, block_experts, block_m: int, config: dict, *, num_slots: int,
                row_div: int = 1, a_sorted: bool, out_sorted: bool, gated: bool, weights=None,
                tma: bool = False) -> torch.Tensor:  # fmt: skip
    """out[row or slot] = a[row or slot // row_div] @ b[expert]^T over the sorted layout of route_and_align (module
    docstring): a_sorted: a's rows are the layout's rows (else gathered by slot); out_sorted: out's rows are the
    layout's rows (else the slots'); gated: b is [E, 2N, K], out silu(gate) * up [.., N]; weights: each result times
    its slot's routing weight; tma: a (when a_sorted) and b through TMA descriptors. num_slots: T * k (the padding
    sentinel). Returns out."""
    num_experts, n_rows, k = b.shape
    n = n_rows // 2 if gated else n_rows
    assert a.stride(-1) == 1 and b.stride(-1) == 1 and out.stride(-1) == 1 and out.shape[1] == n
    num_blocks = block_experts.numel()
    assert sorted_slots.numel() == num_blocks * block_m, "route_and_align ran with another BLOCK_M"
    assert not a_sorted or a.shape[0] == num_blocks * block_m
    cfg = moe._gemm_config(config, n, k, False)
    a_desc = _descriptor(a, block_m, cfg["BLOCK_K"]) if tma and a_sorted else None
    b_desc = _descriptor(b, cfg["BLOCK_N"], cfg["BLOCK_K"]) if tma else None
    _sorted_gemm_kernel[(num_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)](
        a, a_desc, b, b_desc, out, weights if weights is not None else out, sorted_slots, block_experts, num_slots,
        n, k, num_blocks, a.stride(0), b.stride(0), b.stride(1), out.stride(0), NUM_EXPERTS=num_experts,
        ROW_DIV=row_div, A_SORTED=a_sorted, A_TMA=a_desc is not None, B_TMA=b_desc is not None, C_SORTED=out_sorted,
        GATED=gated, WEIGHTED=weights is not None, IEEE=a.dtype == torch.float32, BLOCK_M=block_m,
        USE_PDL=pdl.ENABLED, **cfg, **pdl.launch_kwargs(),
    )  # fmt: skip
    return out


def fused_moe(x, router_logits, w13, w2, top_k: int, renormalize: bool, config: dict,
              fixed_order_sum: bool = False) -> torch.Tensor:  # fmt: skip
    """moe.fused_moe's result (x [T, H], router logits [T, E], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]) through the
    sorted layout (module docstring); config: moe.fused_moe's, with a "sorted" entry (SORTED_CONFIG)."""
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    block_m, options = config["BLOCK_M"], config["sorted"]
    tma, gather_x = options.get("tma", False), options.get("gather_x", False)
    weights, _, sorted_slots, block_experts = moe_align.route_and_align(router_logits, top_k, renormalize, block_m)
    n = t * top_k
    rows = sorted_slots.numel()
    a = gather_rows(x, sorted_slots, block_experts, block_m, top_k, num_experts) if gather_x else x
    act = torch.empty(rows, two_i // 2, dtype=x.dtype, device=x.device)
    sorted_gemm(a, w13, act, sorted_slots, block_experts, block_m, config["gate_up"], num_slots=n, row_div=top_k,
                a_sorted=gather_x, out_sorted=True, gated=True, tma=tma)  # fmt: skip
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    sorted_gemm(act, w2, out, sorted_slots, block_experts, block_m, config["down"], num_slots=n, a_sorted=True,
                out_sorted=False, gated=False, weights=weights, tma=tma)  # fmt: skip
    out = out.view(t, top_k, h)
    return moe.ordered_sum(out) if fixed_order_sum else out.sum(1)
