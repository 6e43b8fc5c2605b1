"""Int4 experts of a mixture-of-experts block (aserve/layers/moe.py) read from AWQ and GPTQ checkpoints, which store
each expert's gate, up and down projections as int4 linears in the layouts the linear layers load:

    AWQ    {module}.qweight int32 [in, out/8], .qzeros int32 [in/g, out/8], .scales fp16 [in/g, out]
           (aserve/kernels/awq_reference.py)
    GPTQ   {module}.qweight int32 [in/8, out], .qzeros int32 [G, out/8], .scales fp16 [G, out], .g_idx int32 [in]
           (aserve/layers/quantization/gptq_format.py; act order included: every projection keeps its own g_idx)

with {module} e.g. model.layers.0.mlp.experts.3.gate_proj (Mixtral: ...block_sparse_moe.experts.3.w1). The block
holds its experts 16-bit, in the stacks w13 [E, 2 I, H] / w2 [E, H, I] of the model's dtype: a projection is
dequantised into its rows as soon as all of its tensors are in (GPTQ through gptq_format.to_awq, as its linears are
repacked, then awq_reference.dequantize), so loading holds one projection's int4 tensors at a time beside the
stacks. The block's kernels (per-expert matmuls on CPU, fused Triton on GPU) then run them as unquantised experts:
the int4 experts take 16-bit memory (one log line says so).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from aserve.kernels.awq_reference import dequantize
from aserve.layers.moe import UnquantizedMoEMethod
from aserve.layers.quantization.awq_format import PACK_FACTOR
from aserve.layers.quantization.gptq_format import to_awq

logger = logging.getLogger("aserve")

PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}
# (FusedMoE parameter, shard of w13) -> index of the projection in `expert_names` (gate, up, down)
_PROJECTION_INDEX = {("w13", 0): 0, ("w13", 1): 1, ("w2", None): 2}
_logged: set[str] = set()


class Int4MoEMethod(UnquantizedMoEMethod):
    """`checkpoint_format`: awq | gptq; `group_size`: inputs per group (-1: all of a projection's inputs, GPTQ);
    `gptq_version`: 1 (zero points stored minus one) or 2; `expert_names`: the checkpoint's modules of expert 0's
    gate, up and down projections (errors name the checkpoint's tensors by them). State on the layer while loading:
    `int4_parts` ((parameter, expert, shard) -> the projection's tensors in so far) and `int4_done` (the projections
    dequantised)."""

    def __init__(self, checkpoint_format: str, group_size: int, gptq_version: int = 1,
                 expert_names: Sequence[str] = ()) -> None:  # fmt: skip
        self.format, self.parts = checkpoint_format, PARTS[checkpoint_format]
        self.group_size, self.gptq_version = group_size, gptq_version
        self.expert_names = tuple(expert_names)

    def create_weights(self, layer: nn.Module, hidden_size: int) -> None:
        for in_features in (hidden_size, layer.intermediate_size):
            group = in_features if self.group_size == -1 else self.group_size
            if in_features % group or in_features % PACK_FACTOR:
                raise ValueError(f"{self.format} experts: input size {in_features} is not a multiple of group_size "
                                 f"{group} and 8")  # fmt: skip
        if layer.intermediate_size % PACK_FACTOR or hidden_size % PACK_FACTOR:
            raise ValueError(f"{self.format} experts: output sizes {layer.intermediate_size} and {hidden_size} must "
                             "be multiples of 8")  # fmt: skip
        super().create_weights(layer, hidden_size)  # the 16-bit stacks the projections are dequantised into
        layer.int4_parts, layer.int4_done = {}, set()

    def checkpoint_name(self, param_name: str, expert: int, shard: int | None) -> str:
        """The checkpoint's module of expert `expert`'s projection (its gate, up or down)."""
        index = _PROJECTION_INDEX[(param_name, shard)]
        if index >= len(self.expert_names):
            return f"experts.{expert}.{('gate', 'up', 'down')[index]}"
        return self.expert_names[index].replace(".experts.0.", f".experts.{expert}.")

    def load_packed(self, layer: nn.Module, param_name: str, expert: int, shard: int | None, part: str,
                    tensor: torch.Tensor) -> bool:  # fmt: skip
        """One of a projection's int4 tensors (`part`: qweight, qzeros, scales or g_idx); once all are in, the
        projection is dequantised into its rows of the stack. -> whether it was."""
        key = (param_name, expert, shard)
        if part not in self.parts:
            raise ValueError(f"{self.checkpoint_name(*key)}.{part}: not a tensor of {self.format} checkpoints")
        target = getattr(layer, param_name)
        parts = layer.int4_parts.setdefault(key, {})
        parts[part] = tensor.to(target.device)
        if len(parts) < len(self.parts):
            return False
        del layer.int4_parts[key]
        out_features = layer.intermediate_size if shard is not None else target.shape[1]
        weight = self._dequantize(parts, out_features, target.shape[2], self.checkpoint_name(*key))
        layer.load_expert(target, expert, shard, weight)
        layer.int4_done.add(key)
        return True

    def _dequantize(self, parts: dict[str, torch.Tensor], out_features: int, in_features: int, name: str):
        """-> W float32 [out, in] of one projection's tensors, whose shapes are checked first."""
        group = in_features if self.group_size == -1 else self.group_size
        groups, packed = in_features // group, out_features // PACK_FACTOR
        expected = {"qzeros": (groups, packed), "scales": (groups, out_features), "g_idx": (in_features,),
                    "qweight": (in_features, packed) if self.format == "awq" else (in_features // PACK_FACTOR,
                                                                                   out_features)}  # fmt: skip
        for part, tensor in parts.items():
            if tuple(tensor.shape) != expected[part]:
                raise ValueError(f"{name}.{part}: checkpoint shape {tuple(tensor.shape)} != {expected[part]} "
                                 f"({self.format}, group_size {group})")  # fmt: skip
        if self.format == "awq":
            return dequantize(parts["qweight"], parts["qzeros"], parts["scales"], group).t()
        repacked = to_awq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"], group,
                          self.gptq_version)  # fmt: skip
        w = dequantize(repacked.qweight, repacked.qzeros, repacked.scales, group)  # inputs in input_perm's order
        if repacked.input_perm is not None:
            w = torch.empty_like(w).index_copy_(0, repacked.input_perm, w)
        return w.t()

    def missing_tensors(self, layer: nn.Module) -> list[str]:
        """The checkpoint tensors of projections not dequantised (named as the checkpoint names them)."""
        missing = []
        for expert in range(layer.num_experts):
            for param_name, shard in _PROJECTION_INDEX:
                key = (param_name, expert, shard)
                if key not in layer.int4_done:
                    have = layer.int4_parts.get(key, {})
                    missing += [f"{self.checkpoint_name(*key)}.{p}" for p in self.parts if p not in have]
        return missing

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.int4_parts = {}
        message = f"{self.format}: int4 experts dequantised to %s at load, run by the unquantised expert kernels "
        message += "(no int4 kernel for experts: their memory is not saved)"
        if message not in _logged:
            _logged.add(message)
            logger.info(message, str(layer.w13.dtype).removeprefix("torch."))
