"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama decoder in which some layers use no rotary at all (NoPE: config
`no_rope_layers`, 1 where a layer turns q and k, 0 where it does not; every fourth layer in the released models).
A NoPE layer is given cos 1 and sin 0 in place of the step's tables, so the rotary it runs leaves q and k as they
are. Everything else is the Llama family's.
"""

from __future__ import annotations

import torch

from aserve.models.llama import DecoderLayer, LlamaForCausalLM


class SmolLM3DecoderLayer(DecoderLayer):
    uses_rope = True  # set per layer from no_rope_layers

    def forward(self, rotary_cos_sin, x, residual, kv_cache, meta):
        if not self.uses_rope:
            cos, sin = rotary_cos_sin
            rotary_cos_sin = (torch.ones_like(cos), torch.zeros_like(sin))
        return super().forward(rotary_cos_sin, x, residual, kv_cache, meta)


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
