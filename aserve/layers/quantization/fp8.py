"""FP8 (e4m3) weights: quantised when the model is loaded (`--quantization fp8` on a 16-bit checkpoint, as vLLM;
this file), or read from a pre-quantised checkpoint (fp8_checkpoint.py: the plain `quant_method: "fp8"` format and
llm-compressor's compressed-tensors one). Both end in `Fp8LinearMethod.use_fp8`, which picks the kernels.

Quantised at load: each linear layer's weight gets one scale per output channel (its largest magnitude / 448, e4m3's
largest value). What runs, chosen once the weights are in (use_fp8):

    GPU with FP8 tensor cores (compute capability 8.9+), 16-bit model: the weight stays e4m3 [N, K] with one float32
        scale per output channel (half the bytes of bf16). Up to fp8_gemv.MAX_ROWS rows the weight-only Triton
        kernels of aserve/kernels/fp8_gemv.py (activations stay 16-bit; the one-row GEMV also takes a Llama MLP's
        SiLU·mul into the down projection). More rows: torch._scaled_mm on activations quantised per token (dynamic
        scales, one Triton kernel: aserve/kernels/fp8.py) or by the checkpoint's static `input_scale`; a checkpoint
        whose activations are not quantised (W8A16) runs the weight dequantised to the model's dtype and cuBLAS.
    elsewhere (CPU, older GPUs, float32 models): the weights dequantised to the model's dtype, computed with the
        unquantised kernels (weight-only, no memory saved); one log line says so.

The lm_head and the embeddings stay unquantised (`--quantize-lm-head` rounds the head with this method, weight-only:
lm_head.py). What the layer holds on the FP8 path: `weight` (e4m3), `weight_scale` (float32 [1, N]) and, for static
activations, `input_scale` (float32 [1]) as parameters; `channel_scale` (weight_scale as [N]), `fp8_activations`
(dynamic | static | None), `quantize_input`, `large_m_kernel` and the unquantised method's attributes (linear.py).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels.fp8_reference import dequantize
from aserve.layers.linear import UnquantizedLinearMethod

logger = logging.getLogger("aserve")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (e4m3 weight [..., N, K], float32 scale [..., N]) with weight ~= fp8.float() *
    scale[..., None]: one scale per output row of each matrix (a stack: mixture-of-experts blocks' experts)."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]) with the checkpoint's one static scale (float32 [1])."""
    q = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, input_scale.view(1, 1).expand(x.shape[0], 1).contiguous()


def _scaled_mm(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [T, K] in 16 bits -> e4m3 activations and their scales (layer.quantize_input) -> x W^T (+ b)."""
    x_fp8, x_scale = layer.quantize_input(x)
    return torch._scaled_mm(x_fp8, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale,
                            bias=layer.bias, out_dtype=x.dtype)  # fmt: skip


def _dequantized(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Weight-only at many rows: the weight dequantised to x's dtype (elementwise), then cuBLAS."""
    return F.linear(x, dequantize(layer.weight, layer.channel_scale, x.dtype), layer.bias)


def _few_rows_weight_only(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Up to fp8_gemv.MAX_ROWS rows the weight-only FP8 kernels, more: layer.large_m_kernel."""
    if x.shape[0] <= layer.fp8_max_rows:
        return layer.fp8_small_m(x, layer.weight, layer.channel_scale, layer.bias, layer.gemv_config)
    return layer.large_m_kernel(layer, x)


class Fp8LinearMethod(UnquantizedLinearMethod):
    """Quantised at load: loads like an unquantised layer (the checkpoint is 16-bit), then rounds each output
    channel to e4m3 in process_weights_after_loading."""

    _logged_reasons: set[str] = set()  # emulate() logs each reason once

    def process_weights_after_loading(self, layer):
        w = layer.weight
        if w.dtype == FP8:  # prepared already (this runs again whenever the weights change)
            self.use_fp8(layer, w.data, layer.channel_scale, layer.fp8_activations, layer.params_dtype,
                         getattr(layer, "input_scale", None))  # fmt: skip
            return
        weight_fp8, scale = quantize_per_channel(w.detach())
        self.use_fp8(layer, weight_fp8, scale, "dynamic", w.dtype)

    def use_fp8(self, layer: nn.Module, weight_fp8: torch.Tensor, scale: torch.Tensor, activations: str | None,
                dtype: torch.dtype, input_scale: torch.Tensor | None = None) -> None:  # fmt: skip
        """e4m3 weights [N, K] with float32 scales [N] -> the layer's kernels (the module docstring). activations:
        how the large-M GEMM quantises its input: "dynamic" (per token), "static" (by input_scale, float32 [1]) or
        None (not at all: the checkpoint's activations are 16-bit); dtype: the model's."""
        device = weight_fp8.device
        if not (has_fp8_tensor_cores(device) and dtype in (torch.bfloat16, torch.float16)):
            self.emulate(layer, dequantize(weight_fp8, scale, dtype), f"no FP8 tensor cores on {device}")
            return
        # Triton: imported where a GPU runs it
        from aserve.kernels import fp8 as fp8_kernels
        from aserve.kernels import fp8_gemv

        frozen = functools.partial(nn.Parameter, requires_grad=False)
        layer.weight, layer.weight_scale = frozen(weight_fp8), frozen(scale.float().reshape(1, -1).contiguous())
        layer.channel_scale, layer.fp8_activations, layer.params_dtype = layer.weight_scale.view(-1), activations, dtype
        self._reset(layer)
        if activations == "static":
            layer.input_scale = frozen(input_scale.float().reshape(1))
            layer.quantize_input = functools.partial(quantize_static, input_scale=layer.input_scale)
        else:
            layer.quantize_input = fp8_kernels.quantize_per_token
        layer.large_m_kernel = _dequantized if activations is None else _scaled_mm
        n, k = weight_fp8.shape
        layer.fp8_small_m, layer.fp8_gemv = fp8_gemv.fp8_small_m, fp8_gemv.fp8_gemv
        layer.fp8_max_rows = fp8_gemv.MAX_ROWS
        layer.gemv_config = fp8_gemv.gemv_config(n, k)
        layer.gemv_silu_config = fp8_gemv.gemv_config(n, k, silu_mul=True)
        layer.silu_mul_in_max_rows = 1 if layer.gemv_silu_config is not None else 0
        layer.kernel = _few_rows_weight_only

    def emulate(self, layer: nn.Module, weight: torch.Tensor, why: str) -> None:
        """The FP8 weights dequantised (`weight`, in the model's dtype) through the unquantised kernels; logs `why`
        (once per process)."""
        if why not in Fp8LinearMethod._logged_reasons:
            Fp8LinearMethod._logged_reasons.add(why)
            logger.info("fp8: %s: weights dequantised to %s at load, computed weight-only (activations unquantised)",
                        why, str(weight.dtype).removeprefix("torch."))  # fmt: skip
        layer.weight = nn.Parameter(weight, requires_grad=False)
        UnquantizedLinearMethod.process_weights_after_loading(self, layer)

    def apply_silu_mul_in(self, layer, gate_up):
        return layer.fp8_gemv(gate_up, layer.weight, layer.channel_scale, layer.bias, layer.gemv_silu_config,
                              silu_mul=True)  # fmt: skip
