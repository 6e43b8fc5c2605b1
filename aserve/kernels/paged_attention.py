"""Triton paged attention for a flat mixed batch: decodes (1 query token), prefill chunks and speculative
verification (k+1 tokens) of many requests in one launch, each attending causally to its own paged KV cache.

Layout (see aserve/layers/attention/backend.py): q [T, H, D]; k_cache / v_cache [num_blocks, block_size, Hkv, D];
block_tables [num_seqs, max_blocks]; seq_lens [num_seqs] (context + new tokens); query_start_loc [num_seqs + 1].

One program computes a tile of BLOCK_M query rows against one KV head. GQA is packed into the rows: a tile holds
BLOCK_Q tokens x G query heads (G = H / Hkv), so the G heads that share a KV head read its K/V once:

    rows:  tok0/h0 tok0/h1 .. tok0/hG-1 | tok1/h0 .. | ...        (BLOCK_Q = BLOCK_M // G tokens)

Programs are numbered over "q blocks" of all requests; each finds its request by binary search in query_start_loc,
so the host computes nothing per step and the grid depends only on (num_tokens, num_seqs): CUDA-graph friendly.
K/V are read TILE_N keys at a time straight from the pages (no gather copy), with an online softmax in float32.
With k_new / v_new (NEW_KV), only the cached context comes through the pages and the step's own keys from those
[T, Hkv, D] rows (the fused qkv rows in the engine): no per-key page lookups for a prompt's own keys, 0.82x instead
of 0.71x SDPA on a 4096-token prompt (docs/benchmarks.md, "GPU offline throughput and attention kernels").

Sliding windows and soft-capping (Gemma 2/3, Mistral): a query at position p sees only keys p - window < k <= p,
and a program's KV loop starts at the first tile any of its rows can see, so tiles wholly outside the window are not
read; tiles that some rows see in part are masked. Soft-capping replaces each scaled score s by
softcap * tanh(s / softcap) (SOFTCAP, compiled in only where a layer asks for it).

Split-KV (flash-decoding): with NUM_SEGMENTS > 1 the keys of a tile row are divided among NUM_SEGMENTS programs
that write partial (acc, max, sum) results; the last of them to finish combines them (aserve/kernels/split_kv.py).
This fills the GPU when a few long sequences decode.

FP8 KV caches (float8_e4m3fn pages): tiles convert to q's dtype as they load; the per-tensor k_scale folds into the
softmax scale and v_scale into the output. Such a cache is read whole from the pages (no k_new / v_new). With bf16
queries and FP8_FP16_DOT (config key FP16_DOT), q is converted to fp16 once (exact, clamped to fp16's range) and the
tiles to fp16 (one hardware conversion per pair of e4m3 values, where e4m3 -> bf16 takes several instructions), so
both dots run in fp16 with a float32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.split_kv import attention_counters, store_or_combine

# Queries up to this long (decodes, speculative verification) get decode-sized tiles (tile_config); the attention
# backend splits their keys (split-KV) as it does a decode's.
SHORT_QUERY_LEN = 8

# FP8 KV cache with bf16 queries: the dots in fp16 (see above; H200, 2026-12-03: decode 1.28x faster, 128-key tiles)
FP8_FP16_DOT = True


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The request owning global q block `q_block`: request i owns blocks starting at
    query_start_loc[i] // BLOCK_Q + i (each request starts a fresh block)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh from one exp2 (exp(-2|x|)): saturates to +-1 without overflow."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_pos, key0, t, num_keys, bt_row, row0, k_cache_ptr, v_cache_ptr, kv_head, scale_log2, window,
    softcap_log2, stride_c_blk, stride_c_tok, stride_c_head, offs_n, offs_d, d_ok, BLOCK_SIZE: tl.constexpr, TILE_N:
    tl.constexpr, IEEE: tl.constexpr, EVEN_D: tl.constexpr, MASKED: tl.constexpr, ACC_DOT: tl.constexpr, CONTIG:
    tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One TILE_N-key tile of the online softmax: keys read straight from their pages (or, CONTIG, from the
    step's new K/V rows). Unmasked tiles (all keys valid and visible to every row) load without masks. A key is
    visible to a row when its index is <= the row's q_pos, > q_pos - window, and < num_keys."""
    k_idx = key0 + t * TILE_N + offs_n
    if MASKED:
        k_ok = k_idx < num_keys
    if CONTIG:  # the step's new keys: rows row0 + k_idx of a [T, Hkv, D] array (strides stride_c_tok / _head)
        slot = (row0 + k_idx).to(tl.int64) * stride_c_tok + kv_head * stride_c_head
    else:
        if MASKED:
            page = tl.load(bt_row + k_idx // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + k_idx // BLOCK_SIZE).to(tl.int64)
        slot = page * stride_c_blk + (k_idx % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
    kv_ptrs = slot[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_cache_ptr + kv_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_cache_ptr + kv_ptrs)
    else:
        k = tl.load(k_cache_ptr + kv_ptrs, mask=d_ok[None, :], other=0.0)
    k = tl.trans(k.to(q.dtype))  # (FP8 pages: to q's dtype; otherwise the same dtype, no-op)
    if IEEE:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if SOFTCAP:  # scores in log2 units, capped there (softcap_log2 = softcap * log2(e)): the scale is spent
        s = softcap_log2 * _tanh(s * (scale_log2 / softcap_log2))
        scale_log2 = 1.0
    if MASKED:
        visible = (k_idx[None, :] <= q_pos[:, None]) & (k_idx[None, :] > q_pos[:, None] - window)
        s = tl.where(visible & (k_idx < num_keys)[None, :], s, float("-inf"))
    # Maxima in log2 units; the scale is applied inside the exponent's argument (one FMA per score).
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    else:
        m_new_safe = m_new
    p = tl.math.exp2(s * scale_log2 - m_new_safe[:, None])
    alpha = tl.math.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_cache_ptr + kv_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_cache_ptr + kv_ptrs)
    else:
        v = tl.load(v_cache_ptr + kv_ptrs, mask=d_ok[None, :], other=0.0)
    v = v.to(q.dtype)
    if ACC_DOT:  # the rescaled accumulator goes into the MMA as its addend
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
    elif IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    key0,
    lo,
    wlo,
    mid,
    hi,
    num_keys,
    bt_row,
    row0,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    scale_log2,
    window,
    softcap_log2,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    offs_n,
    offs_d,
    d_ok,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_D: tl.constexpr,
    ACC_DOT: tl.constexpr,
    CONTIG: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """_attend_tile over the tiles of keys from key0 on: lo .. wlo - 1 with masks (the window's edge), wlo .. mid - 1
    without, then mid .. hi - 1 with them (the causal edge and the end)."""
    for t in range(lo, wlo):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, key0, t, num_keys, bt_row, row0, k_cache_ptr, v_cache_ptr, kv_head, scale_log2,
            window, softcap_log2, stride_c_blk, stride_c_tok, stride_c_head, offs_n, offs_d, d_ok, BLOCK_SIZE,
            TILE_N, IEEE, EVEN_D, True, ACC_DOT, CONTIG, SOFTCAP,
        )  # fmt: skip
    for t in range(wlo, mid):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, key0, t, num_keys, bt_row, row0, k_cache_ptr, v_cache_ptr, kv_head, scale_log2,
            window, softcap_log2, stride_c_blk, stride_c_tok, stride_c_head, offs_n, offs_d, d_ok, BLOCK_SIZE,
            TILE_N, IEEE, EVEN_D, False, ACC_DOT, CONTIG, SOFTCAP,
        )  # fmt: skip
    for t in range(mid, hi):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, q_pos, key0, t, num_keys, bt_row, row0, k_cache_ptr, v_cache_ptr, kv_head, scale_log2,
            window, softcap_log2, stride_c_blk, stride_c_tok, stride_c_head, offs_n, offs_d, d_ok, BLOCK_SIZE,
            TILE_N, IEEE, EVEN_D, True, ACC_DOT, CONTIG, SOFTCAP,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _tile_bounds(p0, p1, num_keys, window, TILE_N: tl.constexpr, ALIGN: tl.constexpr):
    """Which of keys 0 .. num_keys - 1 rows at positions p0 .. p1 (in the keys' numbering) see -> (key0, wlo, mid,
    hi): tiles of TILE_N keys from key0 (the first row's first visible key, rounded down to ALIGN: a page's first
    key), so that pages wholly outside every row's window are never read; tiles wlo .. mid - 1 are seen whole by
    every row; hi: past the last tile any row sees."""
    key0 = tl.maximum(p0 - window + 1, 0) // ALIGN * ALIGN
    hi = tl.cdiv(tl.maximum(tl.minimum(num_keys, p1 + 1) - key0, 0), TILE_N)
    wlo = tl.minimum(tl.cdiv(tl.maximum(p1 - window + 1 - key0, 0), TILE_N), hi)
    mid = tl.minimum(tl.maximum(tl.maximum(tl.minimum(p0 + 1, num_keys) - key0, 0) // TILE_N, wlo), hi)
    return key0, wlo, mid, hi


# The number of sequences changes with every step: one compiled variant for all (Triton would otherwise compile
# separate ones for 1 and for multiples of 16, the latter first met in live traffic).
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_acc_ptr,
    part_stats_ptr,
    counters_ptr,
    k_new_ptr,
    v_new_ptr,
    scale_log2,
    window,
    softcap_log2,
    v_scale,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    stride_bt,
    stride_n_tok,
    stride_n_head,
    NUM_HEADS: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    IEEE: tl.constexpr,
    REVERSE: tl.constexpr,
    ACC_DOT: tl.constexpr,
    NEW_KV: tl.constexpr,
    SOFTCAP: tl.constexpr,
    USE_PDL: tl.constexpr,
    FP16_DOT: tl.constexpr,
):
    pdl.gdc_sync(USE_PDL)
    if REVERSE:  # last q blocks first: in a prompt they see the most keys, so the heavy tiles do not form the tail
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    tok = q_block_local * BLOCK_Q + offs_m // G  # token index within the request
    head = kv_head * G + offs_m % G
    row_ok = (tok < q_len) & (offs_m < BLOCK_Q * G)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP16_DOT:  # (FP8 pages, bf16 q) the dots in fp16: e4m3 -> fp16 is one instruction per pair, bf16 q exact
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    q_pos = context_len + tok  # absolute position of each row's token

    # Keys this tile can see: up to its last token's position (causal), from its first token's window on.
    last_tok = tl.minimum((q_block_local + 1) * BLOCK_Q, q_len) - 1
    first_tok = q_block_local * BLOCK_Q
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_DIM_PAD
    if NEW_KV:  # (NUM_SEGMENTS == 1) the context's keys from the pages, the step's own from k_new / v_new
        key0, wlo, mid, hi = _tile_bounds(context_len + first_tok, context_len + last_tok, context_len, window, TILE_N,
                                          BLOCK_SIZE)  # fmt: skip
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, key0, 0, wlo, mid, hi, context_len, bt_row, 0, k_cache_ptr, v_cache_ptr, kv_head,
            scale_log2, window, softcap_log2, stride_c_blk, stride_c_tok, stride_c_head, offs_n, offs_d, d_ok,
            BLOCK_SIZE, TILE_N, IEEE, EVEN_D, ACC_DOT, False, SOFTCAP,
        )  # fmt: skip
        # New keys j = 0 .. last_tok, numbered within the step as the rows' tokens are.
        key0, wlo, mid, hi = _tile_bounds(first_tok, last_tok, q_len, window, TILE_N, 1)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, tok, key0, 0, wlo, mid, hi, q_len, bt_row, q_start, k_new_ptr, v_new_ptr, kv_head,
            scale_log2, window, softcap_log2, 0, stride_n_tok, stride_n_head, offs_n, offs_d, d_ok, BLOCK_SIZE,
            TILE_N, IEEE, EVEN_D, ACC_DOT, True, SOFTCAP,
        )  # fmt: skip
    else:
        last_pos = context_len + last_tok
        key0, wlo, mid, hi = _tile_bounds(context_len + first_tok, last_pos, last_pos + 1, window, TILE_N, BLOCK_SIZE)
        # Split-KV: this segment's share of the tiles 0 .. hi - 1.
        tiles_per_segment = tl.cdiv(hi, NUM_SEGMENTS)
        seg_lo = segment * tiles_per_segment
        seg_hi = tl.minimum(seg_lo + tiles_per_segment, hi)
        seg_wlo = tl.minimum(tl.maximum(wlo, seg_lo), seg_hi)
        seg_mid = tl.minimum(tl.maximum(mid, seg_wlo), seg_hi)
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, q_pos, key0, seg_lo, seg_wlo, seg_mid, seg_hi, last_pos + 1, bt_row, 0, k_cache_ptr,
            v_cache_ptr, kv_head, scale_log2, window, softcap_log2, stride_c_blk, stride_c_tok, stride_c_head, offs_n,
            offs_d, d_ok, BLOCK_SIZE, TILE_N, IEEE, EVEN_D, ACC_DOT, False, SOFTCAP,
        )  # fmt: skip
        num_active = tl.cdiv(hi, tl.maximum(tiles_per_segment, 1)).to(tl.int32)  # segments that see keys

    acc = acc * v_scale
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        store_or_combine(
            acc, m_i, l_i, segment, num_active, counters_ptr + q_block * tl.num_programs(1) + kv_head, out_ptr,
            part_acc_ptr, part_stats_ptr, q_rows, head, row_ok, offs_d, d_ok, stride_o_tok, stride_o_head, NUM_HEADS,
            HEAD_DIM_PAD, NUM_SEGMENTS,
        )  # fmt: skip


_NO_WINDOW = 1 << 30  # the window of full attention: longer than any sequence


def tile_config(num_heads: int, num_kv_heads: int, max_query_len: int, head_dim: int = 128,
                fp8_cache: bool = False) -> dict:  # fmt: skip
    """Launch configuration: decode-only batches get the smallest tile that holds the G heads of one token, and
    batches of short queries (verification) the smallest that holds one query's tokens; longer queries get bigger
    tiles. Heads over 128 wide (Gemma's 256) get narrower KV tiles and one
    stage less, so that the K and V tiles in flight fit in shared memory (227 KiB on Hopper). Decodes over an FP8
    cache read 128-key tiles in 3 stages (H200, 2026-12-03, bench/decode_kernels.py --sections fp8_attention: 2.46
    TB/s of cache bytes against 1.39 with the 16-bit cache's tile)."""
    g = num_heads // num_kv_heads
    wide = head_dim > 128
    if max_query_len <= SHORT_QUERY_LEN:
        # Decodes and speculative verification (k + 1 tokens): tiles of one request's tokens x G heads, read
        # like a decode's (H200, 2026-12-03: a 5-token verification at batch 1 took 31 us per layer in the
        # prompt tiles, against 5 us for a decode).
        rows = max(16, triton.next_power_of_2(g * max(max_query_len, 1)))
        if fp8_cache and not wide:
            return dict(BLOCK_M=rows, TILE_N=128, num_warps=4, num_stages=3)
        return dict(BLOCK_M=rows, TILE_N=64, num_warps=4, num_stages=2)
    return dict(
        BLOCK_M=max(64 if wide else 128, triton.next_power_of_2(g)),
        TILE_N=64 if wide else 128,
        num_warps=8,
        num_stages=2 if wide else 3,
        REVERSE=True,
        ACC_DOT=True,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor | None = None,
    num_segments: int = 1,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    counters: torch.Tensor | None = None,
    scale: float | None = None,
    config: dict | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of every query token to its request's paged K/V (which must already hold the step's new
    tokens). `max_query_len` only picks the tile shape (any upper bound works). With num_segments > 1 (split-KV),
    `partials` may pass preallocated buffers (CUDA graphs): acc [T, H, S, Dpad] and stats [T, H, S, 2], float32,
    and `counters` the split's (split_kv.attention_counters for at least the launch's q blocks).
    `config` overrides tile_config (BLOCK_M, TILE_N, num_warps, num_stages, REVERSE: q blocks in reverse order,
    ACC_DOT: the rescaled accumulator as the P @ V MMA's addend), for tuning.
    `k_new` / `v_new` ([T, Hkv, D] views with equal strides, last one 1; e.g. slices of the fused qkv rows): the
    step's own keys and values, read from there instead of the pages (the context's keys still come from the
    pages). Their contiguous rows load faster than a page gather (H200, 4096-token prompt: 441 vs 356 TFLOP/s).
    Only without split-KV. `sliding_window`: a query at position p sees keys p - sliding_window < k <= p only (None:
    every k <= p); `softcap`: each scaled score s becomes softcap * tanh(s / softcap) (None: no capping). FP8 caches
    (float8_e4m3fn): keys read as k * k_scale, values as v * v_scale."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert num_heads % num_kv_heads == 0
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    fp8_cache = k_cache.dtype == torch.float8_e4m3fn
    cfg = config or tile_config(num_heads, num_kv_heads, max_query_len, q.shape[-1], fp8_cache)
    block_m = cfg["BLOCK_M"]
    block_q = block_m // (num_heads // num_kv_heads)
    assert block_q >= 1, f"BLOCK_M {block_m} is smaller than the GQA group {num_heads // num_kv_heads}"
    head_dim_pad = triton.next_power_of_2(head_dim)
    scale = head_dim**-0.5 if scale is None else scale
    num_q_blocks = num_tokens // block_q + num_seqs
    if num_segments > 1:
        assert num_segments == triton.next_power_of_2(num_segments)
        if partials is None:
            partials = (
                torch.empty(num_tokens, num_heads, num_segments, head_dim_pad, dtype=torch.float32, device=q.device),
                torch.empty(num_tokens, num_heads, num_segments, 2, dtype=torch.float32, device=q.device),
            )
        part_acc, part_stats = partials
        if counters is None:
            counters = attention_counters(num_q_blocks, num_kv_heads, q.device)
        assert counters.dtype == torch.int32 and counters.numel() >= num_q_blocks * num_kv_heads
    else:
        part_acc = part_stats = out  # unused
        counters = seq_lens  # unused
    fp16_dot = cfg.get("FP16_DOT", FP8_FP16_DOT) and fp8_cache and q.dtype == torch.bfloat16
    new_kv = k_new is not None
    if new_kv:
        assert num_segments == 1 and v_new is not None and k_new.stride() == v_new.stride()
        assert k_new.shape == (num_tokens, num_kv_heads, head_dim) and k_new.stride(-1) == 1
        assert k_cache.dtype == q.dtype, "a quantised cache is read whole from its pages (no k_new / v_new)"
    else:
        k_new = v_new = k_cache  # unused
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_segments)](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, part_acc, part_stats, counters, k_new, v_new,
        scale * k_scale * 1.4426950408889634, sliding_window or _NO_WINDOW, (softcap or 1.0) * 1.4426950408889634,
        v_scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), k_new.stride(0),
        k_new.stride(1),
        NUM_HEADS=num_heads, G=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=cfg["TILE_N"], NUM_SEGMENTS=num_segments,
        IEEE=q.dtype == torch.float32, REVERSE=cfg.get("REVERSE", False), ACC_DOT=cfg.get("ACC_DOT", False),
        NEW_KV=new_kv, SOFTCAP=softcap is not None, USE_PDL=pdl.ENABLED, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], FP16_DOT=fp16_dot, **pdl.launch_kwargs(),
    )  # fmt: skip
    return out
