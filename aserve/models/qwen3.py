"""Qwen3 (`Qwen3ForCausalLM`): the Llama decoder with an RMSNorm over each head of q and of k before rotary, and no
q/k/v bias. Everything else (fused projections, rotary, attention backends, quantised linears, weight loading) is
the Llama family's.
"""

from __future__ import annotations

import torch

from aserve.layers.attention.backend import AttentionMetadata
from aserve.layers.elementwise import HeadRMSNorm
from aserve.models.llama import Attention, DecoderLayer, LlamaForCausalLM


class Qwen3Attention(Attention):
    def __init__(self, cfg, backend, ops, qkv_bias: bool, quant_config, prefix: str) -> None:
        super().__init__(cfg, backend, ops, qkv_bias, quant_config, prefix)
        self.q_norm = HeadRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = HeadRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, rotary_cos_sin, x, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(-1, self.kv_size)
        return self.attend(rotary_cos_sin, torch.cat([q, k, v], dim=-1), kv_cache, meta)


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
    one_token_path = False  # the CPU one-token forward has no q/k norm

    def __init__(self, cfg, *args, **kwargs) -> None:
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window is not supported (sliding-window attention)")
        super().__init__(cfg, *args, **kwargs)
