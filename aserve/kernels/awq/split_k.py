"""Split K for the AWQ GEMVs: the fused reduction of the M = 1 kernels and the separate one of the tl.dot kernels.

Fused (aserve/kernels/awq/gemv1.py, gemv1_repacked.py). Programs split K (`tiles` K tiles of BLOCK_K rows each) and
write float32 partials [SPLIT_K, N]; each then increments its column block's int32 counter (atomic, acq_rel, after a
barrier so the whole program's partials are released). The program that takes it to SPLIT_K - 1 sums the partials
in a fixed order (so results do not depend on scheduling), adds the bias, writes the output and sets the counter
back to 0 for the next launch or CUDA-graph replay. Counters are allocated once (gemv_counters: each AWQ layer has
its own; plain calls share one per device and output size), never during graph capture. With silu_mul_out the
last programs of a gate column block and its up partner apply the MLP's SiLU·mul instead of writing gate and up
(_silu_mul_epilogue).

Separate (the tl.dot kernels of aserve/kernels/awq/autoawq.py and repack.py): float32 partials [SPLIT_K, M, N], then
split_k_reduce.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels.fused import silu_mul_rounded


@triton.jit
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K, HAS_BIAS: tl.constexpr, SPLIT_PAD: tl.constexpr,
                           BLOCK: tl.constexpr):  # fmt: skip
    """out = sum of the SPLIT_K float32 partials [SPLIT_K, MN] (+ bias). All partials of a column block are loaded at
    once (a loop over them would wait for one load after another) and summed in a fixed tree order, so results do
    not depend on scheduling."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    rs = tl.arange(0, SPLIT_PAD)
    parts = tl.load(part_ptr + rs[:, None] * MN + offs[None, :], mask=(rs < SPLIT_K)[:, None] & ok[None, :], other=0.0)
    acc = tl.sum(parts, 0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def split_k_reduce(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = partials [SPLIT_K, M, N] summed over SPLIT_K (+ bias [N])."""
    split_k, m, n = partials.shape
    pad = triton.next_power_of_2(split_k)
    block = max(32, 4096 // pad)
    _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
        partials, bias if bias is not None else partials, out, m * n, n, split_k, HAS_BIAS=bias is not None,
        SPLIT_PAD=pad, BLOCK=block,
    )  # fmt: skip


@triton.jit
def _column_sums(c, BLOCK_N8: tl.constexpr):
    """c (8 float32 [rows, BLOCK_N8], column 8j + c in the c-th) summed over rows -> [BLOCK_N8 * 8] in column order."""
    # [BN8, 2, 2, 2] flattened: index 4a + 2b + c of join(join(join(c0, c4), join(c2, c6)), join(join(c1, c5), ...))
    # is column 8j + (4a + 2b + c)
    y = tl.join(
        tl.join(tl.join(tl.sum(c[0], 0), tl.sum(c[4], 0)), tl.join(tl.sum(c[2], 0), tl.sum(c[6], 0))),
        tl.join(tl.join(tl.sum(c[1], 0), tl.sum(c[5], 0)), tl.join(tl.sum(c[3], 0), tl.sum(c[7], 0))),
    )
    return tl.reshape(y, [BLOCK_N8 * 8])


@triton.jit
def _sum_partials(part_ptr, rn, n_ok, N, split_k, SPLIT_PAD: tl.constexpr, RED_CH: tl.constexpr):
    """Columns rn of the float32 partials [split_k, N] summed in a fixed order (chunks of RED_CH rows, unrolled so
    all loads can be in flight; .cg: other programs wrote them)."""
    y = tl.zeros(rn.shape, dtype=tl.float32)
    for ch in tl.static_range(SPLIT_PAD // RED_CH):
        rs = ch * RED_CH + tl.arange(0, RED_CH)
        p = tl.load(part_ptr + rs[:, None] * N + rn[None, :], mask=(rs < split_k)[:, None] & n_ok[None, :],
                    other=0.0, cache_modifier=".cg")  # fmt: skip
        y += tl.sum(p, 0)
    return y


@triton.jit
def _gemv1_epilogue(c, pid_n, pid_k, N, split_k, bias_ptr, out_ptr, part_ptr, cnt_ptr, BLOCK_N8: tl.constexpr,
                    SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, RED_CH: tl.constexpr, EVEN_N: tl.constexpr,
                    HAS_BIAS: tl.constexpr):  # fmt: skip
    """The M = 1 kernels' end: c (8 float32 [rows, BLOCK_N8], column 8j + c in the c-th) summed over rows -> out,
    directly (+ bias) or through the float32 partials and the column block's counter (SPLIT)."""
    y = _column_sums(c, BLOCK_N8)
    rn = pid_n * BLOCK_N8 * 8 + tl.arange(0, BLOCK_N8 * 8)
    if EVEN_N:  # a constant mask, folded away
        n_ok = tl.full([BLOCK_N8 * 8], 1, tl.int1)
    else:
        n_ok = rn < N
    if SPLIT:
        tl.store(part_ptr + pid_k * N + rn, y, mask=n_ok)
        tl.debug_barrier()  # every thread's partial is stored before the (one-thread) release below
        cnt = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if cnt == split_k - 1:  # the last program of this column block
            y = _sum_partials(part_ptr, rn, n_ok, N, split_k, SPLIT_PAD, RED_CH)
            if HAS_BIAS:
                y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.store(cnt_ptr + pid_n, 0)  # ready for the next launch
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _silu_mul_epilogue(c, pid_n, pid_k, N, split_k, bias_ptr, out_ptr, part_ptr, cnt_ptr, SPLIT_PAD: tl.constexpr,
                       RED_CH: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """The end of a GEMV whose N outputs are [gate | up] (an MLP's gate/up projection; N / 2 a multiple of 128):
    c's column sums -> the float32 partials; the last of the 2 split_k programs of column block pid_n and its
    partner N / 256 blocks away (the pair's counter: pid_n mod N / 256) writes silu(gate) * up for their 128
    columns (out: [N / 2]), rounded as the GEMV's output and then aserve/kernels/fused.py's silu_and_mul would round
    it."""
    y = _column_sums(c, 16)
    tl.store(part_ptr + pid_k * N + pid_n * 128 + tl.arange(0, 128), y)
    tl.debug_barrier()  # every thread's partial is stored before the (one-thread) release below
    pair = pid_n % (N // 256)
    cnt = tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel", scope="gpu")
    if cnt == 2 * split_k - 1:  # the last program of the pair
        rg = pair * 128 + tl.arange(0, 128)
        ru = N // 2 + rg
        all_ok = tl.full([128], 1, tl.int1)
        g = _sum_partials(part_ptr, rg, all_ok, N, split_k, SPLIT_PAD, RED_CH)
        u = _sum_partials(part_ptr, ru, all_ok, N, split_k, SPLIT_PAD, RED_CH)
        if HAS_BIAS:
            g += tl.load(bias_ptr + rg).to(tl.float32)
            u += tl.load(bias_ptr + ru).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + rg, silu_mul_rounded(g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32), dtype))
        tl.store(cnt_ptr + pair, 0)  # ready for the next launch


_COUNTERS: dict[tuple, torch.Tensor] = {}


def gemv_counters(n: int, device) -> torch.Tensor:
    """Zeroed int32 counters for the M = 1 kernel's fused split-K reduction of an [.., n] output: one per column
    block at any BLOCK_N (n / 8 of them). Each launch leaves them at zero again, so one set serves every launch
    that cannot overlap with another user of it: an AWQ layer keeps its own; awq_gemv without `counters` shares
    one per (device, n). Not during CUDA graph capture (the graph's memory pool would hold them)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("AWQ M = 1 GEMV: run it once before CUDA graph capture (a warm-up), or pass `counters`")
    return torch.zeros(max(1, n // 8), dtype=torch.int32, device=device)


def _shared_counters(n: int, device: torch.device) -> torch.Tensor:
    key = (device.type, device.index, n)
    if key not in _COUNTERS:
        _COUNTERS[key] = gemv_counters(n, device)
    return _COUNTERS[key]
