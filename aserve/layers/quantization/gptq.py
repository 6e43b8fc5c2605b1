"""GPTQ int4 checkpoints (AutoGPTQ, GPTQModel, optimum): the config a checkpoint declares, and the linear method
that loads its tensors and repacks them into the AutoAWQ layout, where the AWQ method and kernels take over.

Where a checkpoint says it is GPTQ:
    config.json            "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                   "desc_act": false, "sym": true, "checkpoint_format": "gptq"}
    quantize_config.json   (older AutoGPTQ, beside config.json) the same fields, without quant_method

Supported: 4 bits; group sizes that are multiples of 16 (32, 64, 128) and -1 (one group per output channel);
symmetric and asymmetric; desc_act false and true (act order: g_idx); formats v1 ("gptq") and v2 ("gptq_v2"); a
quantised lm_head (GPTQModel's `"lm_head": true`: lm_head.qweight etc., run as the other linears; the embedding
stays 16-bit, so a tied model's head is untied). And 8 bits with group_size -1, on the int8 kernels (gptq_int8.py).
Each other variant is refused with a message naming it. The tensors and their layout: gptq_format.py.

A fused layer (qkv_proj = q|k|v, gate_up_proj = gate|up) concatenates its parts along the output dimension (the
last one of qweight, qzeros and scales). Its parts share one input, so GPTQ gave them one g_idx (the input order
comes from that input's statistics); parts whose g_idx differ are refused.

process_weights_after_loading repacks the tensors (gptq_format.to_awq), puts the AutoAWQ tensors in their place and
hands the layer to an AWQLinearMethod (layer.quant_method), which prepares them for its kernels (Triton on GPUs, a
dequantised copy on CPUs; aserve/layers/quantization/awq.py). With act order, that method is ActOrderAWQLinearMethod:
its weights' inputs are sorted by group and every call gathers its input's columns in that order first.

Experts of mixture-of-experts blocks (4-bit only): int4_moe.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aserve.layers.linear import LinearMethodBase
from aserve.layers.quantization import gptq_format
from aserve.layers.quantization.awq import AWQConfig, AWQLinearMethod
from aserve.layers.quantization.awq_format import PACK_FACTOR
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.gptq_int8 import GPTQInt8LinearMethod
from aserve.layers.quantization.int4_moe import Int4MoEMethod

FORMAT_VERSIONS = {"gptq": 1, "gptq_v2": 2}


@dataclass(frozen=True)
class GPTQConfig(QuantizationConfig):
    name = "gptq"
    legacy_file = "quantize_config.json"

    bits: int = 4
    group_size: int = 128  # -1: one group per output channel (all the inputs)
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"
    lm_head: bool = False  # GPTQModel's `lm_head`: the output projection is quantised too (lm_head.qweight, ...)

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> GPTQConfig:
        bits, group_size = raw.get("bits", 4), raw.get("group_size", 128)
        fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
        if bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoint with {bits}-bit weights: aserve runs 4-bit and 8-bit GPTQ")
        if bits == 8 and group_size != -1:
            raise ValueError(f"8-bit GPTQ with group_size {group_size}: not supported (aserve runs 8-bit GPTQ with one "
                             "scale per output channel, group_size -1, on its int8 kernels)")  # fmt: skip
        if group_size != -1 and (group_size <= 0 or group_size % 16):
            raise ValueError(f"GPTQ group_size {group_size} is not supported (-1 or a multiple of 16: 32, 64, 128)")
        if raw.get("is_marlin_format") or fmt not in FORMAT_VERSIONS:
            fmt = "marlin" if raw.get("is_marlin_format") else fmt
            raise ValueError(f"GPTQ checkpoint format {fmt!r} is not supported (gptq, gptq_v2)")
        if str(raw.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise ValueError(f"GPTQ pack_dtype {raw['pack_dtype']!r} is not supported (int32)")
        if raw.get("lm_head") and bits != 4:
            raise ValueError(f"GPTQ checkpoint with a {bits}-bit quantised lm_head: not supported (4-bit heads are)")
        if raw.get("dynamic"):
            raise ValueError("GPTQ checkpoint with per-module overrides (dynamic): not supported")
        return cls(bits=bits, group_size=group_size, desc_act=bool(raw.get("desc_act", False)),
                   sym=bool(raw.get("sym", True)), checkpoint_format=fmt, lm_head=bool(raw.get("lm_head")))  # fmt: skip

    def to_hf(self) -> dict[str, Any]:
        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "desc_act": self.desc_act,
            "sym": self.sym,
            "checkpoint_format": self.checkpoint_format,
            "lm_head": self.lm_head,
        }

    def checkpoint_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if self.lm_head and name == "lm_head.weight":
                raise ValueError('the GPTQ config says the lm_head is quantised ("lm_head": true), but the checkpoint '
                                 "holds a 16-bit lm_head.weight")  # fmt: skip
            yield name, tensor

    def get_linear_method(self, checkpoint_names: Sequence[str]) -> LinearMethodBase:
        if self.bits == 8:
            return GPTQInt8LinearMethod(FORMAT_VERSIONS[self.checkpoint_format])
        return GPTQLinearMethod(self)

    def get_moe_method(self, expert_names: Sequence[str]) -> Int4MoEMethod:
        """4-bit experts (int4_moe.py: packed, or with act order dequantised as they load); 8-bit experts are
        refused."""
        if self.bits != 4:
            raise ValueError(f"GPTQ checkpoint with {self.bits}-bit experts: not supported (aserve runs 4-bit GPTQ "
                             "experts of mixture-of-experts models)")  # fmt: skip
        return Int4MoEMethod("gptq", self.group_size, FORMAT_VERSIONS[self.checkpoint_format], expert_names,
                             act_order=self.desc_act)  # fmt: skip


def _apply_reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Before processing (tests, direct use): dequantise the GPTQ tensors, then matmul."""
    w = gptq_format.dequantize(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, layer.gptq_version)
    return F.linear(x, w.to(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))


class GPTQLinearMethod(LinearMethodBase):
    """State on the layer until processing: qweight / qzeros / scales / g_idx / bias (parameters), `group_size`
    (resolved: in_features where the config says -1), `gptq_version`, `params_dtype` and `g_idx_parts` (the parts
    of a fused layer whose g_idx is in)."""

    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        group_size = in_features if self.config.group_size == -1 else self.config.group_size
        if in_features % group_size or in_features % PACK_FACTOR:
            raise ValueError(f"GPTQ: input size {in_features} is not a multiple of group_size {group_size} and 8")
        if out_features % PACK_FACTOR:
            raise ValueError(f"GPTQ: output size {out_features} is not a multiple of 8")

        def frozen(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        groups = in_features // group_size
        layer.qweight = frozen(in_features // PACK_FACTOR, out_features, dtype=torch.int32)
        layer.qzeros = frozen(groups, out_features // PACK_FACTOR, dtype=torch.int32)
        layer.scales = frozen(groups, out_features, dtype=torch.float16)
        layer.g_idx = frozen(in_features, dtype=torch.int32)
        layer.bias = frozen(out_features, dtype=dtype) if bias else None
        layer.group_size, layer.params_dtype = group_size, dtype
        layer.gptq_version = FORMAT_VERSIONS[self.config.checkpoint_format]
        layer.g_idx_parts = 0
        layer.kernel = _apply_reference

    def load_output_slice(self, layer, param, start, size, tensor):
        if param is layer.g_idx:  # one per input: every part of a fused layer must hold the same
            if layer.g_idx_parts and not torch.equal(param.data, tensor.to(param.device, param.dtype)):
                raise ValueError("GPTQ act order: the parts of a fused layer (q/k/v or gate/up) have different "
                                 "g_idx; aserve runs them as one layer and needs one input order")  # fmt: skip
            param.data.copy_(tensor)
            layer.g_idx_parts += 1
            return
        pack = PACK_FACTOR if param is layer.qzeros else 1
        assert start % pack == 0 and size % pack == 0, "fused GPTQ parts must be multiples of 8 outputs"
        target = param.data[..., start // pack : (start + size) // pack]
        if target.shape != tensor.shape:
            raise ValueError(f"GPTQ tensor of shape {tuple(tensor.shape)} where {tuple(target.shape)} is expected")
        target.copy_(tensor)

    def process_weights_after_loading(self, layer):
        """Repacks into the AutoAWQ layout and hands the layer to the AWQ method (which prepares its kernels)."""
        repacked = gptq_format.to_awq(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, layer.group_size,
                                      layer.gptq_version)  # fmt: skip
        awq_config = AWQConfig(group_size=layer.group_size)
        method = AWQLinearMethod(awq_config) if repacked.input_perm is None else ActOrderAWQLinearMethod(awq_config)
        bias = layer.bias
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            delattr(layer, name)
        with torch.device("meta"):  # the AWQ method's parameters, then the repacked tensors in their place
            method.create_weights(layer, layer.in_features, layer.out_features, bias is not None, layer.params_dtype)
        for name in ("qweight", "qzeros", "scales"):
            setattr(layer, name, nn.Parameter(getattr(repacked, name), requires_grad=False))
        layer.bias = bias
        layer.input_perm = repacked.input_perm
        layer.quant_method = method
        method.process_weights_after_loading(layer)

    def apply(self, layer, x):
        return layer.kernel(layer, x)


class ActOrderAWQLinearMethod(AWQLinearMethod):
    """An act-order GPTQ layer after repacking: its int4 weights hold the inputs in the order layer.input_perm
    (int64 [in]: position i holds input input_perm[i]), so every call gathers x's columns in that order first."""

    def apply(self, layer, x):
        return layer.kernel(layer, x.index_select(-1, layer.input_perm))

    def apply_silu_mul_out(self, layer, x):
        return layer.silu_mul_out_kernel(layer, x.index_select(-1, layer.input_perm))
