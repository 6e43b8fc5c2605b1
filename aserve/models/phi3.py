"""Phi-3 (`Phi3ForCausalLM`): the Llama decoder, with q/k/v and gate/up already fused in the checkpoint (its
`qkv_proj` and `gate_up_proj` load as they are), and LongRoPE ("longrope", formerly "su") where the config asks for
it: rescale factors per frequency and cos/sin multiplied by an attention factor.

LongRoPE has two sets of factors: the short ones for sequences up to `original_max_position_embeddings`, the long
ones beyond. As transformers' Phi-3 (which picks the set per forward from the longest position it is given), a
request's tokens are rotated with the long factors in a step where its sequence is longer than that length: a prompt
longer than it uses the long factors throughout, and a sequence that grows past it rotates its new tokens with the
long ones and keeps its earlier keys. (transformers' generate() then drops its cache and recomputes the sequence
with the long factors once; aserve, as vLLM, keeps the keys. A long prompt prefilled in chunks rotates the chunks
that end within the length with the short factors.) Both tables sit in one [2 * max_position] table, the long one
second, so each token's lookup is its position plus an offset. Prompts longer than the length are cached apart
(EngineConfig.long_prompt_len).
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.layers.attention.backend import AttentionMetadata
from aserve.layers.rotary import (
    cos_sin_table,
    longrope_inv_freq,
    longrope_switch_length,
    padded,
    partial_rotary_order,
    rope_attention_factor,
    rope_parameters,
    rotary_dim,
)
from aserve.models.llama import LlamaForCausalLM, head_dim_of


class LongRopeRotary(nn.Module):
    """cos/sin of every position under LongRoPE's short factors, then again under its long ones (float32, built by
    `materialize`); forward takes the step's metadata to pick each token's set."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict, scale: float) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scale = head_dim, max_position, theta, scale
        self.short_factor, self.long_factor = scaling["short_factor"], scaling["long_factor"]
        self.original = scaling["original_max_position_embeddings"]
        self.rotary_dim = rotary_dim(head_dim, scaling)
        self.cos_sin: torch.Tensor | None = None

    def materialize(self, device: torch.device) -> None:
        tables = [
            cos_sin_table(
                padded(longrope_inv_freq(self.rotary_dim, self.theta, factors), self.head_dim),
                self.max_position,
                self.scale,
            )  # fmt: skip
            for factors in (self.short_factor, self.long_factor)
        ]
        self.cos_sin = torch.cat(tables).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata):
        """-> cos, sin [T, 1, head_dim] in `dtype`. A token's request is found by its index in the flat batch
        (query_start_loc; rows past the last request, as in padded CUDA-graph batches, take the last one's)."""
        index = torch.arange(positions.shape[0], device=positions.device, dtype=meta.query_start_loc.dtype)
        request = torch.searchsorted(meta.query_start_loc[1:], index, right=True)
        request = request.clamp_(max=meta.seq_lens.shape[0] - 1)
        long = meta.seq_lens[request] > self.original
        rows = positions + long.to(positions.dtype) * self.max_position
        cos, sin = self.cos_sin[rows].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


class Phi3ForCausalLM(LlamaForCausalLM):
    supports_partial_rotary = True  # (load_weights orders q / k as partial_rotary_order says)

    def __init__(self, cfg, backend, ops, quant_config, max_position: int) -> None:
        super().__init__(cfg, backend, ops, quant_config, max_position)
        theta, scaling = rope_parameters(cfg)
        original = longrope_switch_length(cfg)
        if original is not None:
            scaling["original_max_position_embeddings"] = original
            scale = rope_attention_factor(scaling, cfg.max_position_embeddings)
            self.rotary = LongRopeRotary(head_dim_of(cfg), max_position, theta, scaling, scale)

    def load_weights(self, weights) -> set[str]:
        """As Llama's; then, with a partial rotary (Phi-4-mini), each head's q and k rows in partial_rotary_order."""
        loaded = super().load_weights(weights)
        head_dim = head_dim_of(self.config)
        rotary = rotary_dim(head_dim, rope_parameters(self.config)[1])
        if rotary == head_dim:
            return loaded
        order = partial_rotary_order(head_dim, rotary)
        for layer in self.layers:
            attn = layer.self_attn
            weight = getattr(attn.qkv_proj, "weight", None)
            if weight is None or not weight.dtype.is_floating_point or weight.dtype.itemsize < 2:
                raise ValueError("partial_rotary_factor with a quantised checkpoint is not supported: serve the "
                                 "16-bit checkpoint (--quantization fp8 / int8 quantise it at load)")  # fmt: skip
            for param in (weight, attn.qkv_proj.bias):
                if param is None:
                    continue
                for start, heads in ((0, attn.num_heads), (attn.q_size, attn.num_kv_heads)):
                    rows = param.data[start : start + heads * head_dim]
                    rows.copy_(rows.view(heads, head_dim, -1)[:, order].reshape(rows.shape))
        return loaded
