"""Attention over a flat batch with a paged KV cache: the step's metadata and the interface every backend implements.

Layout of one layer's cache (vLLM's flash layout), shared by every backend:

    kv_cache[layer]  [2, num_blocks, block_size, num_kv_heads, head_dim]     (0 = K, 1 = V)
    slot s           = block_id * block_size + offset   (one token's K/V)

A step's batch is flat: the query tokens of all requests are concatenated (no padding). Requests with a single query
token ("decodes") come first, so a backend can treat them as one batch.

    tokens     | r0 | r1 | r2 r2 r2 r2 | r3 r3 |        query_start_loc = [0, 1, 2, 6, 8], num_decodes = 2
    seq_lens   | 37 | 12 |     4      |  130  |        (tokens in the cache after this step, incl. new ones)

One backend object is chosen at engine start (select_attention_backend, this package's __init__) and shared by all
layers; what it works out once per step (which requests batch together, gather indices, masks, split-KV segments) is
its own dataclass, which prepare() puts into AttentionMetadata.state. What differs between layers (the softmax scale,
a sliding window, soft-capping: Gemma 2/3 interleave sliding and global layers) is the layer's AttentionParams, fixed
when the model is built and handed to every call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """One layer's attention. scale: of q . k (None: head_dim ** -0.5). sliding_window: a query at position p sees
    keys p - sliding_window < k <= p (transformers' convention), and blocks wholly before that are not read (None:
    every k <= p). softcap: each scaled score s becomes softcap * tanh(s / softcap) (None: none). k_scale / v_scale:
    the per-tensor scales of the layer's keys and values in a quantised KV cache (kv_cache_dtype.py; unused by an
    unquantised one)."""

    scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0


FULL_ATTENTION = AttentionParams()


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    num_decodes: int  # the first `num_decodes` requests have exactly one query token
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    # Host copies, so backends that loop over requests need no device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seq_len: int
    max_query_len: int
    # The attention backend's per-step state (its own dataclass), built once per step by its prepare() for all layers.
    state: Any = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Writes the step's new K/V into the paged cache and computes causal attention for every query token."""

    # True: rotate_and_write(qkv, cos, sin, kv_cache, meta, num_heads, head_dim, params) -> (q, k_new, v_new): rotary
    # and the cache write in one pass (a Triton kernel: the model uses it where its element-wise ops are Triton's
    # too), and attend(q, k_new, v_new, kv_cache, meta, params) then computes attention.
    writes_rotated_kv = False
    # True: prepare() reads nothing per step on the host that a replay would need afresh, so decode steps can be
    # captured in CUDA graphs (aserve/worker/cuda_graphs.py) and replayed with other inputs.
    supports_cuda_graphs = False

    @abstractmethod
    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Builds the step's state into meta.state (once per step, before the forward)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        params: AttentionParams = FULL_ATTENTION,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D] -> out [T, H, D], for a layer
        with `params`."""
