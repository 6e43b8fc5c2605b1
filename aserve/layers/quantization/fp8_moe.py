"""FP8 (e4m3) experts of a mixture-of-experts block (aserve/layers/moe.py), quantised when the model is loaded
(`--quantization fp8` on a 16-bit checkpoint), as the linear layers are (fp8.py): each expert's projections get one
scale per output row, the largest magnitude of the row / 448,

    w13 e4m3 [E, 2 I, H]   w13_scale float32 [E, 2 I]
    w2  e4m3 [E, H, I]     w2_scale  float32 [E, H]

with W = w * scale row by row. What runs, chosen once the weights are in:

    GPU with FP8 support (compute capability 8.9+), 16-bit model: the e4m3 experts stay (half the bytes of 16-bit
        ones) and the fused Triton kernels read them (aserve/kernels/moe.py: weight tiles converted to the
        activations' dtype as they load, each output column scaled; activations stay 16-bit)
    elsewhere (CPU, older GPUs, float32 models): the experts dequantised to the model's dtype at load and computed
        by the unquantised kernels (no memory saved); one log line says so.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from aserve.layers.quantization.fp8 import FP8, FP8_MAX, has_fp8_tensor_cores

logger = logging.getLogger("aserve")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (e4m3 [..., N, K], float32 scales [..., N]) with weight ~= w.float() * scale[..., None];
    fp8.quantize_per_channel's rounding, per matrix of a stack."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_rows, rounded to `dtype` (w * scale in float32)."""
    return (weight_fp8.float() * scale[..., None]).to(dtype)


class Fp8MoEMethod:
    """Quantised at load: the block loads its 16-bit experts as an unquantised one does, then each output row of
    every expert is rounded to e4m3 here (the module docstring)."""

    _logged = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        frozen = nn.Parameter
        if layer.w13.dtype == FP8:  # prepared already (the scales are the layer's)
            return
        dtype, device = layer.w13.dtype, layer.w13.device
        w13, w13_scale = quantize_rows(layer.w13.detach())
        w2, w2_scale = quantize_rows(layer.w2.detach())
        if has_fp8_tensor_cores(device) and dtype in (torch.bfloat16, torch.float16):
            layer.w13, layer.w2 = frozen(w13, requires_grad=False), frozen(w2, requires_grad=False)
            layer.w13_scale, layer.w2_scale = w13_scale.contiguous(), w2_scale.contiguous()
            return
        if not Fp8MoEMethod._logged:
            Fp8MoEMethod._logged = True
            logger.info("fp8: no FP8 support on %s for %s experts: experts dequantised at load, computed 16-bit",
                        device, str(dtype).removeprefix("torch."))  # fmt: skip
        layer.w13 = frozen(dequantize_rows(w13, w13_scale, dtype), requires_grad=False)
        layer.w2 = frozen(dequantize_rows(w2, w2_scale, dtype), requires_grad=False)
