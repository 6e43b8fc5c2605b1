"""llm-compressor's checkpoints (`quant_method: "compressed-tensors"`, as vLLM reads them), for FP8 weights:

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
      "ignore": ["lm_head"],
      "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": true, "dynamic": false},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": true}}}}

(the FP8_DYNAMIC scheme). Weights: strategy channel (`weight_scale` [N, 1]), tensor ([1]) or block (with
`block_structure` [bn, bk]: one scale per tile, FP8_BLOCK); input activations: dynamic (per token, per tensor or
per group: quantised per token here), static per tensor (`input_scale`), or none (W8A16). `targets` name the layers
a group applies to: "Linear" (every linear), exact module names, or "re:" patterns; `ignore` likewise keeps
layers 16-bit. Each other variant (integer or 4-bit weights, asymmetric or dynamic weights, sparsity, transforms,
output activations) is refused with a message naming it. The tensors and how they load: fp8_checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aserve.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from aserve.layers.moe import UnquantizedMoEMethod
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.fp8_checkpoint import (
    Fp8CheckpointLinearMethod,
    Fp8Scheme,
    checkpoint_tensors,
    layer_is_quantized,
    matches,
)
from aserve.layers.quantization.fp8_moe import Fp8CheckpointMoEMethod

FORMATS = ("float-quantized", "naive-quantized")
DYNAMIC_ACTIVATION_STRATEGIES = ("token", "tensor", "group")


def _weight_scheme(group: str, weights: dict | None, inputs: dict | None) -> Fp8Scheme:
    """A config group's weights / input_activations -> its Fp8Scheme (ValueError naming what is not supported)."""
    where = f"compressed-tensors config group {group!r}"
    if not weights:
        raise ValueError(f"{where} quantises no weights: not supported")
    kind, bits = str(weights.get("type", "int")).lower(), weights.get("num_bits")
    if kind != "float" or bits != 8:
        raise ValueError(f"{where}: {bits}-bit {kind} weights are not supported (aserve reads 8-bit float weights)")
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise ValueError(f"{where}: asymmetric or dynamic FP8 weights are not supported")
    strategy = str(weights.get("strategy", "tensor")).lower()
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if not structure or len(structure) != 2:
            raise ValueError(f"{where}: block strategy without a block_structure [rows, columns]")
        block = (int(structure[0]), int(structure[1]))
    elif strategy not in ("tensor", "channel"):
        raise ValueError(f"{where}: weight strategy {strategy!r} is not supported (tensor, channel, block)")
    if not inputs:
        activations = None
    else:
        kind, bits = str(inputs.get("type", "int")).lower(), inputs.get("num_bits")
        in_strategy = str(inputs.get("strategy", "tensor")).lower()
        if kind != "float" or bits != 8:
            raise ValueError(f"{where}: {bits}-bit {kind} input activations are not supported (8-bit float)")
        if inputs.get("dynamic", False) and in_strategy in DYNAMIC_ACTIVATION_STRATEGIES:
            activations = "dynamic"
        elif not inputs.get("dynamic", False) and in_strategy == "tensor" and block is None:
            activations = "static"
        else:
            raise ValueError(f"{where}: input activations {in_strategy} (dynamic {inputs.get('dynamic')}) with "
                             f"{strategy} weights are not supported")  # fmt: skip
        if not inputs.get("symmetric", True):
            raise ValueError(f"{where}: asymmetric input activations are not supported")
    return Fp8Scheme(strategy, activations, block)


@dataclass(frozen=True)
class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...] = ()  # (targets, scheme), in the config's order
    ignore: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> CompressedTensorsConfig:
        fmt = str(raw.get("format", "")).lower()
        if fmt not in FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported (aserve reads FP8 checkpoints: "
                             f"{', '.join(FORMATS)})")  # fmt: skip
        for key in ("sparsity_config", "transform_config"):
            if raw.get(key):
                raise ValueError(f"compressed-tensors checkpoint with a {key}: not supported")
        status = str(raw.get("quantization_status", "compressed")).lower()
        if status not in ("compressed", "frozen"):
            raise ValueError(f"compressed-tensors quantization_status {status!r}: the weights are not quantised yet")
        groups = []
        for name, group in (raw.get("config_groups") or {}).items():
            if group.get("output_activations"):
                raise ValueError(f"compressed-tensors config group {name!r} quantises output activations: "
                                 "not supported")  # fmt: skip
            scheme = _weight_scheme(name, group.get("weights"), group.get("input_activations"))
            groups.append((tuple(group.get("targets") or ()), scheme))
        if not groups:
            raise ValueError("compressed-tensors checkpoint without config_groups")
        return cls(groups=tuple(groups), ignore=tuple(raw.get("ignore") or ()), raw=dict(raw))

    def to_hf(self) -> dict[str, Any]:
        return dict(self.raw)

    def scheme_of(self, name: str) -> Fp8Scheme | None:
        """The scheme of the checkpoint linear `name`: the group that names it, or by a pattern, or targets every
        "Linear" (in that order, as vLLM); None where none does."""
        for exact_only in (True, False):
            for targets, scheme in self.groups:
                if any((t == name) if exact_only else (t.startswith("re:") and matches(name, [t])) for t in targets):
                    return scheme
        return next((scheme for targets, scheme in self.groups if "Linear" in targets), None)

    def scheme_of_parts(self, names: Sequence[str]) -> Fp8Scheme | None:
        """The one scheme of the checkpoint modules `names` that aserve runs as one (a fused layer's parts, an
        expert's projections); None where they are ignored or no group names them."""
        if not layer_is_quantized(names, self.ignore, "compressed-tensors ignore"):
            return None
        schemes = {self.scheme_of(name) for name in names}
        if len(schemes) > 1:
            raise ValueError(f"compressed-tensors: {list(names)} are run as one but have different schemes: "
                             "not supported")  # fmt: skip
        return schemes.pop() if schemes else None

    def get_linear_method(self, checkpoint_names: Sequence[str]) -> LinearMethodBase:
        scheme = self.scheme_of_parts(checkpoint_names)
        if scheme is None:
            return UnquantizedLinearMethod()
        return Fp8CheckpointLinearMethod(scheme, fused=len(checkpoint_names) > 1)

    def get_moe_method(self, expert_names: Sequence[str]) -> UnquantizedMoEMethod:
        """The checkpoint's FP8 experts (fp8_moe.py); 16-bit where ignored or no group names them."""
        scheme = self.scheme_of_parts(expert_names)
        return UnquantizedMoEMethod() if scheme is None else Fp8CheckpointMoEMethod(scheme)

    def checkpoint_weights(self, weights: Iterable) -> Iterator:
        """fp8_checkpoint.checkpoint_tensors, and symmetric weights' zero points (all 0) dropped."""
        for name, tensor in checkpoint_tensors(weights):
            if name.endswith("_zero_point"):
                if torch.count_nonzero(tensor):
                    raise ValueError(f"compressed-tensors: {name} is not zero (asymmetric): not supported")
                continue
            yield name, tensor
