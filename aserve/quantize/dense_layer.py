"""One Llama-family decoder layer in float32 over HF-named weights, for calibration.

The quantiser needs a forward over whole batches of dense sequences ([N, L] tokens, causal, no KV cache) where any
linear's weight can be swapped for a candidate, and the inputs of every linear are visible. aserve's serving model
(paged KV cache, fused q/k/v) is the wrong tool for that, so this is a small separate one; it reuses aserve's
RMSNorm, rotary and SiLU·mul so the numbers are the same as the serving model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aserve.layers.elementwise import add_rms_norm, silu_and_mul, split_rotate_qkv
from aserve.layers.rotary import RotaryEmbedding, rope_attention_factor, rope_parameters

Weights = dict[str, torch.Tensor]  # HF names inside a layer: "self_attn.q_proj.weight", "mlp.down_proj.weight", ...


@dataclass
class LayerInputs:
    """What each group of linears saw in one layer's forward: the tensors AWQ searches scales for."""

    qkv: torch.Tensor  # input_layernorm output [T, hidden]: q/k/v_proj's input
    o_proj: torch.Tensor  # attention context [T, heads * head_dim]
    gate_up: torch.Tensor  # post_attention_layernorm output [T, hidden]: gate/up_proj's input
    down_proj: torch.Tensor  # silu(gate) * up [T, intermediate]


class DenseDecoderLayer:
    def __init__(self, weights: Weights, hf_config, seq_len: int) -> None:
        self.w = weights
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = hf_config.num_key_value_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // self.num_heads
        self.eps = hf_config.rms_norm_eps
        theta, scaling = rope_parameters(hf_config)
        rotary = RotaryEmbedding(self.head_dim, seq_len, theta, scaling,
                                 rope_attention_factor(scaling, hf_config.max_position_embeddings))  # fmt: skip
        rotary.materialize(next(iter(weights.values())).device if weights else torch.device("cpu"))
        self.rotary = rotary

    def linear(self, name: str, x: torch.Tensor, override: Weights | None = None) -> torch.Tensor:
        weight = (override or {}).get(f"{name}.weight", self.w[f"{name}.weight"])
        return F.linear(x, weight, self.w.get(f"{name}.bias"))

    def attention(self, h: torch.Tensor, seq_len: int, override: Weights | None = None):
        """h [T = N * seq_len, hidden] -> (self_attn output [T, hidden], context [T, heads * head_dim])."""
        qkv = torch.cat([self.linear(f"self_attn.{p}_proj", h, override) for p in "qkv"], dim=-1)
        positions = torch.arange(seq_len, device=h.device).repeat(h.shape[0] // seq_len)
        cos, sin = self.rotary(positions, h.dtype)
        q, k, v = split_rotate_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)

        def batched(t):  # [T, heads, D] -> [N, heads, seq_len, D]
            return t.view(-1, seq_len, t.shape[1], self.head_dim).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), is_causal=True, enable_gqa=True)
        ctx = ctx.transpose(1, 2).reshape(h.shape[0], self.num_heads * self.head_dim)
        return self.linear("self_attn.o_proj", ctx, override), ctx

    def mlp(self, h: torch.Tensor, override: Weights | None = None):
        """-> (mlp output, down_proj's input)."""
        gate_up = torch.cat([self.linear("mlp.gate_proj", h, override), self.linear("mlp.up_proj", h, override)], -1)
        act = silu_and_mul(gate_up)
        return self.linear("mlp.down_proj", act, override), act

    def forward(
        self, x: torch.Tensor, seq_len: int, before: Callable[[str, torch.Tensor], None] | None = None
    ) -> tuple[torch.Tensor, LayerInputs]:
        """x [T, hidden] (the residual stream entering the layer) -> (the stream leaving it, the linears' inputs).
        `before(group, input)`, when given, runs before each group of linears (a LayerInputs field name) and may
        replace their weights in self.w, which the rest of the forward then uses: GPTQ's true-sequential pass."""
        h, _ = add_rms_norm(x, None, self.w["input_layernorm.weight"], self.eps)
        if before is not None:
            before("qkv", h)
        attn, ctx = self.attention(h, seq_len)
        if before is not None:
            before("o_proj", ctx)
            attn = self.linear("self_attn.o_proj", ctx)
        h2, x = add_rms_norm(attn, x, self.w["post_attention_layernorm.weight"], self.eps)
        if before is not None:
            before("gate_up", h2)
        out, act = self.mlp(h2)
        if before is not None:
            before("down_proj", act)
            out = self.linear("mlp.down_proj", act)
        return x + out, LayerInputs(qkv=h, o_proj=ctx, gate_up=h2, down_proj=act)
