"""The GPU attention backend: Triton kernels for the cache write and for paged attention over the mixed batch.
Nothing per step on the host, so a decode step can be captured in a CUDA graph. (Triton is optional:
select_attention_backend imports this module once it is chosen.) An FP8 KV cache (backend.py's KVCacheDtype) is written
quantised by the cache-write kernels and read, every key of it, from the pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aserve.kernels.cache_write import write_kv
from aserve.kernels.fused import rotary_split
from aserve.kernels.paged_attention import SHORT_QUERY_LEN, paged_attention
from aserve.kernels.split_kv import attention_counters
from aserve.layers.attention.backend import (
    AUTO,
    FULL_ATTENTION,
    AttentionBackend,
    AttentionMetadata,
    AttentionParams,
    KVCacheDtype,
)

_MAX_SEGMENTS = 16


def num_kv_segments(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-KV for decode batches too small to fill the GPU: enough segments that there are about two programs
    per multiprocessor, each over at least ~512 keys."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms or max_seq_len < 1024:
        return 1
    segments = 1
    while segments < _MAX_SEGMENTS and programs * segments < 2 * num_sms and max_seq_len // (2 * segments) >= 512:
        segments *= 2
    return segments


@dataclass(slots=True)
class TritonAttentionState:
    num_segments: int  # split-KV segments of a decode-only step (1: no split)
    # The same for layers with a sliding window, which read at most that many keys: window -> segments
    window_segments: dict[int, int]


def _reads_new_kv(meta: AttentionMetadata) -> bool:
    """Steps with multi-token queries read their own K/V from the step's rows rather than the pages (decode-only
    steps, captured in CUDA graphs and possibly split-KV, read everything from the pages)."""
    return meta.max_query_len > 1


def _never(meta: AttentionMetadata) -> bool:
    """A quantised cache: every step reads all of its K/V from the pages."""
    return False


class TritonAttentionBackend(AttentionBackend):
    writes_rotated_kv = True
    fuses_qk_norm = True
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_num_seqs: int, device,
                 kv_cache_dtype: KVCacheDtype = AUTO) -> None:  # fmt: skip
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.kv = kv_cache_dtype
        self.reads_new_kv = _never if kv_cache_dtype.quantized else _reads_new_kv
        # (On CPU, for Triton's interpreter in tests, assume an H100/H200-sized GPU.)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self.head_dim_pad = 1 << (head_dim - 1).bit_length()
        # Split-KV partials for decode batches, preallocated flat (CUDA graphs need fixed addresses) and viewed as
        # contiguous [num_tokens, H, segments, D] / [..., 2] for each launch.
        self._partial_rows = n = max_num_seqs * num_heads * _MAX_SEGMENTS
        self.part_acc = torch.empty(n * self.head_dim_pad, dtype=torch.float32, device=device)
        self.part_stats = torch.empty(n * 2, dtype=torch.float32, device=device)
        # Their counters: a split step has at most _MAX_SEGMENTS / 2 tokens a request (segments_for), so at most
        # (_MAX_SEGMENTS / 2 + 1) q blocks a request (paged_attention's grid).
        self.counters = attention_counters(max_num_seqs * (_MAX_SEGMENTS // 2 + 1), num_kv_heads, device)

    def segments_for(self, meta: AttentionMetadata, max_seq_len: int) -> int:
        segments = num_kv_segments(meta.num_reqs, self.num_kv_heads, max_seq_len, self.num_sms)
        while segments > 1 and meta.num_tokens * self.num_heads * segments > self._partial_rows:
            segments //= 2  # the preallocated partials hold max_num_seqs tokens' worth of segments
        return segments

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Steps of short queries (decodes, verification): split-KV segments for their number of requests and
        longest context. A CUDA graph's metadata has the longest context a replay can see (max_model_len), so each
        graph keeps a count that fits every step it replays (segments past a sequence's end contribute nothing)."""
        short = meta.max_query_len <= SHORT_QUERY_LEN
        meta.state = TritonAttentionState(self.segments_for(meta, meta.max_seq_len) if short else 1, {})

    def _num_segments(self, meta: AttentionMetadata, window: int | None) -> int:
        state: TritonAttentionState = meta.state
        if window is None or state.num_segments == 1:
            return state.num_segments
        if window not in state.window_segments:
            state.window_segments[window] = self.segments_for(meta, min(meta.max_seq_len, window))
        return state.window_segments[window]

    def rotate_and_write(self, qkv, cos, sin, kv_cache, meta, num_heads: int, head_dim: int,
                         params: AttentionParams = FULL_ATTENTION, qk_norm: tuple | None = None):  # fmt: skip
        """Rotary on q and k, and k / v written into the cache, in one kernel (aserve/kernels/fused.py) -> (q [T, H, D],
        k_new, v_new) for attend(). Steps with multi-token queries also get the rotated k back in qkv, and
        k_new / v_new are views of qkv's columns (attention reads the step's own keys from there, faster than
        from the pages); decode steps get None (and keep to what a CUDA graph captures). qk_norm: fuses_qk_norm."""
        cache, scales = (kv_cache[0], kv_cache[1], meta.slot_mapping), self.kv.scales(params)
        if not self.reads_new_kv(meta):
            q = rotary_split(qkv, cos, sin, num_heads, self.num_kv_heads, head_dim, cache=cache, kv_scales=scales,
                             qk_norm=qk_norm)  # fmt: skip
            return q, None, None
        return rotary_split(qkv, cos, sin, num_heads, self.num_kv_heads, head_dim, cache=cache, keep_k=True,
                            kv_scales=scales, qk_norm=qk_norm)  # fmt: skip

    def forward(self, q, k, v, kv_cache, meta, params: AttentionParams = FULL_ATTENTION):
        write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping, *self.kv.scales(params))
        if self.reads_new_kv(meta):
            return self.attend(q, k, v, kv_cache, meta, params)
        return self.attend(q, None, None, kv_cache, meta, params)

    def attend(self, q, k_new, v_new, kv_cache, meta, params: AttentionParams = FULL_ATTENTION):
        """Attention over the paged cache, which already holds the step's K/V; k_new / v_new (or None): the
        step's own K/V, read from there instead."""
        segments = self._num_segments(meta, params.sliding_window)
        k_scale, v_scale = self.kv.scales(params)
        partials = None
        if segments > 1:
            n = q.shape[0] * self.num_heads * segments
            partials = (
                self.part_acc[: n * self.head_dim_pad].view(q.shape[0], self.num_heads, segments, self.head_dim_pad),
                self.part_stats[: n * 2].view(q.shape[0], self.num_heads, segments, 2),
            )
        return paged_attention(
            q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, num_segments=segments, partials=partials, counters=self.counters, scale=params.scale,
            k_new=k_new if segments == 1 else None, v_new=v_new if segments == 1 else None,
            sliding_window=params.sliding_window, softcap=params.softcap, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
