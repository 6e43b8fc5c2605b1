"""Unquantised linear layers: a dense weight [out, in] (nn.Linear's layout) and an optional bias.

process_weights_after_loading picks the kernel for the weight's device and dtype, once:

    CPU, bf16       oneDNN on a copy of the weight prepacked for its blocked (AMX) layout: 1.3-2x F.linear, which
                    reorders the weight on every call. One-row inputs (batch-1 decode) run a GEMV on the plain
                    weight instead, which streams it faster: aserve/kernels/cpu_gemv.py where it applies, else
                    torch.mv (ASERVE_CPU_MV=0: oneDNN for them too).
    CUDA, 16-bit    one-row inputs through the Triton GEMV (aserve/kernels/gemv.py), faster than cuBLAS at M = 1,
                    which also takes a Llama MLP's SiLU·mul in its prologue (apply_silu_mul_in); ASERVE_GEMV=0:
                    cuBLAS for them too.
    otherwise       F.linear.

What it sets on the layer: `kernel` (the function apply runs), `packed_weight` (the oneDNN copy or None),
`cpu_gemv` (the C GEMV reads this weight), `row_gemv` (the CPU one-row GEMV: cpu_gemv.gemv or torch.mv),
`triton_gemv` / `gemv_config` / `gemv_silu_config` (aserve/kernels/gemv.py's gemv and its launch configurations, or
None) and `silu_mul_in_max_rows` (1 where apply_silu_mul_in applies, else 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from aserve import envs
from aserve.kernels import cpu_gemv
from aserve.layers.quantization.base import LinearMethodBase


def _f_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _onednn(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


def _onednn_rows_gemv(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """oneDNN; one row: layer.row_gemv (aserve/kernels/cpu_gemv.py's gemv, or torch.mv) on the plain weight."""
    if x.shape[0] == 1:
        y = layer.row_gemv(layer.weight, x[0]).unsqueeze(0)
        return y if layer.bias is None else y + layer.bias
    return _onednn(layer, x)


def _cublas_rows_triton_gemv(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """F.linear; one row: the Triton GEMV."""
    if x.dim() == 2 and x.shape[0] == 1:
        return layer.triton_gemv(x, layer.weight, layer.bias, config=layer.gemv_config)
    return F.linear(x, layer.weight, layer.bias)


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer, in_features, out_features, bias, dtype):
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        layer.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self._reset(layer)

    @staticmethod
    def _reset(layer: nn.Module) -> None:
        layer.kernel = _f_linear
        layer.packed_weight = layer.row_gemv = None
        layer.cpu_gemv = False
        layer.triton_gemv = layer.gemv_config = layer.gemv_silu_config = None
        layer.silu_mul_in_max_rows = 0

    def load_output_slice(self, layer, param, start, size, tensor):
        param.data[start : start + size].copy_(tensor)

    def process_weights_after_loading(self, layer):
        self._reset(layer)
        w = layer.weight
        if w.is_cpu and w.dtype == torch.bfloat16:
            self.use_onednn(layer)
        elif w.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and envs.ASERVE_GEMV:
            self.use_triton_gemv(layer)

    def use_onednn(self, layer: nn.Module) -> bool:
        """CPU: the oneDNN copy (one-row inputs: a GEMV, unless ASERVE_CPU_MV=0). False where this torch build
        cannot prepack (then F.linear stays)."""
        if not torch.backends.mkldnn.is_available():
            return False
        try:
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 64)
        except (RuntimeError, AttributeError):
            return False
        layer.cpu_gemv = cpu_gemv.supports(layer.weight)
        layer.row_gemv = cpu_gemv.gemv if layer.cpu_gemv else torch.mv
        layer.kernel = _onednn_rows_gemv if envs.ASERVE_CPU_MV else _onednn
        return True

    def use_triton_gemv(self, layer: nn.Module, config: dict | None = None, silu_config: dict | None = None) -> bool:
        """One-row inputs through the Triton GEMV (launch configurations: aserve/kernels/gemv.py's defaults, or
        `config` / `silu_config` for the SiLU·mul variant, which defaults to `config`). False where the kernel does
        not take the weight's shape."""
        from aserve.kernels import gemv  # Triton: optional (CPU installs may lack it), imported once it is chosen

        n, k = layer.weight.shape
        layer.gemv_config = gemv.gemv_config(n, k, config)
        layer.gemv_silu_config = gemv.gemv_config(n, k, config if silu_config is None else silu_config, silu_mul=True)
        if layer.gemv_config is None:
            return False
        layer.triton_gemv = gemv.gemv
        layer.kernel = _cublas_rows_triton_gemv
        layer.silu_mul_in_max_rows = 1
        return True

    def apply(self, layer, x):
        return layer.kernel(layer, x)

    def fuses_silu_mul_in(self, layer, gate_up):
        return gate_up.shape[0] <= layer.silu_mul_in_max_rows

    def apply_silu_mul_in(self, layer, gate_up):
        config = layer.gemv_silu_config or layer.gemv_config
        return layer.triton_gemv(gate_up, layer.weight, layer.bias, config=config, silu_mul=True)


@dataclass(eq=False)
class DenseWeights:
    """A dense weight [out, in] and bias outside any module (another method's copy of its weights), run by
    UnquantizedLinearMethod."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def processed(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> DenseWeights:
        dense = cls(weight, bias)
        UnquantizedLinearMethod().process_weights_after_loading(dense)
        return dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(self, x)
