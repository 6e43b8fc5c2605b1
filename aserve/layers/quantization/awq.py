"""AWQ int4 linear layers, and the transform that puts them into a model.

Quantisation is applied to layers, not threaded through the model (gpt-fast style): the model is built with plain
Linear layers (on the meta device, so nothing is allocated), then `quantize_linears` swaps in AWQLinear ones.

Fused layers (qkv_proj = q|k|v, gate_up_proj = gate|up) concatenate their parts along the output dimension, which in
AWQ tensors is the last one, packed 8 to an int32 for qweight / qzeros:

    qkv_proj.qweight  int32 [in, (q + k + v) / 8]    q_proj.qweight -> columns [0, q/8), k_proj -> [q/8, (q+k)/8), ...
    qkv_proj.scales   fp16  [in/g, q + k + v]         q_proj.scales  -> columns [0, q), ...
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.kernels.awq_reference import awq_matmul, dequantize
from aserve.layers.linear import Linear
from aserve.layers.quantization.awq_format import PACK_FACTOR, AWQConfig

# aserve's fused linears -> the HF linears they hold (for modules_to_not_convert, which names HF modules)
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AWQLinear(nn.Module):
    """y = x @ ((q - z) * s) + bias, from AutoAWQ gemm tensors.

    CUDA: the Triton kernels of aserve/kernels/awq.py, with this layer's own counters for the M = 1 kernel's fused
    split-K reduction (made on the first call, outside CUDA graph capture) and the weights repacked into the layout
    every M's kernel reads (aserve.kernels.awq.awq_repack): the engine calls `repack()` once after loading, which frees
    the AutoAWQ tensors, so the int4 weights are held once. Layers the layout does not fit (group size other than 128,
    outputs not a multiple of 128) keep the AutoAWQ tensors and kernels; without `repack()` (tests, direct use) the
    first call makes the copy and keeps both. CPU: the pure-torch
    reference (dequantise, then matmul) on every call; after `prepack()` (which optimize_for_cpu calls) a
    dequantised oneDNN-prepacked copy instead: aserve has no CPU int4 kernel, and dequantising ~100M weights per
    step would cost more than the matmuls."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int) -> None:
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"AWQ: input size {in_features} is not a multiple of group_size {group_size}")
        if out_features % PACK_FACTOR:
            raise ValueError(f"AWQ: output size {out_features} is not a multiple of 8")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups, packed = in_features // group_size, out_features // PACK_FACTOR

        def frozen(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.qweight = frozen(in_features, packed, dtype=torch.int32)
        self.qzeros = frozen(groups, packed, dtype=torch.int32)
        self.scales = frozen(groups, out_features, dtype=torch.float16)
        self.bias = frozen(out_features, dtype=torch.get_default_dtype()) if bias else None
        self.dtype = torch.get_default_dtype()  # the model's dtype (models are built under it)
        self.backend = "auto"  # auto | torch | triton (tests run the Triton kernels on CPU through the interpreter)
        # CPU: the dequantised, prepacked copy. Kept out of the module tree: it is a cache, not a model parameter.
        self.__dict__["dense"] = None
        # Triton: aserve.kernels.awq.gemv_counters on the weights' device (out of the module tree too: state, not
        # weights)
        self.__dict__["gemv_counters"] = None
        # Triton: aserve.kernels.awq.awq_repack's copy (False: the layout does not apply to this layer)
        self.__dict__["repacked"] = None
        self.autoawq_dropped = False  # repack() freed qweight / qzeros / scales: the repacked copy is the weights

    def extra_repr(self) -> str:
        held = ", repacked" if self.autoawq_dropped else ""
        return f"in={self.in_features}, out={self.out_features}, group_size={self.group_size}{held}"

    def load_output_slice(self, param: nn.Parameter, start: int, size: int, tensor: torch.Tensor) -> None:
        """Copies one part of a fused layer (output features [start, start + size)) into `param`."""
        if self.autoawq_dropped:
            raise RuntimeError("AWQLinear: weights are loaded before repack(), which freed the AutoAWQ tensors")
        self.__dict__["repacked"] = None  # made again from the new weights on the next call
        if param.dim() == 1:  # bias
            param.data[start : start + size].copy_(tensor)
            return
        pack = PACK_FACTOR if param.dtype == torch.int32 else 1
        assert start % pack == 0 and size % pack == 0, "fused AWQ parts must be multiples of 8 outputs"
        target = param.data[:, start // pack : (start + size) // pack]
        if target.shape != tensor.shape:
            raise ValueError(f"AWQ tensor of shape {tuple(tensor.shape)} where {tuple(target.shape)} is expected")
        target.copy_(tensor)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """-> W [out, in] in `dtype` (nn.Linear's layout)."""
        if self.autoawq_dropped:
            from aserve.kernels.awq import awq_dequantize_repacked

            return awq_dequantize_repacked(self.repacked, dtype).t()
        return dequantize(self.qweight, self.qzeros, self.scales, self.group_size).t().to(dtype)

    def repack(self, drop_autoawq: bool = True) -> bool:
        """Builds aserve.kernels.awq.awq_repack's copy of the loaded weights, which the Triton kernels read at every M,
        and with `drop_autoawq` frees the AutoAWQ tensors (the engine does this once after loading on a GPU: the int4
        weights are then held once). -> whether the layout fits this layer (if not, nothing changes)."""
        from aserve.kernels.awq import awq_repack

        packed = awq_repack(self.qweight, self.qzeros, self.scales, self.group_size)
        self.__dict__["repacked"] = packed if packed is not None else False
        if packed is not None and drop_autoawq:
            for param in (self.qweight, self.qzeros, self.scales):
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self.autoawq_dropped = True
        return packed is not None

    def prepack(self) -> bool:
        if not self.qweight.is_cpu:
            return False
        dense = Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta", dtype=self.dtype)
        dense.weight = nn.Parameter(self.dequantized_weight(self.dtype), requires_grad=False)
        if self.bias is not None:
            dense.bias = nn.Parameter(self.bias.data.to(self.dtype), requires_grad=False)
        dense.prepack()
        self.__dict__["dense"] = dense
        return True

    def fuses_silu_mul(self, x: torch.Tensor) -> bool:
        """For a [gate | up] layer: does this input (up to aserve.kernels.awq.REPACKED_GEMV1_MAX_M rows, fp16 / bf16, on
        the repacked copy's GPU) run the f16x2 GEMV over the repacked copy, which can then apply the MLP's SiLU·mul
        itself (forward_silu_mul_out)? False before the copy exists (the first CUDA call makes it)."""
        from aserve.kernels.awq import F16X2_DTYPES, REPACKED_GEMV1_MAX_M

        packed = self.repacked
        return (bool(packed) and self.backend != "torch" and self.out_features % 256 == 0 and x.dim() == 2
                and x.shape[0] <= REPACKED_GEMV1_MAX_M and x.dtype in F16X2_DTYPES
                and packed.wq.device == x.device)  # fmt: skip

    def forward_silu_mul_out(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's [gate | up] output, in one kernel (fuses_silu_mul must hold)."""
        from aserve.kernels.awq import awq_gemv_repacked

        return awq_gemv_repacked(x, self.repacked, self.bias, self._counters(x.device), silu_mul_out=True)

    def _counters(self, device: torch.device) -> torch.Tensor:
        from aserve.kernels.awq import gemv_counters

        counters = self.gemv_counters
        if counters is None or counters.device != device:
            counters = self.__dict__["gemv_counters"] = gemv_counters(self.out_features, device)
        return counters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and self.dense.weight.dtype == x.dtype:
            return self.dense(x)
        if self.backend == "triton" or (self.backend == "auto" and x.is_cuda):
            from aserve.kernels.awq import awq_linear

            counters = self._counters(x.device)
            packed = self.repacked
            if packed is None or (packed is not False and packed.wq.device != x.device):
                if x.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("AWQLinear: run it once before CUDA graph capture (a warm-up)")
                if self.autoawq_dropped:
                    raise RuntimeError("AWQLinear: repacked weights are on another device than the input")
                self.repack(drop_autoawq=False)
                packed = self.repacked
            return awq_linear(x, self.qweight, self.qzeros, self.scales, self.group_size, self.bias, counters,
                              packed or None)  # fmt: skip
        if self.autoawq_dropped:  # the torch backend after repack(): dequantise the repacked copy
            w = self.dequantized_weight(x.dtype)
            return torch.nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))
        return awq_matmul(x, self.qweight, self.qzeros, self.scales, self.group_size, self.bias)


def quantize_linears(model: nn.Module, config: AWQConfig) -> list[str]:
    """Replaces the decoder layers' Linear modules by AWQLinear ones (lm_head and embeddings stay unquantised, as in
    AutoAWQ). Returns the names of the replaced modules."""
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or not name.startswith("layers."):
            continue
        parent_name, attr = name.rsplit(".", 1)
        hf_names = [f"model.{parent_name}.{part}" for part in _FUSED_PARTS.get(attr, (attr,))]
        converted = [config.converts(n) for n in hf_names]
        if not any(converted):
            continue
        if not all(converted):
            raise ValueError(f"modules_to_not_convert splits the fused layer {name} ({hf_names}): not supported")
        awq = AWQLinear(module.in_features, module.out_features, module.bias is not None, config.group_size)
        setattr(model.get_submodule(parent_name), attr, awq)
        replaced.append(name)
    return replaced
