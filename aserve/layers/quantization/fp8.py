"""FP8 (e4m3) weights, quantised when the model is loaded (`--quantization fp8` on a 16-bit checkpoint, as vLLM).

Each linear layer's weight gets one scale per output channel (its largest magnitude / 448, e4m3's largest value).
On a GPU with FP8 tensor cores (compute capability 8.9 and newer) the weight is kept in FP8 (half the bytes of bf16)
and every call quantises its activations per token (dynamic scales) and runs torch._scaled_mm with both sets of
scales. Elsewhere (CPU, older GPUs) the weights are rounded to FP8 and kept in the model's dtype, so the model
computes what the FP8 weights say with the unquantised kernels (weight-only, no memory saved); one log line says so.
The lm_head and the embeddings stay unquantised.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from aserve.layers.linear import UnquantizedLinearMethod
from aserve.layers.quantization.base import QuantizationConfig

logger = logging.getLogger("aserve")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 weight [N, K], float32 scale [N]) with weight ~= fp8.float() * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight_fp8.float() * scale[:, None]).to(dtype)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]); the reference of aserve/kernels/fp8.py."""
    x_scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), x_scale


def _scaled_mm(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [T, K] in 16 bits -> per-token e4m3 activations and scales (layer.quantize_input) -> x W^T (+ b)."""
    x_fp8, x_scale = layer.quantize_input(x)
    return torch._scaled_mm(x_fp8, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale,
                            bias=layer.bias, out_dtype=x.dtype)  # fmt: skip


class Fp8LinearMethod(UnquantizedLinearMethod):
    """Loads like an unquantised layer (the checkpoint is 16-bit), then quantises in process_weights_after_loading."""

    _logged_emulation = False

    def process_weights_after_loading(self, layer):
        w = layer.weight
        if w.dtype != FP8:
            weight_fp8, scale = quantize_per_channel(w.detach())
            if not (has_fp8_tensor_cores(w.device) and w.dtype in (torch.bfloat16, torch.float16)):
                self._emulate(layer, weight_fp8, scale)
                return
            layer.weight = nn.Parameter(weight_fp8, requires_grad=False)
            layer.weight_scale = scale.view(1, -1)
        # (an FP8 weight: prepared already, and this runs again whenever the weights change)
        from aserve.kernels import fp8  # Triton: imported where a GPU runs it

        self._reset(layer)
        layer.quantize_input = fp8.quantize_per_token
        layer.kernel = _scaled_mm

    def _emulate(self, layer, weight_fp8: torch.Tensor, scale: torch.Tensor) -> None:
        """No FP8 tensor cores: the FP8-rounded weights in the model's dtype, through the unquantised kernels."""
        w = layer.weight
        if not Fp8LinearMethod._logged_emulation:
            Fp8LinearMethod._logged_emulation = True
            logger.info("fp8: no FP8 tensor cores on %s: weights rounded to FP8, computed in %s (weight-only)",
                        w.device, str(w.dtype).removeprefix("torch."))  # fmt: skip
        w.data.copy_(dequantize(weight_fp8, scale, w.dtype))
        super().process_weights_after_loading(layer)


class Fp8Config(QuantizationConfig):
    name = "fp8"

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Fp8Config:
        raise ValueError(
            "pre-quantised FP8 checkpoints are not supported yet: load the 16-bit checkpoint with --quantization fp8 "
            "(quantised when the model loads)"
        )

    def to_hf(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}

    def get_linear_method(self, checkpoint_names: Sequence[str]) -> Fp8LinearMethod:
        return Fp8LinearMethod()
