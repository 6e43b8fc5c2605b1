"""Deterministic mode's CPU attention backend: every query token, of a prompt chunk, a decode or a speculative
verification alike, is attended by the C decode kernel (aserve/kernels/cpu.py paged_decode_attention) as if it were
a decode: its request's block table, and the keys up to its own position read in place from the paged cache, which
already holds the step's K/V. A token's attention is then one computation that depends on nothing but its request's
cached keys and values up to it: not on the step's other requests, not on how its prompt was chunked, not on whether
those keys were computed in this step, an earlier one or by another request sharing the prefix (the normal CPU backend
runs prompts and verification on SDPA, which sums in other orders, and decodes on the C kernel).

Each step, prepare() gives every token its request's block-table row and its own sequence length (its position + 1)
once for all layers; a decode-only step uses the request tables as they are. It subclasses CPUAttentionBackend, whose
one-token steps the CPU one-token forward (aserve/models/cpu_one_token.py) runs through the same kernel. (The C kernel
reads the cache in place, so at a prompt's length it is also no slower than SDPA's gather on CPU: a 2048-token
SmolLM2 prompt, one layer, 118 vs 166 ms on the 2-core development VM.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aserve.kernels import cpu
from aserve.layers.attention.backend import FULL_ATTENTION, AttentionMetadata, AttentionParams, write_kv_cache
from aserve.layers.attention.torch_backend import CPUAttentionBackend


@dataclass(slots=True)
class PerTokenState:
    block_tables: torch.Tensor  # [num_tokens, max_blocks] int32: each token's request's row
    seq_lens: torch.Tensor  # [num_tokens] int32: each token's position + 1


class BatchInvariantCPUAttentionBackend(CPUAttentionBackend):
    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        if meta.max_query_len <= 1:  # decodes only: one token per request
            meta.state = PerTokenState(meta.block_tables, meta.seq_lens)
            return
        qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
        q_lens = np.diff(qsl)
        req = np.repeat(np.arange(len(q_lens)), q_lens)
        first_pos = np.asarray(meta.seq_lens_cpu, dtype=np.int64) - q_lens  # each request's first query position
        seq_lens = first_pos[req] + np.arange(meta.num_tokens) - qsl[req] + 1
        tables = meta.block_tables.index_select(0, torch.from_numpy(req).to(meta.block_tables.device))
        meta.state = PerTokenState(tables, torch.from_numpy(seq_lens.astype(np.int32)))

    def forward(self, q, k, v, kv_cache, meta, params: AttentionParams = FULL_ATTENTION):
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        state: PerTokenState = meta.state
        out = torch.empty_like(q)
        # q rows are contiguous: every split_rotate_qkv implementation returns a fresh [T, H, D]
        return cpu.paged_decode_attention(q, kv_cache[0], kv_cache[1], state.block_tables, state.seq_lens, out,
                                          params.scale, sliding_window=params.sliding_window,
                                          softcap=params.softcap)  # fmt: skip
