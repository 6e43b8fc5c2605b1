"""Batch-invariant paged attention (deterministic mode's GPU kernel): a query token's output depends only on its
request's cached keys and values up to it, computed in one order whether the token is a decode, part of a prompt
chunk of any size or a speculative verification, and whatever else the step holds.

Layout as aserve/kernels/paged_attention.py (q [T, H, D], caches [num_blocks, block_size, Hkv, D], block tables,
seq_lens, query_start_loc; the caches hold the step's K/V already). What is fixed, for every step, so that a row's
arithmetic never changes:

- one tile shape for every step (BLOCK_M rows = BLOCK_Q tokens x G query heads of one KV head, TILE_N keys, warps),
  chosen from the head counts alone: a decode's row meets the same MMAs as a prompt's;
- key tiles at absolute positions (tile t holds keys t * TILE_N ..), read from the pages (never from the step's own
  rows, whose tiles would start where the step does), each with the same online-softmax update; tiles past a row's
  position or outside its window are masked, and a wholly masked tile leaves a row's state bit for bit as it was;
- split-KV at fixed key positions: segment s covers keys s * SEG_KEYS .. (s + 1) * SEG_KEYS - 1 (SEG_KEYS set once per
  engine, from max_model_len). Each segment's softmax starts afresh and the segments are combined in order, by the
  same function, whether one program walks all of a row's segments (SPLIT off: prompt and mixed steps) or one program
  per segment writes partial results that a second kernel combines (SPLIT on: decode-only steps, where few requests
  would leave the GPU idle). Only the segments a row sees are combined.

Both kernels are compiled without floating-point contraction (enable_fp_fusion=False), so that the combine is the
same sequence of roundings in either. Reference: aserve/kernels/reference.py paged_attention (same values up to
rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.paged_attention import _find_seq, _tanh

TILE_N = 64
MIN_SEGMENT_KEYS = 512
MAX_SEGMENTS = 16
_NO_WINDOW = 1 << 30
_LAUNCH = dict(num_warps=4, num_stages=2, enable_fp_fusion=False)


def segment_keys(max_model_len: int) -> int:
    """Keys per split-KV segment: at least MIN_SEGMENT_KEYS, and few enough segments (MAX_SEGMENTS) for
    max_model_len; a multiple of TILE_N."""
    per = max(MIN_SEGMENT_KEYS, triton.cdiv(max_model_len, MAX_SEGMENTS))
    return triton.cdiv(per, TILE_N) * TILE_N


def block_m(num_heads: int, num_kv_heads: int) -> int:
    return max(64, triton.next_power_of_2(num_heads // num_kv_heads))


@triton.jit
def _segment(acc, m_i, l_i, q, q_pos, t_lo, t_hi, last_pos, bt_row, k_cache_ptr, v_cache_ptr, kv_head, scale_log2,
             window, softcap_log2, stride_c_blk, stride_c_tok, stride_c_head, offs_n, offs_d, d_ok,
             BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):  # fmt: skip
    """The online softmax over key tiles t_lo .. t_hi - 1 (absolute), keys beyond last_pos never loaded."""
    for t in range(t_lo, t_hi):
        k_idx = t * TILE_N + offs_n
        k_ok = k_idx <= last_pos
        page = tl.load(bt_row + k_idx // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = page * stride_c_blk + (k_idx % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_ptrs = slot[:, None] + offs_d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        scale = scale_log2
        if SOFTCAP:  # in log2 units, capped there (softcap_log2 = softcap * log2(e)): the scale is spent
            s = softcap_log2 * _tanh(s * (scale_log2 / softcap_log2))
            scale = 1.0
        visible = (k_idx[None, :] <= q_pos[:, None]) & (k_idx[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _combine(big_m, big_l, big_acc, m, sums, acc, has):
    """Segment (m, sums, acc) folded into the running (big_m, big_l, big_acc) of rows where `has` (the row sees a key
    of the segment); other rows keep theirs."""
    m2 = tl.maximum(big_m, m)
    m2_safe = tl.where(m2 == float("-inf"), 0.0, m2)  # rows that have seen no key (kept as they are below)
    a = tl.math.exp2(big_m - m2_safe)
    b = tl.math.exp2(m - m2_safe)
    l2 = big_l * a + sums * b
    acc2 = big_acc * a[:, None] + acc * b[:, None]
    return tl.where(has, m2, big_m), tl.where(has, l2, big_l), tl.where(has[:, None], acc2, big_acc)


@triton.jit
def _attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, part_acc_ptr,
    part_stats_ptr, scale_log2, window, softcap_log2, num_seqs, stride_q_tok, stride_q_head, stride_o_tok,
    stride_o_head, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    NUM_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    SEG_TILES: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.gdc_sync(USE_PDL)
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    tok = q_block_local * BLOCK_Q + offs_m // G
    head = kv_head * G + offs_m % G
    row_ok = (tok < q_len) & (offs_m < BLOCK_Q * G)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    q_pos = context_len + tok
    row_first = tl.maximum(q_pos - window + 1, 0)  # each row's first visible key
    first_pos = context_len + q_block_local * BLOCK_Q
    last_pos = context_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len) - 1
    first_key = tl.maximum(first_pos - window + 1, 0)
    SEG_KEYS: tl.constexpr = SEG_TILES * TILE_N
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    if SPLIT:  # this program: one segment of its rows' keys, as partial results
        s = tl.program_id(2)
        if ((s + 1) * SEG_KEYS <= first_key) | (s * SEG_KEYS > last_pos):
            return
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        t_lo = tl.maximum(s * SEG_TILES, first_key // TILE_N)
        t_hi = tl.minimum((s + 1) * SEG_TILES, last_pos // TILE_N + 1)
        acc, m_i, l_i = _segment(acc, m_i, l_i, q, q_pos, t_lo, t_hi, last_pos, bt_row, k_cache_ptr, v_cache_ptr,
                                 kv_head, scale_log2, window, softcap_log2, stride_c_blk, stride_c_tok, stride_c_head,
                                 offs_n, offs_d, d_ok, BLOCK_SIZE, TILE_N, IEEE, SOFTCAP)  # fmt: skip
        base = (q_rows * NUM_HEADS + head) * NUM_SEGMENTS + s
        tl.store(part_acc_ptr + base[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_stats_ptr + base * 2, m_i, mask=row_ok)
        tl.store(part_stats_ptr + base * 2 + 1, l_i, mask=row_ok)
    else:  # every segment of the rows' keys, combined as they come
        big_acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        big_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        big_l = tl.zeros([BLOCK_M], tl.float32)
        for s in range(first_key // SEG_KEYS, last_pos // SEG_KEYS + 1):
            acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            t_lo = tl.maximum(s * SEG_TILES, first_key // TILE_N)
            t_hi = tl.minimum((s + 1) * SEG_TILES, last_pos // TILE_N + 1)
            acc, m_i, l_i = _segment(acc, m_i, l_i, q, q_pos, t_lo, t_hi, last_pos, bt_row, k_cache_ptr,
                                     v_cache_ptr, kv_head, scale_log2, window, softcap_log2, stride_c_blk,
                                     stride_c_tok, stride_c_head, offs_n, offs_d, d_ok, BLOCK_SIZE, TILE_N, IEEE,
                                     SOFTCAP)  # fmt: skip
            has = (s * SEG_KEYS <= q_pos) & ((s + 1) * SEG_KEYS > row_first)
            big_m, big_l, big_acc = _combine(big_m, big_l, big_acc, m_i, l_i, acc, has)
        out = big_acc / tl.where(big_l == 0.0, 1.0, big_l)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip


@triton.jit
def _combine_kernel(
    out_ptr, part_acc_ptr, part_stats_ptr, seq_lens_ptr, query_start_loc_ptr, num_seqs, window, stride_o_tok,
    stride_o_head, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SEG_KEYS: tl.constexpr, NUM_SEGMENTS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Decode-only steps (one token per request): each (token, head)'s segments combined in order, as
    _attention_kernel's SPLIT-off loop combines them."""
    pdl.gdc_sync(USE_PDL)
    tok = tl.program_id(0)
    head = tl.program_id(1)
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        return  # padding (a CUDA-graph bucket larger than the batch)
    q_pos = tl.load(seq_lens_ptr + tok) - 1  # decode-only: token i is request i's last
    row_first = tl.maximum(q_pos - window + 1, 0)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    big_acc = tl.zeros([1, HEAD_DIM_PAD], tl.float32)
    big_m = tl.full([1], float("-inf"), tl.float32)
    big_l = tl.zeros([1], tl.float32)
    base = (tok.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS
    for s in range(row_first // SEG_KEYS, q_pos // SEG_KEYS + 1):
        m = tl.load(part_stats_ptr + (base + s) * 2 + tl.zeros([1], tl.int64))
        sum_ = tl.load(part_stats_ptr + (base + s) * 2 + 1 + tl.zeros([1], tl.int64))
        acc = tl.load(part_acc_ptr + (base + s) * HEAD_DIM_PAD + offs_d[None, :])
        big_m, big_l, big_acc = _combine(big_m, big_l, big_acc, m, sum_, acc, tl.full([1], 1, tl.int1))
    out = big_acc / tl.where(big_l == 0.0, 1.0, big_l)[:, None]
    tl.store(out_ptr + tok.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM)  # fmt: skip


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seg_keys: int,
    num_segments: int = 0,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every query token to its request's paged K/V (holding the step's K/V already), in
    segments of `seg_keys` keys (a multiple of TILE_N). num_segments > 0 (decode-only steps, one query token per
    request): one program per segment, up to num_segments per request (enough for the longest), combined by a second
    kernel; `partials` may pass preallocated buffers (CUDA graphs): acc [>= T * H * num_segments * Dpad] and stats
    [>= T * H * num_segments * 2], float32. 0: each program walks its rows' segments itself. Either gives the same
    bits. `scale`, `sliding_window`, `softcap`: as aserve/kernels/paged_attention.py's."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert num_heads % num_kv_heads == 0 and seg_keys % TILE_N == 0
    g = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    bm = block_m(num_heads, num_kv_heads)
    block_q = bm // g
    head_dim_pad = triton.next_power_of_2(head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    window = sliding_window or _NO_WINDOW
    split = num_segments > 0
    if split:
        n = num_tokens * num_heads * num_segments
        if partials is None:
            partials = (torch.empty(n * head_dim_pad, dtype=torch.float32, device=q.device),
                        torch.empty(n * 2, dtype=torch.float32, device=q.device))  # fmt: skip
        part_acc, part_stats = partials
    else:
        part_acc = part_stats = out  # unused
    _attention_kernel[(num_tokens // block_q + num_seqs, num_kv_heads, max(num_segments, 1))](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, part_acc, part_stats,
        scale * 1.4426950408889634, window, (softcap or 1.0) * 1.4426950408889634, num_seqs, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, G=g, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_M=bm,
        BLOCK_Q=block_q, TILE_N=TILE_N, SEG_TILES=seg_keys // TILE_N, NUM_SEGMENTS=max(num_segments, 1), SPLIT=split,
        IEEE=q.dtype == torch.float32, SOFTCAP=softcap is not None, USE_PDL=pdl.ENABLED, **_LAUNCH,
        **pdl.launch_kwargs(),
    )  # fmt: skip
    if split:
        _combine_kernel[(num_tokens, num_heads)](
            out, part_acc, part_stats, seq_lens, query_start_loc, num_seqs, window, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SEG_KEYS=seg_keys,
            NUM_SEGMENTS=num_segments, USE_PDL=pdl.ENABLED, enable_fp_fusion=False, **pdl.launch_kwargs(),
        )  # fmt: skip
    return out
