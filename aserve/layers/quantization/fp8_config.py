"""The `fp8` quantisation config (vLLM's Fp8Config): FP8 weights quantised at load (`--quantization fp8` on a 16-bit
checkpoint), or a checkpoint that declares

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic" | "static",
                            "ignored_layers": [...], "weight_block_size": [bn, bk]}     (the last two optional)

as vLLM, AutoFP8 and DeepSeek-V3 / Qwen3's FP8 releases write it: e4m3 weights with one scale per tensor
(`weight_scale`), static activations with a per-tensor `input_scale`, or, with `weight_block_size`, one scale per
bn x bk tile (`weight_scale_inv`, activations dynamic). `ignored_layers` (exact names or "re:" patterns) and
transformers' `modules_to_not_convert` (name fragments) stay 16-bit. The tensors and how they load:
fp8_checkpoint.py; the kernels: fp8.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from aserve.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from aserve.layers.moe import UnquantizedMoEMethod
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.fp8 import Fp8LinearMethod
from aserve.layers.quantization.fp8_checkpoint import (
    Fp8CheckpointLinearMethod,
    Fp8Scheme,
    checkpoint_tensors,
    layer_is_quantized,
)
from aserve.layers.quantization.fp8_moe import Fp8CheckpointMoEMethod, Fp8MoEMethod


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    name = "fp8"

    scheme: Fp8Scheme | None = None  # None: a 16-bit checkpoint, quantised at load
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Fp8Config:
        fmt = str(raw.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"FP8 checkpoint with fmt {fmt!r}: aserve reads e4m3 weights only")
        activations = str(raw.get("activation_scheme", "dynamic")).lower()
        if activations not in ("dynamic", "static"):
            raise ValueError(f"FP8 activation_scheme {activations!r} is not supported (dynamic, static)")
        block = raw.get("weight_block_size")
        if block is None:
            scheme = Fp8Scheme("tensor", activations)
        else:
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"FP8 weight_block_size {block!r}: expected two positive integers [rows, columns]")
            if activations != "dynamic":
                raise ValueError("FP8 weight_block_size with static activations: not supported (dynamic only)")
            scheme = Fp8Scheme("block", "dynamic", (block[0], block[1]), "weight_scale_inv")
        ignored = [*(raw.get("ignored_layers") or ())]
        ignored += [f"re:.*{re.escape(m)}" for m in raw.get("modules_to_not_convert") or ()]
        return cls(scheme=scheme, ignored=tuple(ignored))

    def to_hf(self) -> dict[str, Any]:
        s = self.scheme
        out: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": s.activations if s else "dynamic"}
        if s is not None and s.block is not None:
            out["weight_block_size"] = list(s.block)
        if self.ignored:
            out["ignored_layers"] = list(self.ignored)
        return out

    def get_linear_method(self, checkpoint_names: Sequence[str]) -> LinearMethodBase:
        if self.scheme is None:
            return Fp8LinearMethod()
        if not layer_is_quantized(checkpoint_names, self.ignored, "FP8 ignored_layers"):
            return UnquantizedLinearMethod()
        return Fp8CheckpointLinearMethod(self.scheme, fused=len(checkpoint_names) > 1)

    def get_moe_method(self, expert_names: Sequence[str]) -> UnquantizedMoEMethod:
        """Experts quantised at load, or the checkpoint's FP8 experts (fp8_moe.py); 16-bit where ignored."""
        if self.scheme is None:
            return Fp8MoEMethod()
        if not layer_is_quantized(expert_names, self.ignored, "FP8 ignored_layers"):
            return UnquantizedMoEMethod()
        return Fp8CheckpointMoEMethod(self.scheme)

    def checkpoint_weights(self, weights: Iterable) -> Iterable:
        return weights if self.scheme is None else checkpoint_tensors(weights)
