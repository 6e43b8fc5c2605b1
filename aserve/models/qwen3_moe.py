"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (a per-head RMSNorm on q and k) and a mixture-of-experts
block (aserve/layers/moe.py) as the MLP of every `decoder_sparse_step`-th layer not listed in `mlp_only_layers`, the
others keeping a dense MLP of `intermediate_size`. Routing: softmax over the experts, the top num_experts_per_tok,
renormalised when `norm_topk_prob`. Experts load as Mixtral's do (models/mixtral.py SparseMoeWeights).
"""

from __future__ import annotations

from aserve.layers.moe import FusedMoE
from aserve.models.mixtral import SparseMoeWeights
from aserve.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


def is_sparse_layer(cfg, index: int) -> bool:
    """As transformers' Qwen3MoeDecoderLayer decides."""
    if index in (getattr(cfg, "mlp_only_layers", None) or []) or cfg.num_experts == 0:
        return False
    return (index + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, cfg, ops, quant_config, prefix: str):
        index = int(prefix.split(".")[2])  # model.layers.{index}.mlp
        if not is_sparse_layer(cfg, index):
            return super().make_mlp(cfg, ops, quant_config, prefix)
        return FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                        renormalize=cfg.norm_topk_prob, quant_config=quant_config,
                        expert_names=tuple(f"{prefix}.experts.0.{p}_proj" for p in ("gate", "up", "down")))  # fmt: skip


class Qwen3MoeForCausalLM(SparseMoeWeights, Qwen3ForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
