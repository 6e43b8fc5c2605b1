"""Greedy pick on a GPU (Triton): per logits row, the index of the first maximum and whether the row holds a NaN or
an infinity, reading the logits in the model's dtype; the GPU twin of aserve/kernels/cpu.py's greedy_pick.

torch's way to get the same for a batch-1 decode step (widen to float32, a sum for the finite check, then
max(dim).indices) runs one single-row reduction per op: ~45 us of GPU time per step over a 128256-entry vocabulary
on an H200 (docs/benchmarks.md, "GPU batch-1 decode"), in series with the model. Here: one program per BLOCK entries
of a row (its maximum, that maximum's first index, a non-finite flag), then one program per row combining its
chunks.

Same result as `logits.float().max(dim=-1).indices` with first-maximum ties (-0.0 == 0.0) and
`~isfinite(logits.float().sum(-1))` for rows of finite values and rows holding NaN or an infinity (flagged; the
index of such a row means nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # entries per first-stage program (32 programs per row at a 128k vocabulary)


@triton.jit
def _chunk_kernel(logits_ptr, stride_row, vocab, val_ptr, idx_ptr, bad_ptr, chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=ok, other=float("-inf")).to(tl.float32)
    bad = ok & ((x != x) | (tl.abs(x) == float("inf")))
    m = tl.max(x, 0)
    first = tl.min(tl.where(x == m, offs, vocab), 0)
    out = row * chunks + chunk
    tl.store(val_ptr + out, m)
    tl.store(idx_ptr + out, first)
    tl.store(bad_ptr + out, tl.max(bad.to(tl.int32), 0))


@triton.jit
def _row_kernel(val_ptr, idx_ptr, bad_ptr, chunks, vocab, out_idx_ptr, out_bad_ptr, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < chunks
    base = row * chunks
    v = tl.load(val_ptr + base + c, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + base + c, mask=ok, other=vocab)
    b = tl.load(bad_ptr + base + c, mask=ok, other=0)
    m = tl.max(v, 0)
    # chunks ascend and each holds its own first maximum: the smallest index among the chunks at the row's maximum
    # (a NaN row matches nothing: clamped, so even a flagged row's index stays inside the vocabulary, since async
    # scheduling feeds it to the next step before the host sees the flag)
    first = tl.minimum(tl.min(tl.where(v == m, i, vocab), 0), vocab - 1)
    tl.store(out_idx_ptr + row, first.to(tl.int64))
    tl.store(out_bad_ptr + row, tl.max(b, 0) != 0)


def supports(logits: torch.Tensor) -> bool:
    return (
        logits.dim() == 2
        and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and logits.stride(-1) == 1
        and logits.shape[1] > 0
    )


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] -> (first-maximum index int64 [rows], non-finite flag bool [rows]). `supports` must
    hold."""
    assert supports(logits)
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, BLOCK)
    work = torch.empty(3, rows, chunks, dtype=torch.int32, device=logits.device)  # one allocation: host time
    vals, idxs, bads = work[0].view(torch.float32), work[1], work[2]
    idx = torch.empty(rows, dtype=torch.int64, device=logits.device)
    bad = torch.empty(rows, dtype=torch.bool, device=logits.device)
    if rows == 0:
        return idx, bad
    _chunk_kernel[(rows, chunks)](logits, logits.stride(0), vocab, vals, idxs, bads, chunks, BLOCK=BLOCK, num_warps=4)
    _row_kernel[(rows,)](vals, idxs, bads, chunks, vocab, idx, bad, CHUNKS_PAD=max(16, triton.next_power_of_2(chunks)),
                         num_warps=1)  # fmt: skip
    return idx, bad
