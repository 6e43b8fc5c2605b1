"""The CPU attention backend: the torch backend, with a step's decodes (one query token each) read in place from their
cache blocks by the C kernel of aserve/kernels/cpu_attention.py instead of gathered for SDPA. Chosen where that
kernel compiles (ASERVE_CPU_KERNELS=0: not) and takes the model's dtype and head size."""

from __future__ import annotations

import torch

from aserve.kernels import cpu_attention
from aserve.layers.attention.metadata import AttentionMetadata
from aserve.layers.attention.torch_backend import TorchAttentionBackend

MAX_HEAD_DIM = 256


class CPUAttentionBackend(TorchAttentionBackend):
    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and head_dim <= MAX_HEAD_DIM and cpu_attention.available()

    def takes_decode_kernel(self, short_max_q: int) -> bool:
        return short_max_q == 1  # decodes only (speculative verification's short queries stay on SDPA)

    def _decode_kernel(self, q, k_cache, v_cache, meta: AttentionMetadata, out) -> None:
        # q rows are contiguous: every split_rotate_qkv implementation returns a fresh [T, H, D]
        cpu_attention.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out)
