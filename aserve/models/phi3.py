"""Phi-3 (`Phi3ForCausalLM`): the Llama decoder, with q/k/v and gate/up already fused in the checkpoint (its
`qkv_proj` and `gate_up_proj` load as they are), and LongRoPE ("longrope", formerly "su") where the config asks for
it: rescale factors per frequency and cos/sin multiplied by an attention factor.

LongRoPE switches from its short factors to its long ones once a sequence is longer than
`original_max_position_embeddings`, and transformers then recomputes the whole sequence's keys with the long ones.
aserve serves such models up to that length (the short factors, exactly): max_model_len is capped there
(aserve/config.py resolve_max_model_len).
"""

from __future__ import annotations

from aserve.layers.elementwise import RotaryEmbedding, rope_attention_factor, rope_parameters
from aserve.models.llama import LlamaForCausalLM, head_dim_of


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, backend, ops, quant_config, max_position: int) -> None:
        super().__init__(cfg, backend, ops, quant_config, max_position)
        theta, scaling = rope_parameters(cfg)
        if scaling["rope_type"] in ("longrope", "su"):
            original = scaling.setdefault("original_max_position_embeddings", cfg.original_max_position_embeddings)
            assert max_position <= original, "resolve_max_model_len caps max_model_len for LongRoPE"
            if scaling.get("partial_rotary_factor", 1.0) != 1.0:
                raise ValueError("partial_rotary_factor other than 1 is not supported")
            scale = rope_attention_factor(scaling, cfg.max_position_embeddings)
            self.rotary = RotaryEmbedding(head_dim_of(cfg), max_position, theta, scaling, scale)
