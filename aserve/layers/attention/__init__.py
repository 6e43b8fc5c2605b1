"""Attention over a flat batch with a paged KV cache (backend.py: the step's metadata and the backend interface;
torch_backend.py: the torch reference and the CPU backend; triton_backend.py: the GPU backend).

The backend is chosen once at engine start, by select_attention_backend (the `attention_backend` engine argument):

auto     Triton on a GPU; on CPU the C decode kernel's backend where it compiles, else the torch reference
torch    the torch reference (on CPU, with the C decode kernel where it compiles)
triton   Triton (on CPU tensors too, through Triton's interpreter: tests)
"""

from __future__ import annotations

import torch

from aserve.layers.attention.backend import AttentionBackend
from aserve.layers.attention.torch_backend import CPUAttentionBackend, TorchAttentionBackend


def select_attention_backend(name: str, hf_config, dtype: torch.dtype, max_num_seqs: int,
                             device: torch.device) -> AttentionBackend:  # fmt: skip
    num_heads, num_kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from aserve.layers.attention.triton_backend import TritonAttentionBackend  # Triton: optional

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, max_num_seqs, device)
    if device.type == "cpu" and CPUAttentionBackend.supports(dtype, head_dim):
        return CPUAttentionBackend()
    return TorchAttentionBackend()
