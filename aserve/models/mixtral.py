"""Mixtral (`MixtralForCausalLM`): the Llama decoder with a mixture-of-experts block (aserve/layers/moe.py) in place
of every MLP: softmax over the experts, the top num_experts_per_tok (2), renormalised.

Also what every mixture-of-experts family here shares (SparseMoeWeights, used by models/qwen3_moe.py): the experts'
checkpoint tensors stacked into the block's w13 / w2 as they load, and the block's kernel chosen after loading.
transformers' save_pretrained writes one tensor per expert and projection:

    Mixtral     model.layers.{i}.block_sparse_moe.experts.{e}.{w1 (gate), w3 (up), w2 (down)}.weight
                model.layers.{i}.block_sparse_moe.gate.weight (the router)
    Qwen3-MoE   model.layers.{i}.mlp.experts.{e}.{gate_proj, up_proj, down_proj}.weight
                model.layers.{i}.mlp.gate.weight

and transformers' own stacked names (model.layers.{i}.mlp.experts.gate_up_proj [E, 2 I, H], .down_proj [E, H, I])
load as they are. FP8 checkpoints add each projection's weight_scale (or weight_scale_inv) and, with static
activations, input_scale beside its weight: the block's quantisation method takes them (aserve/layers/quantization/
fp8_moe.py). AWQ and GPTQ checkpoints store each expert's projection as int4 tensors, {projection}.qweight / .qzeros
/ .scales (GPTQ also .g_idx), which the method dequantises into the stacks (aserve/layers/quantization/int4_moe.py).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator

import torch

from aserve.layers.moe import FusedMoE
from aserve.models.llama import DecoderLayer, LlamaForCausalLM

_PER_EXPERT = re.compile(
    r"(layers\.\d+\.mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale|weight_scale_inv|input_scale|qweight|qzeros|scales|g_idx)"
)
_INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # AWQ / GPTQ experts (aserve/layers/quantization/int4_moe.py)
_STACKED_EXPERTS = re.compile(r"(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)")
# checkpoint projection -> (FusedMoE parameter, shard of w13)
_PROJECTIONS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
                "w2": ("w2", None), "down_proj": ("w2", None), "gate_up_proj": ("w13", None)}  # fmt: skip


class SparseMoeWeights:
    """Mixed into a Llama-family model whose layers hold FusedMoE blocks as `mlp` (module docstring)."""

    def __init__(self, cfg, *args, **kwargs) -> None:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        super().__init__(cfg, *args, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts_loaded: set[str] = set()
        loaded = super().load_weights(self._load_experts(weights, experts_loaded))
        return loaded | experts_loaded

    def _load_experts(self, weights, loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Copies the expert tensors into their blocks; yields the rest, Mixtral's block_sparse_moe renamed mlp.
        Adds to `loaded` the blocks' w13 / w2 that every expert's tensors filled."""
        params = dict(self.named_parameters())
        pieces = Counter()  # w13 / w2 name -> expert projections copied into it
        for name, tensor in weights:
            name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            match = _PER_EXPERT.fullmatch(name) or _STACKED_EXPERTS.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            block, *expert, projection, kind = match.groups() if match.re is _PER_EXPERT else (*match.groups(), None)
            param_name, shard = _PROJECTIONS[projection]
            target = f"{block}.{param_name}"
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__} (a dense layer?)")
            moe = self.get_submodule(block)
            whole = moe.num_experts * (2 if param_name == "w13" else 1)  # gate and up of each expert, or down
            if kind == "input_scale":
                moe.load_expert_scale("input_scale", int(expert[0]), shard, tensor)
                continue
            if kind in ("weight_scale", "weight_scale_inv"):  # FP8: scales for the rows of the projection
                moe.load_expert_scale(param_name, int(expert[0]), shard, tensor)
                target = f"{target}_scale"
                pieces[target] += 1
            elif kind in _INT4_PARTS:  # counted once all of the projection's int4 tensors are in
                pieces[target] += moe.load_expert_packed(param_name, int(expert[0]), shard, kind, tensor)
            elif expert:  # one expert's projection
                moe.load_expert(params[target], int(expert[0]), shard, tensor)
                pieces[target] += 1
            else:  # all experts stacked
                if params[target].shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(params[target].shape)}")
                params[target].data.copy_(tensor)
                pieces[target] += whole
            if pieces[target] == whole:
                loaded.add(target)
        for name, moe in self.named_modules():  # int4 experts name the checkpoint tensors that never came
            if isinstance(moe, FusedMoE) and not {f"{name}.w13", f"{name}.w2"} <= loaded:
                if missing := moe.quant_method.missing_tensors(moe):
                    raise ValueError(f"checkpoint lacks tensors of experts: {missing[:8]}")

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, FusedMoE):
                module.process_weights_after_loading()


class MixtralDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg, ops, quant_config, prefix: str) -> FusedMoE:
        experts = prefix.replace(".mlp", ".block_sparse_moe") + ".experts.0"  # the checkpoint's names
        return FusedMoE(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size,
                        renormalize=True, quant_config=quant_config,
                        expert_names=tuple(f"{experts}.{p}" for p in ("w1", "w3", "w2")))  # fmt: skip


class MixtralForCausalLM(SparseMoeWeights, LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    one_token_path = False  # the CPU one-token forward knows only dense MLPs
