"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama decoder in which some layers use no rotary at all (NoPE: config
`no_rope_layers`, 1 where a layer turns q and k, 0 where it does not; every fourth layer in the released models).
A NoPE layer is given cos 1 and sin 0 in place of the step's tables, so the rotary it runs leaves q and k as they
are. The step's rotary (NoPERotary) builds both pairs of tables once; each layer takes its own. Everything else is
the Llama family's.
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.models.llama import DecoderLayer, LlamaForCausalLM


class NoPERotary(nn.Module):
    """The family's rotary -> (cos, sin, 1, 0): the step's tables, then the identity tables of the same shape."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.inner = rotary

    def materialize(self, device: torch.device) -> None:
        self.inner.materialize(device)

    def forward(self, positions, dtype, meta=None):
        cos, sin = self.inner(positions, dtype, meta)
        return cos, sin, torch.ones_like(cos), torch.zeros_like(sin)


class SmolLM3DecoderLayer(DecoderLayer):
    uses_rope = True  # set per layer from no_rope_layers

    def forward(self, rotary_cos_sin, x, residual, kv_cache, meta):
        tables = rotary_cos_sin[:2] if self.uses_rope else rotary_cos_sin[2:]
        return super().forward(tables, x, residual, kv_cache, meta)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    layer_cls = SmolLM3DecoderLayer
    one_token_path = False  # the CPU one-token forward turns q and k in every layer

    def __init__(self, cfg, backend, ops, quant_config, max_position: int) -> None:
        super().__init__(cfg, backend, ops, quant_config, max_position)
        flags = getattr(cfg, "no_rope_layers", None) or [1] * cfg.num_hidden_layers
        if len(flags) != len(self.layers):
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {len(self.layers)} layers")
        for layer, uses_rope in zip(self.layers, flags):
            layer.uses_rope = bool(uses_rope)
        self.rotary = NoPERotary(self.rotary)
