"""The interface every attention backend implements. One backend object is chosen at engine start (selector.py)
and shared by all layers; what it works out once per step (which requests batch together, gather indices, masks,
split-KV segments) is its own dataclass, which prepare() puts into AttentionMetadata.state."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from aserve.layers.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes the step's new K/V into the paged cache and computes causal attention for every query token."""

    # True: rotate_and_write(qkv, cos, sin, kv_cache, meta, num_heads, head_dim) -> (q, k_new, v_new) does rotary
    # and the cache write in one pass (a Triton kernel: the model uses it where its element-wise ops are Triton's
    # too), and attend(q, k_new, v_new, kv_cache, meta) then computes attention.
    writes_rotated_kv = False
    # True: prepare() reads nothing per step on the host that a replay would need afresh, so decode steps can be
    # captured in CUDA graphs (aserve/worker/cuda_graphs.py) and replayed with other inputs.
    supports_cuda_graphs = False

    @abstractmethod
    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Builds the step's state into meta.state (once per step, before the forward)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D] -> out [T, H, D]."""
