"""AWQ int4 (AutoAWQ's "gemm" checkpoints): the config a checkpoint declares, and the linear method of its layers.

Where a checkpoint says it is AWQ:
    config.json        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                               "zero_point": true, "version": "gemm", "modules_to_not_convert": ...}
    quant_config.json  (older AutoAWQ) {"w_bit": 4, "q_group_size": 128, "zero_point": true, "version": "GEMM"}

A layer holds y = x @ ((q - z) * s) + bias as AutoAWQ's tensors (layout: aserve/kernels/awq_reference.py). Fused
layers (qkv_proj = q|k|v, gate_up_proj = gate|up) concatenate their parts along the output dimension, which in AWQ
tensors is the last one, packed 8 to an int32 for qweight / qzeros:

    qkv_proj.qweight  int32 [in, (q + k + v) / 8]    q_proj.qweight -> columns [0, q/8), k_proj -> [q/8, (q+k)/8), ...
    qkv_proj.scales   fp16  [in/g, q + k + v]         q_proj.scales  -> columns [0, q), ...

The kernel is chosen once the weights are in (process_weights_after_loading):

    CUDA   the Triton kernels of aserve/kernels/awq.py (use_triton; aserve/layers/quantization/awq_triton.py), over
           a copy repacked into the layout every M's kernel reads; repack() frees the AutoAWQ tensors where that
           layout fits, so the int4 weights are held once
    CPU    a dequantised copy in the model's dtype, run as an unquantised layer (use_dense_copy): aserve has no CPU
           int4 kernel, and dequantising ~100M weights per step would cost more than the matmuls
    before processing (tests, direct use): the pure-torch reference, dequantise then matmul (use_torch)

See docs/quantization.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from aserve.kernels.awq_reference import awq_matmul, dequantize
from aserve.layers.linear import DenseWeights, LinearMethodBase, UnquantizedLinearMethod
from aserve.layers.moe import UnquantizedMoEMethod
from aserve.layers.quantization.awq_format import PACK_FACTOR
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.int4_moe import Int4MoEMethod


@dataclass(frozen=True)
class AWQConfig(QuantizationConfig):
    name = "awq"
    legacy_file = "quant_config.json"

    group_size: int = 128
    bits: int = 4
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, raw: dict) -> AWQConfig:
        """A `quantization_config` dict, or the legacy quant_config.json's (w_bit, q_group_size)."""
        bits = raw.get("bits", raw.get("w_bit", 4))
        group_size = raw.get("group_size", raw.get("q_group_size", 128))
        version = str(raw.get("version", "gemm")).lower()
        zero_point = raw.get("zero_point", True)
        if bits != 4:
            raise ValueError(f"AWQ checkpoint with {bits}-bit weights: aserve runs 4-bit AWQ only")
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only 'gemm', AutoAWQ's default; re-export it)")
        if not zero_point:
            raise ValueError("AWQ checkpoints without zero points are not supported (zero_point must be true)")
        if group_size <= 0 or group_size % 16:
            raise ValueError(f"AWQ group_size {group_size} is not supported (a multiple of 16: 32, 64, 128)")
        skip = tuple(raw.get("modules_to_not_convert") or ())
        return cls(group_size=group_size, bits=bits, zero_point=True, version=version, modules_to_not_convert=skip)

    def to_hf(self) -> dict:
        return {
            "quant_method": "awq",
            "bits": self.bits,
            "group_size": self.group_size,
            "zero_point": self.zero_point,
            "version": self.version,
            "modules_to_not_convert": list(self.modules_to_not_convert) or None,
        }

    def converts(self, hf_module_name: str) -> bool:
        """Whether the linear `hf_module_name` (e.g. model.layers.0.mlp.up_proj) is quantised."""
        return not any(skip in hf_module_name for skip in self.modules_to_not_convert)

    def converts_all(self, checkpoint_names: Sequence[str], what: str) -> bool:
        """Whether the modules `checkpoint_names`, run with one method (`what`: a fused layer, an expert's
        projections), are quantised: False where modules_to_not_convert names every one, ValueError where only some."""
        converted = [self.converts(name) for name in checkpoint_names]
        if converted and not any(converted):
            return False
        if not all(converted):
            raise ValueError(f"modules_to_not_convert splits {what} ({list(checkpoint_names)}): not supported")
        return True

    def get_linear_method(self, checkpoint_names: Sequence[str]) -> LinearMethodBase:
        if not self.converts_all(checkpoint_names, "a fused layer"):
            return UnquantizedLinearMethod()
        return AWQLinearMethod(self)

    def get_moe_method(self, expert_names: Sequence[str]) -> UnquantizedMoEMethod:
        """The checkpoint's int4 experts (int4_moe.py: packed, run by int4 kernels on a GPU); 16-bit where
        modules_to_not_convert names them."""
        if not self.converts_all(expert_names, "an expert's projections"):
            return UnquantizedMoEMethod()
        return Int4MoEMethod("awq", self.group_size, expert_names=expert_names)


def _apply_reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return awq_matmul(x, layer.qweight, layer.qzeros, layer.scales, layer.group_size, layer.bias)


def _apply_dense_copy(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer.dense(x)


class AWQLinearMethod(LinearMethodBase):
    """State on the layer: qweight / qzeros / scales / bias (parameters), `group_size`, `params_dtype` (the model's
    dtype), `kernel_kind` / `kernel` (torch | triton | dense, and the function apply runs), `dense` (the CPU copy),
    `repacked` (awq_repack's copy; None: not made, False: the layout does not fit), `gemv_counters` (the M = 1
    kernel's split-K counters), `autoawq_dropped` (repack freed the AutoAWQ tensors) and `silu_mul_out_max_rows` /
    `silu_mul_out_dtypes` / `silu_mul_out_kernel` (the inputs apply_silu_mul_out takes, and its kernel). Copies and
    counters are plain attributes, outside the module tree: caches, not parameters."""

    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        group_size = self.config.group_size
        if in_features % group_size:
            raise ValueError(f"AWQ: input size {in_features} is not a multiple of group_size {group_size}")
        if out_features % PACK_FACTOR:
            raise ValueError(f"AWQ: output size {out_features} is not a multiple of 8")
        groups, packed = in_features // group_size, out_features // PACK_FACTOR

        def frozen(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        layer.qweight = frozen(in_features, packed, dtype=torch.int32)
        layer.qzeros = frozen(groups, packed, dtype=torch.int32)
        layer.scales = frozen(groups, out_features, dtype=torch.float16)
        layer.bias = frozen(out_features, dtype=dtype) if bias else None
        layer.group_size, layer.params_dtype = group_size, dtype
        layer.dense, layer.gemv_counters, layer.repacked, layer.autoawq_dropped = None, None, None, False
        self._select(layer, "torch")

    def load_output_slice(self, layer, param, start, size, tensor):
        if layer.autoawq_dropped:
            raise RuntimeError("AWQ layer: weights are loaded before repack(), which freed the AutoAWQ tensors")
        layer.repacked = None  # made again from the new weights on the next call
        self._select(layer, layer.kernel_kind)
        if param.dim() == 1:  # bias
            param.data[start : start + size].copy_(tensor)
            return
        pack = PACK_FACTOR if param.dtype == torch.int32 else 1
        assert start % pack == 0 and size % pack == 0, "fused AWQ parts must be multiples of 8 outputs"
        target = param.data[:, start // pack : (start + size) // pack]
        if target.shape != tensor.shape:
            raise ValueError(f"AWQ tensor of shape {tuple(tensor.shape)} where {tuple(target.shape)} is expected")
        target.copy_(tensor)

    def process_weights_after_loading(self, layer):
        if layer.qweight.is_cuda:
            self.repack(layer)
            self.use_triton(layer)
        elif layer.qweight.is_cpu:
            self.use_dense_copy(layer)

    # -- the kernel choices ---------------------------------------------------------------------------------------

    def _select(self, layer: nn.Module, kind: str) -> None:
        """kind: torch | triton | dense."""
        layer.kernel_kind = kind
        layer.silu_mul_out_max_rows, layer.silu_mul_out_dtypes = 0, ()
        if kind == "dense":
            layer.kernel = _apply_dense_copy
        elif kind == "torch" and not layer.autoawq_dropped:
            layer.kernel = _apply_reference
        else:
            from aserve.layers.quantization import awq_triton  # Triton: optional, imported once it is chosen

            layer.kernel = awq_triton.apply if kind == "triton" else awq_triton.apply_dequantized
            if kind == "triton" and layer.repacked and layer.out_features % 256 == 0:
                layer.silu_mul_out_max_rows, layer.silu_mul_out_dtypes = awq_triton.silu_mul_out_limits()
                layer.silu_mul_out_kernel = awq_triton.apply_silu_mul_out

    def use_torch(self, layer: nn.Module) -> None:
        """The pure-torch reference: dequantise, then matmul, on every call."""
        self._select(layer, "torch")

    def use_triton(self, layer: nn.Module) -> None:
        """The Triton kernels (a GPU, or Triton's interpreter on CPU tensors). Without repack() the first call makes
        the repacked copy, keeping the AutoAWQ tensors too."""
        self._select(layer, "triton")

    def use_dense_copy(self, layer: nn.Module) -> bool:
        """CPU: a dequantised copy of the weights in the model's dtype, run as an unquantised layer's."""
        if not layer.qweight.is_cpu:
            return False
        dtype = layer.params_dtype
        bias = None if layer.bias is None else layer.bias.data.to(dtype)
        layer.dense = DenseWeights.processed(self.dequantized_weight(layer, dtype), bias)
        self._select(layer, "dense")
        return True

    def repack(self, layer: nn.Module, drop_autoawq: bool = True) -> bool:
        """Builds aserve.kernels.awq.awq_repack's copy of the loaded weights, which the Triton kernels read at every
        M, and with `drop_autoawq` frees the AutoAWQ tensors (the loader does this once on a GPU: the int4 weights
        are then held once). -> whether the layout fits this layer (if not, nothing changes)."""
        from aserve.layers.quantization import awq_triton  # Triton: optional, imported once it is chosen

        fits = awq_triton.repack(layer, drop_autoawq)
        self._select(layer, layer.kernel_kind)
        return fits

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """-> W [out, in] in `dtype` (nn.Linear's layout)."""
        if layer.autoawq_dropped:
            from aserve.layers.quantization import awq_triton  # imported already: repack() made the copy

            return awq_triton.dequantized_weight(layer, dtype)
        return dequantize(layer.qweight, layer.qzeros, layer.scales, layer.group_size).t().to(dtype)

    # -- running --------------------------------------------------------------------------------------------------

    def apply(self, layer, x):
        return layer.kernel(layer, x)

    def fuses_silu_mul_out(self, layer, x):
        """Up to aserve.kernels.awq.tuning.REPACKED_GEMV1_MAX_M rows of fp16 / bf16 on the Triton kernels, once the
        repacked copy exists, for outputs a multiple of 256: the f16x2 GEMV over the copy applies the MLP's
        SiLU·mul itself."""
        return (x.shape[0] <= layer.silu_mul_out_max_rows and x.dtype in layer.silu_mul_out_dtypes
                and x.device == layer.repacked.wq.device)  # fmt: skip

    def apply_silu_mul_out(self, layer, x):
        return layer.silu_mul_out_kernel(layer, x)
