"""INT8 weight-only (W8A16) linear layers, quantised when the model is loaded: `--quantization int8` (or
`LLM(..., quantization="int8")`) on a 16-bit checkpoint. The name is aserve's own: vLLM has no plain int8
weight-only method (its `experts_int8` quantises MoE experts at load, `fbgemm_fp8` and `compressed-tensors` W8A16
read pre-quantised checkpoints).

Each decoder linear's weight W [N, K] becomes q int8 [N, K] with one float32 scale per output channel,
scale = max |W[n]| / 127 and q = round(W / scale) (symmetric: no zero points). Activations stay in the model's
dtype: the kernels widen q in registers, sum x q^T in float32 and multiply each output by its scale, so a step reads
half the weight bytes of bf16. The kernel is chosen once the weights are in (process_weights_after_loading):

    CPU     up to CPU_KERNEL_MAX_ROWS rows, gemm_int8 of aserve/kernels/cpu.py (C: the int8 weights streamed once per
            call); batch-1 decode also runs it inside the CPU one-token forward (aserve/models/cpu_one_token.py).
            More rows (prefill, large decode batches), where the arithmetic outweighs the weight bytes: q widened to
            the model's dtype and oneDNN's matmul, each output scaled after; on CPUs without a native GEMM for the
            model's 16-bit dtype (linear.py's widens), float32 GEMMs over slices of q widened into a scratch buffer,
            scaled and biased before one rounding.
    CUDA    aserve/kernels/int8.py: the int8 GEMV at one row (with a Llama MLP's SiLU·mul in the down projection's
            prologue), its tl.dot GEMM for more, dequantise + cuBLAS for many
    else    the CPU without the C kernels (or K > 16384): the many-row path at every M; other devices: the
            pure-torch reference (aserve/kernels/int8_reference.py)

The lm_head and the embeddings stay unquantised (`--quantize-lm-head` gives the head this method: lm_head.py). What
the layer holds after processing: `weight` (int8) and `weight_scale` (float32 [N]) as parameters, and the unquantised
method's attributes (linear.py), `kernel` among them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels import cpu
from aserve.kernels.int8_reference import int8_linear
from aserve.layers.linear import UnquantizedLinearMethod, widened_linear, widens
from aserve.layers.quantization.base import QuantizationConfig

INT8_MAX = 127
# CPU: more rows than this take oneDNN on the widened weight. One thread of the development VM, SmolLM2's shapes: the
# C kernel takes 147-481 us at 16 rows, 290-959 us at 32, widening + oneDNN 172-573 and 196-634 (docs/quantization.md)
CPU_KERNEL_MAX_ROWS = 16


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], float32 scale [N]) with weight ~= q * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    return (w / scale[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def _reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return int8_linear(x, layer.weight, layer.weight_scale, layer.bias)


def _widened(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """q widened to x's dtype (exact) and F.linear (oneDNN on CPU), each output times its float32 scale after (one
    rounding, to x's dtype)."""
    y = F.linear(x, layer.weight.to(x.dtype)).mul_(layer.weight_scale)
    return y if layer.bias is None else y + layer.bias


def _float32(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """CPUs without a native GEMM for x's 16-bit dtype (linear.widens): float32 GEMMs over slices of q widened into
    a scratch buffer, scaled and biased in float32, rounded once."""
    return widened_linear(x, layer.weight, layer.bias, layer.weight_scale)


def _cpu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """gemm_int8 up to CPU_KERNEL_MAX_ROWS rows; more: layer.many_rows (_widened, or _float32)."""
    if x.shape[0] > CPU_KERNEL_MAX_ROWS:
        return layer.many_rows(layer, x)
    y = cpu.gemm_int8(layer.weight, layer.weight_scale, x)
    return y if layer.bias is None else y + layer.bias


def _cuda(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer.int8_linear(x, layer.weight, layer.weight_scale, layer.bias, layer.gemv_config)


class Int8LinearMethod(UnquantizedLinearMethod):
    """Loads like an unquantised layer (the checkpoint is 16-bit), then quantises in process_weights_after_loading."""

    def process_weights_after_loading(self, layer):
        w = layer.weight
        if w.dtype != torch.int8:
            layer.compute_dtype = w.dtype  # the activations' (the checkpoint's) dtype
            q, scale = quantize_per_channel(w.detach())
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        # (an int8 weight: quantised already, and this runs again whenever the weights change)
        self._reset(layer)
        layer.kernel = _reference
        widen = layer.weight.is_cpu and widens(getattr(layer, "compute_dtype", torch.bfloat16))
        layer.many_rows = _float32 if widen else _widened
        if layer.weight.is_cpu and cpu.gemm_int8_supports(layer.weight):
            layer.kernel = _cpu
            layer.cpu_gemv = True  # the one-token forward may call gemm_int8 on it
        elif layer.weight.is_cpu:
            layer.kernel = layer.many_rows
        elif layer.weight.is_cuda:
            self.use_triton(layer)

    def use_triton(self, layer: nn.Module) -> None:
        """aserve/kernels/int8.py's kernels (a GPU, or Triton's interpreter on CPU tensors)."""
        from aserve.kernels import int8  # Triton: optional (CPU installs may lack it), imported once it is chosen

        n, k = layer.weight.shape
        layer.int8_linear, layer.int8_gemv = int8.int8_linear, int8.int8_gemv
        layer.gemv_config = int8.gemv_config(n, k)
        layer.gemv_silu_config = int8.gemv_config(n, k, silu_mul=True)
        layer.silu_mul_in_max_rows = 1 if layer.gemv_silu_config is not None else 0
        layer.kernel = _cuda

    def apply_silu_mul_in(self, layer, gate_up):
        return layer.int8_gemv(gate_up, layer.weight, layer.weight_scale, layer.bias, layer.gemv_silu_config,
                               silu_mul=True)  # fmt: skip


class Int8Config(QuantizationConfig):
    name = "int8"

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Int8Config:
        raise ValueError("int8 is quantised at load from a 16-bit checkpoint (--quantization int8); there is no "
                         "int8 checkpoint format to read")  # fmt: skip

    def to_hf(self) -> dict[str, Any]:
        return {"quant_method": "int8", "bits": 8, "weights": "per-channel symmetric", "activations": "unquantized"}

    def get_linear_method(self, checkpoint_names: Sequence[str]) -> Int8LinearMethod:
        return Int8LinearMethod()
