"""Deterministic mode's GPU attention backend: aserve/kernels/batch_invariant_attention.py for every step (prompt
chunks, decodes, verification), with split-KV segments of a size fixed at engine start (from max_model_len), so a
token's attention is the same bits whatever the step holds. As the normal Triton backend, rotary and the cache write
are one kernel (with Qwen3's q / k norm) and a step prepares nothing on the host, so decode steps are captured in CUDA
graphs (their partial results in buffers allocated here). (Triton is optional: select_attention_backend imports this
module once chosen.)
"""

from __future__ import annotations

import torch
import triton

from aserve.kernels import batch_invariant_attention as kernel
from aserve.kernels.cache_write import write_kv
from aserve.kernels.fused import rotary_split
from aserve.layers.attention.backend import FULL_ATTENTION, AttentionBackend, AttentionMetadata, AttentionParams


class BatchInvariantTritonAttentionBackend(AttentionBackend):
    writes_rotated_kv = True
    fuses_qk_norm = True
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_num_seqs: int, max_model_len: int,
                 device) -> None:  # fmt: skip
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.seg_keys = kernel.segment_keys(max_model_len)
        self.max_segments = triton.cdiv(max_model_len, self.seg_keys)
        # Partial results of decode-only steps (one token per request), flat and preallocated: CUDA graphs replay
        # fixed addresses.
        n = max_num_seqs * num_heads * self.max_segments
        self.part_acc = torch.empty(n * triton.next_power_of_2(head_dim), dtype=torch.float32, device=device)
        self.part_stats = torch.empty(n * 2, dtype=torch.float32, device=device)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """meta.state: split-KV segments per request for decode-only steps (enough for the longest context; a CUDA
        graph's metadata has max_model_len), 0 for other steps and where one segment holds every context (each
        program walks its rows' segments). Either way a row gets the same bits."""
        segments = min(triton.cdiv(meta.max_seq_len, self.seg_keys), self.max_segments)
        meta.state = segments if meta.max_query_len == 1 and segments > 1 else 0

    def rotate_and_write(self, qkv, cos, sin, kv_cache, meta, num_heads: int, head_dim: int,
                         params: AttentionParams = FULL_ATTENTION, qk_norm: tuple | None = None):  # fmt: skip
        """Rotary on q and k, k / v written into the cache (aserve/kernels/fused.py) -> (q, None, None): attention
        reads every key from the pages. (Deterministic mode has no quantised cache: `params`' scales are unused.)
        qk_norm: fuses_qk_norm (one program a token: a token's norm does not depend on the rest of the step)."""
        cache = (kv_cache[0], kv_cache[1], meta.slot_mapping)
        q = rotary_split(qkv, cos, sin, num_heads, self.num_kv_heads, head_dim, cache=cache, qk_norm=qk_norm)
        return q, None, None

    def forward(self, q, k, v, kv_cache, meta, params: AttentionParams = FULL_ATTENTION):
        write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        return self.attend(q, None, None, kv_cache, meta, params)

    def attend(self, q, k_new, v_new, kv_cache, meta, params: AttentionParams = FULL_ATTENTION):
        segments = meta.state
        return kernel.attention(
            q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, self.seg_keys,
            num_segments=segments, partials=(self.part_acc, self.part_stats) if segments else None,
            scale=params.scale, sliding_window=params.sliding_window, softcap=params.softcap,
        )  # fmt: skip
