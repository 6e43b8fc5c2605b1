"""Qwen3 (`Qwen3ForCausalLM`): the Llama decoder with an RMSNorm over each head of q and of k before rotary, and no
q/k/v bias. Everything else (fused projections, rotary, attention backends, quantised linears, weight loading) is
the Llama family's.
"""

from __future__ import annotations

from aserve.layers.attention.backend import AttentionMetadata
from aserve.layers.elementwise import HeadRMSNorm
from aserve.models.llama import Attention, DecoderLayer, LlamaForCausalLM


class Qwen3Attention(Attention):
    def __init__(self, cfg, backend, ops, qkv_bias: bool, quant_config, prefix: str) -> None:
        super().__init__(cfg, backend, ops, qkv_bias, quant_config, prefix)
        self.q_norm = HeadRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = HeadRMSNorm(self.head_dim, cfg.rms_norm_eps)
        # Triton: the norm inside the rotary and cache-write kernel (the backend's rotate_and_write)
        self.norm_in_rotary = self.rotates_into_cache and backend.fuses_qk_norm

    def forward(self, rotary_cos_sin, x, kv_cache, meta: AttentionMetadata):
        if self.norm_in_rotary:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            return self.attend(rotary_cos_sin, self.qkv_proj(x), kv_cache, meta, qk_norm=qk_norm)
        qkv = self.ops.qk_norm(self.qkv_proj(x), self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                               self.num_heads, self.num_kv_heads, self.head_dim)  # fmt: skip
        return self.attend(rotary_cos_sin, qkv, kv_cache, meta)


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
    one_token_path = False  # the CPU one-token forward has no q/k norm
