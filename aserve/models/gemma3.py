"""Gemma 3, text only (`Gemma3ForCausalLM`, model_type gemma3_text): Gemma 2 (models/gemma2.py) with

    q / k norms        Gemma's RMSNorm over each head of q and of k, before rotary
    two rotary tables  rope_parameters["sliding_attention"] (rope_local_base_freq, 10k) on the sliding layers,
                       rope_parameters["full_attention"] (1M, linear scaling on the larger models) on the others
    layer pattern      config.layer_types: five sliding layers to one full one (sliding_window_pattern 6)
    soft-capping       none in attention (transformers' Gemma 3 passes none); final logits only if the config asks

Its multimodal checkpoints (Gemma3ForConditionalGeneration) are not served.
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.layers.attention.backend import AttentionMetadata, AttentionParams
from aserve.layers.rotary import RotaryEmbedding
from aserve.models.gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    GemmaRMSNorm,
    batch_invariant_gemma_ops,
    gemma_ops,
)
from aserve.models.llama import head_dim_of, sliding_windows


def layer_type_rope(cfg, layer_type: str) -> tuple[float, dict]:
    """(theta, scaling dict) of one layer type's rotary, from transformers' per-layer-type rope_parameters."""
    scaling = dict(cfg.rope_parameters[layer_type])
    theta = float(scaling.pop("rope_theta"))
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, scaling


class LocalGlobalRotary(nn.Module):
    """The full-attention layers' rotary table and the sliding layers' (Gemma3DecoderLayer.rotary_index 0 / 1)."""

    def __init__(self, cfg, max_position: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(
            RotaryEmbedding(head_dim_of(cfg), max_position, *layer_type_rope(cfg, kind))
            for kind in ("full_attention", "sliding_attention")
        )

    def materialize(self, device: torch.device) -> None:
        for table in self.tables:
            table.materialize(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        return tuple(table(positions, dtype) for table in self.tables)


class Gemma3Attention(Gemma2Attention):
    def __init__(self, cfg, backend, ops, qkv_bias: bool, quant_config, prefix: str) -> None:
        super().__init__(cfg, backend, ops, qkv_bias, quant_config, prefix)
        self.attn_params = AttentionParams(scale=cfg.query_pre_attn_scalar**-0.5)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.gemma_ops = gemma_ops(ops)

    def use_batch_invariant(self) -> None:
        self.gemma_ops = batch_invariant_gemma_ops(self.gemma_ops)

    def forward(self, rotary_cos_sin, x, kv_cache, meta: AttentionMetadata):
        qkv = self.gemma_ops.head_norm(self.qkv_proj(x), self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                       self.num_heads, self.num_kv_heads, self.head_dim)  # fmt: skip
        return self.attend(rotary_cos_sin, qkv, kv_cache, meta)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer

    def __init__(self, cfg, backend, ops, quant_config, max_position: int) -> None:
        super().__init__(cfg, backend, ops, quant_config, max_position)
        self.rotary = LocalGlobalRotary(cfg, max_position)
        for layer, window in zip(self.layers, sliding_windows(cfg)):
            layer.rotary_index = 0 if window is None else 1

    def rotary_tables(self, positions, dtype) -> tuple:
        return self.rotary(positions, dtype)
