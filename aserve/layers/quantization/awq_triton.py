"""The AWQ linear method on the Triton kernels of aserve/kernels/awq.py (GPUs; Triton's interpreter in tests), kept
apart from aserve/layers/quantization/awq.py because Triton is optional: this module is imported once a layer
chooses these kernels.

Each layer has its own counters for the M = 1 kernel's fused split-K reduction, made on its first call (outside CUDA
graph capture), and runs over awq_repack's copy of its weights where that layout fits (group size 128, outputs a
multiple of 128); other layers keep the AutoAWQ tensors and kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels.awq import (
    awq_dequantize_repacked,
    awq_gemv_repacked,
    awq_linear,
    awq_repack,
    gemv_counters,
    tuning,
)


def silu_mul_out_limits() -> tuple[int, tuple]:
    """apply_silu_mul_out takes up to this many rows of these dtypes (the f16x2 GEMV over the repacked copy, as
    tuned now)."""
    return tuning.REPACKED_GEMV1_MAX_M, tuning.F16X2_DTYPES


def repack(layer: nn.Module, drop_autoawq: bool) -> bool:
    """layer.repacked <- awq_repack's copy (False where the layout does not fit); with `drop_autoawq`, qweight /
    qzeros / scales are freed. -> whether it fits."""
    packed = awq_repack(layer.qweight, layer.qzeros, layer.scales, layer.group_size)
    layer.repacked = packed if packed is not None else False
    if packed is not None and drop_autoawq:
        for param in (layer.qweight, layer.qzeros, layer.scales):
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        layer.autoawq_dropped = True
    return packed is not None


def dequantized_weight(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The repacked copy -> W [out, in] in `dtype`."""
    return awq_dequantize_repacked(layer.repacked, dtype).t()


def _counters(layer: nn.Module, device: torch.device) -> torch.Tensor:
    counters = layer.gemv_counters
    if counters is None or counters.device != device:
        counters = layer.gemv_counters = gemv_counters(layer.out_features, device)
    return counters


def apply(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [M, in] -> [M, out]: awq_linear's kernel for M, over the repacked copy where there is one (made here on the
    first call if repack() was not called, or again after new weights or a move to another device)."""
    counters = _counters(layer, x.device)
    packed = layer.repacked
    if packed is None or (packed is not False and packed.wq.device != x.device):
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("AWQ layer: run it once before CUDA graph capture (a warm-up)")
        if layer.autoawq_dropped:
            raise RuntimeError("AWQ layer: the repacked weights are on another device than the input")
        layer.quant_method.repack(layer, drop_autoawq=False)
        packed = layer.repacked
    return awq_linear(x, layer.qweight, layer.qzeros, layer.scales, layer.group_size, layer.bias, counters,
                      packed or None)  # fmt: skip


def apply_dequantized(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The torch path once repack() freed the AutoAWQ tensors: dequantise the repacked copy, then matmul."""
    w = dequantized_weight(layer, x.dtype)
    return F.linear(x, w, None if layer.bias is None else layer.bias.to(x.dtype))


def apply_silu_mul_out(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of this [gate | up] layer's output, in the f16x2 GEMV over the repacked copy."""
    return awq_gemv_repacked(x, layer.repacked, layer.bias, _counters(layer, x.device), silu_mul_out=True)
