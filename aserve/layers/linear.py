"""The linear layer of every model, y = x W^T + b, and the interface of the quantisation method that owns W (vLLM's
LinearMethodBase), with the unquantised method.

A `Linear` holds one `LinearMethodBase`, chosen once at construction: `UnquantizedLinearMethod`, or the one a
checkpoint's QuantizationConfig (aserve/layers/quantization) hands it. The method owns everything that depends on
how the weights are stored:

    create_weights                  registers the layer's parameters (on the meta device while the model is built)
    load_output_slice               copies one part of a fused layer (q | k | v, gate | up) into a parameter
    process_weights_after_loading   called once by the loader, after the weights are in, on their final device:
                                    repacks or prepacks them and picks the kernel `apply` runs from then on
    apply                           y = x W^T + b

State a method sets up (prepacked copies, kernel choices, counters) lives on the layer, so one method object could
serve many layers. After changing a layer's weights, call process_weights_after_loading again.

A Llama MLP may fuse its activation, silu(gate) * up, into a linear's kernel: into the gate/up projection's epilogue
(`fuses_silu_mul_out`) or into the down projection's prologue (`fuses_silu_mul_in`). Whether it can is decided by
process_weights_after_loading; at run time the two checks only look at the input (rows, dtype).

Unquantised layers: a dense weight [out, in] (nn.Linear's layout) and an optional bias. process_weights_after_loading
picks the kernel for the weight's device and dtype, once:

    CPU, bf16       oneDNN on a copy of the weight prepacked for its blocked (AMX) layout: 1.3-2x F.linear, which
                    reorders the weight on every call. One-row inputs (batch-1 decode) run a GEMV on the plain
                    weight instead, which streams it faster: the C GEMV of aserve/kernels/cpu.py where it applies,
                    else torch.mv (ASERVE_CPU_MV=0: oneDNN for them too). Where oneDNN cannot prepack (CPUs without
                    AVX-512 BW/VL/DQ or AVX-NE-CONVERT): up to ROWS_PACKED_MAX rows the C kernel gemm_rows of
                    aserve/kernels/cpu.py over a packed copy of the weight (AVX2: the weight widened in registers,
                    streamed once per tile of rows; 2-6x the paths below at 1-64 rows), more as CPU, fp16.
    CPU, fp16       (without AMX-FP16) torch's 16-bit GEMM there runs one row at a time (512 rows: 8x float32's
                    time), so inputs of WIDEN_MIN_ROWS or more rows run float32 GEMMs over slices of the weight
                    widened into a scratch buffer of WIDEN_CHUNK elements a thread (the slice stays in cache for the
                    GEMM that reads it); fewer rows F.linear, which streams the 16-bit weight once a row.
    CUDA, 16-bit    one-row inputs through the Triton GEMV (aserve/kernels/gemv.py), faster than cuBLAS at M = 1,
                    which also takes a Llama MLP's SiLU·mul in its prologue (apply_silu_mul_in); ASERVE_GEMV=0:
                    cuBLAS for them too.
    otherwise       F.linear.

What it sets on the layer: `kernel` (the function apply runs), `packed_weight` (the oneDNN or gemm_rows copy or
None), `rows_packed` (packed_weight is gemm_rows': the CPU one-token forward may run it),
`cpu_gemv` (the C GEMV reads this weight), `row_gemv` (the CPU one-row GEMV: cpu.gemv or torch.mv),
`triton_gemv` / `gemv_config` / `gemv_silu_config` (aserve/kernels/gemv.py's gemv and its launch configurations, or
None) and `silu_mul_in_max_rows` (1 where apply_silu_mul_in applies, else 0).
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from aserve import envs
from aserve.kernels import cpu

if TYPE_CHECKING:
    from aserve.layers.quantization.base import QuantizationConfig


class LinearMethodBase(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool,
                       dtype: torch.dtype) -> None:  # fmt: skip
        """Registers the parameters of an [in_features -> out_features] layer (activations in `dtype`)."""

    @abstractmethod
    def load_output_slice(self, layer: nn.Module, param: nn.Parameter, start: int, size: int,
                          tensor: torch.Tensor) -> None:  # fmt: skip
        """Copies one part of a fused layer (output features [start, start + size)) into `param`."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Prepares the loaded weights for `apply` on their device (once, after loading); nothing by default."""
        return

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> x W^T + b [T, out]."""

    def fuses_silu_mul_out(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """For a [gate | up] layer: does apply_silu_mul_out take this input?"""
        return False

    def apply_silu_mul_out(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's [gate | up] output [T, out / 2], in its own kernel."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse SiLU·mul into its output")

    def fuses_silu_mul_in(self, layer: nn.Module, gate_up: torch.Tensor) -> bool:
        """Does apply_silu_mul_in take this [T, 2 * in] input?"""
        return False

    def apply_silu_mul_in(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
        """This layer applied to silu(gate) * up of gate_up = [gate | up], the activation in its own kernel."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse SiLU·mul into its input")


def _f_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


WIDEN_MIN_ROWS = 8  # fewer rows: F.linear's 16-bit path is as fast (measured on AVX2 for SmolLM2's shapes)
WIDEN_CHUNK = 1 << 20  # float32 elements of the weight widened at a time
_widen_scratch = threading.local()


def _widened(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A 16-bit weight on a CPU without a native 16-bit GEMM: see the module's docstring."""
    return widened_linear(x, layer.weight, layer.bias)


def widened_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """F.linear(x, w, bias) for a 16-bit CPU weight: inputs of WIDEN_MIN_ROWS or more rows as float32 GEMMs over
    slices of w widened into this thread's scratch, fewer rows F.linear (the module's docstring; also the CPU
    mixture-of-experts kernel's, aserve/layers/moe.py). `scale` [N] float32: w is int8 and each output's sum is
    multiplied by its scale before the bias (aserve/layers/quantization/int8.py; then every row count widens)."""
    n, k = w.shape
    rows = x.numel() // k
    if rows < WIDEN_MIN_ROWS and scale is None:
        return F.linear(x, w, bias)
    x32 = x.reshape(rows, k).float()
    y = torch.empty(rows, n, dtype=x.dtype)
    step = max(1, WIDEN_CHUNK // k)
    scratch = getattr(_widen_scratch, "buffer", None)
    if scratch is None or scratch.numel() < step * k:
        with torch.inference_mode(False):  # a normal tensor: written in and outside inference mode
            scratch = _widen_scratch.buffer = torch.empty(step * k)
    for start in range(0, n, step):
        end = min(n, start + step)
        w32 = scratch[: (end - start) * k].view(end - start, k)
        w32.copy_(w[start:end])
        part = torch.mm(x32, w32.t())
        if scale is not None:
            part *= scale[start:end]
        if bias is not None:
            part += bias[start:end]
        y[:, start:end] = part
    return y.view(*x.shape[:-1], n)


@functools.cache
def widens(dtype: torch.dtype) -> bool:
    """Whether CPU weights of `dtype` take the widened GEMM here: 16-bit ones with no native 16-bit GEMM on this CPU
    (bf16: oneDNN cannot prepack a weight; fp16: no AMX-FP16)."""
    if dtype == torch.float16:
        return not torch.cpu._is_amx_fp16_supported()
    if dtype != torch.bfloat16:
        return False
    if not torch.backends.mkldnn.is_available():
        return True
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except (RuntimeError, AttributeError):
        return True
    return False


ROWS_PACKED_MAX = 128  # more rows: the widened float32 GEMM is as fast (AVX2, SmolLM2's shapes, 2026-12-07)


def _rows_packed_widened(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bf16 on a CPU without a native bf16 GEMM: gemm_rows over the packed copy up to ROWS_PACKED_MAX rows (the
    weight streamed once per tile of rows, widened in registers), more rows the widened float32 GEMM."""
    n, k = layer.weight.shape
    rows = x.numel() // k
    if rows > ROWS_PACKED_MAX:
        return widened_linear(x, layer.weight, layer.bias)
    y = cpu.gemm_rows(layer.packed_weight, x.reshape(rows, k), n)
    if layer.bias is not None:
        y += layer.bias
    return y.view(*x.shape[:-1], n)


def _onednn(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


def _onednn_rows_gemv(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """oneDNN; one row: layer.row_gemv (the C GEMV, or torch.mv) on the plain weight."""
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
        layer.cpu_gemv = layer.rows_packed = False
        layer.triton_gemv = layer.gemv_config = layer.gemv_silu_config = None
        layer.silu_mul_in_max_rows = 0

    def load_output_slice(self, layer, param, start, size, tensor):
        param.data[start : start + size].copy_(tensor)

    def process_weights_after_loading(self, layer):
        self._reset(layer)
        w = layer.weight
        if w.is_cpu and w.dtype == torch.bfloat16:
            self.use_onednn(layer) or self.use_widened(layer)
        elif w.is_cpu and w.dtype == torch.float16 and not torch.cpu._is_amx_fp16_supported():
            self.use_widened(layer)
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
        layer.cpu_gemv = cpu.gemv_supports(layer.weight)
        layer.row_gemv = cpu.gemv if layer.cpu_gemv else torch.mv
        layer.kernel = _onednn_rows_gemv if envs.ASERVE_CPU_MV else _onednn
        return True

    def use_widened(self, layer: nn.Module) -> bool:
        """CPU, 16-bit, no native 16-bit GEMM: inputs of WIDEN_MIN_ROWS or more rows through float32 GEMMs; bf16
        weights where the C kernels are built: up to ROWS_PACKED_MAX rows through gemm_rows over a packed copy
        (`rows_packed`: the CPU one-token forward runs it too)."""
        layer.kernel = _widened
        if layer.weight.dtype == torch.bfloat16 and cpu.gemm_rows_supports(layer.weight):
            layer.packed_weight = cpu.gemm_rows_prepare(layer.weight.detach())
            layer.kernel, layer.rows_packed = _rows_packed_widened, True
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


class Linear(nn.Module):
    """`quant_config` None: unquantised; else its method for the checkpoint linears `checkpoint_names` this layer
    holds (one, or a fused layer's parts, e.g. model.layers.0.mlp.{gate,up}_proj). Models are built on the meta
    device; the loader fills the parameters, then calls process_weights_after_loading once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quant_config: QuantizationConfig | None = None,
        checkpoint_names: Sequence[str] = (),
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if quant_config is None:
            self.quant_method = UnquantizedLinearMethod()
        else:
            self.quant_method = quant_config.get_linear_method(checkpoint_names)
        dtype = params_dtype or torch.get_default_dtype()
        self.quant_method.create_weights(self, in_features, out_features, bias, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"quant_method={type(self.quant_method).__name__}")  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def load_output_slice(self, param: nn.Parameter, start: int, size: int, tensor: torch.Tensor) -> None:
        """Copies one part of a fused layer (output features [start, start + size)) into `param`."""
        self.quant_method.load_output_slice(self, param, start, size, tensor)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    # A Llama MLP's SiLU·mul inside this layer's kernel (see the module docstring).

    def fuses_silu_mul_out(self, x: torch.Tensor) -> bool:
        return self.quant_method.fuses_silu_mul_out(self, x)

    def forward_silu_mul_out(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply_silu_mul_out(self, x)

    def fuses_silu_mul_in(self, gate_up: torch.Tensor) -> bool:
        return self.quant_method.fuses_silu_mul_in(self, gate_up)

    def forward_silu_mul_in(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply_silu_mul_in(self, gate_up)
