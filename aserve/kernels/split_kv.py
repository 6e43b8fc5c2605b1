"""Split-KV (flash-decoding) for aserve/kernels/paged_attention.py: the keys of a tile's rows are divided among
NUM_SEGMENTS programs, each of which writes partial results (acc [BLOCK_M, D], max and sum in log2 units) and then
increments its tile's int32 counter (atomic, acq_rel, after a barrier so that all of the program's partials are
released). The program that takes it to NUM_SEGMENTS - 1 — the last of the tile's segments to finish — combines
the segments' partials in segment order (so results do not depend on which program is last), writes the output and
sets the counter back to 0 for the next launch or CUDA-graph replay. One launch per attention, no combine kernel.

Partials: acc [T, H, S, D_pad] and stats [T, H, S, 2] (max, sum), float32; counters: one int32 per (q block, KV head)
of the launch, zeroed once (attention_counters) and left at zero by every launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def store_or_combine(
    acc,
    m_i,
    l_i,
    segment,
    num_active,
    counter_ptr,
    out_ptr,
    part_acc_ptr,
    part_stats_ptr,
    q_rows,
    head,
    row_ok,
    offs_d,
    d_ok,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """This segment's partials stored; the tile's last segment to finish combines segments 0 .. num_active - 1
    (those past it saw no keys and are not read) into out's rows. `counter_ptr`: the tile's counter."""
    base = (q_rows * NUM_HEADS + head) * NUM_SEGMENTS  # [BLOCK_M]: the rows' first segment
    mine = base + segment
    tl.store(part_acc_ptr + mine[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
    tl.store(part_stats_ptr + mine * 2, m_i, mask=row_ok)
    tl.store(part_stats_ptr + mine * 2 + 1, l_i, mask=row_ok)
    tl.debug_barrier()  # every thread's partials are stored before the (one-thread) release below
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SEGMENTS - 1:
        offs_s = tl.arange(0, NUM_SEGMENTS)
        seg_ok = row_ok[:, None] & (offs_s < num_active)[None, :]
        stats = part_stats_ptr + (base[:, None] + offs_s[None, :]) * 2
        # .cg: other programs wrote them (L2, not this multiprocessor's L1)
        m = tl.load(stats, mask=seg_ok, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(stats + 1, mask=seg_ok, other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, 1)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.math.exp2(m - m_max[:, None])  # segments that saw no keys have m = -inf: weight 0
        total = tl.sum(sums * w, 1)
        out = tl.zeros(acc.shape, tl.float32)
        for s in tl.static_range(NUM_SEGMENTS):  # unrolled: every segment's load in flight at once
            part = tl.load(
                part_acc_ptr + (base + s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                mask=row_ok[:, None] & (tl.full([1], s, tl.int32) < num_active)[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            out += part * tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)[:, None]
        out = out / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
        tl.store(counter_ptr, 0)  # ready for the next launch


def attention_counters(num_q_blocks: int, num_kv_heads: int, device) -> torch.Tensor:
    """Zeroed counters for split-KV launches of up to num_q_blocks q blocks (paged_attention's grid). Not during CUDA
    graph capture: the attention backend allocates them once, beside its partials."""
    return torch.zeros(max(1, num_q_blocks * num_kv_heads), dtype=torch.int32, device=device)
