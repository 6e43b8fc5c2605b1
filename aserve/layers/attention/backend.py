"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from aserve.layers.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes the step's new K/V into the paged cache and computes causal attention for every query token."""

    # True: rotate_and_write(qkv, cos, sin, kv_cache, meta, num_heads, head_dim) -> (q, k_new, v_new) does rotary
    # and the cache write in one pass, and attend(q, k_new, v_new, kv_cache, meta) then computes attention.
    writes_rotated_kv = False

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Per-step work shared by all layers (called once before the forward); none by default."""
        return

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D] -> out [T, H, D]."""
