"""8-bit GPTQ checkpoints (`bits: 8`, AutoGPTQ / GPTQModel layout) with one group per output channel
(`group_size: -1`), run on the int8 weight-only kernels (int8.py). Its config entry is gptq.py's GPTQConfig.

A linear with K inputs and N outputs is stored as

    qweight  int32 [K/4, N]   4 weights per int32 along the input dimension: q[4i + j, n] (0..255) in bits 8j..8j+7
                              of qweight[i, n]
    qzeros   int32 [1, N/4]   4 zero points per int32 along the output dimension: z[4i + c] in bits 8c..8c+7 of
                              qzeros[0, i]; format v1 stores z - 1, v2 z; symmetric checkpoints have z = 128
    scales   fp16  [1, N]
    g_idx    int32 [K]        every input's group: 0
    W[n, k] = (q[k, n] - z[n]) * s[n]

When the model loads, q - z becomes the int8 weight [N, K] and s its per-channel scale, and the layer is handed to
Int8LinearMethod: exact wherever every q - z fits int8, which a symmetric checkpoint's always does (q - 128 is in
[-128, 127]); a layer where it does not (asymmetric zero points) is refused, naming the layer's size. Grouped 8-bit
checkpoints (group_size 32, 64, 128) would need a scale per group, which the int8 kernels do not have: GPTQConfig
refuses them, naming the group size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.layers.linear import LinearMethodBase
from aserve.layers.quantization.int8 import Int8LinearMethod

PACK = 4  # 8-bit values per int32
_SHIFTS = tuple(8 * j for j in range(PACK))


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/4, C] -> int32 [R, C] of values in [0, 255]: rows 4i..4i+3 from bits 0..31 of row i."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts[None, :, None]) & 0xFF).reshape(-1, packed.shape[-1])


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/4] -> int32 [R, C] of values in [0, 255] (qzeros' packing)."""
    return unpack_rows(packed.t().contiguous()).t()


def to_int8(qweight: torch.Tensor, qzeros: torch.Tensor, version: int) -> torch.Tensor:
    """The GPTQ tensors of one group per channel -> q - z int8 [N, K]; ValueError where it does not fit int8."""
    z = unpack_columns(qzeros)[0] + (1 if version == 1 else 0)  # [N]
    d = unpack_rows(qweight) - z[None, :]  # [K, N]
    if d.min() < -128 or d.max() > 127:
        n, k = d.shape[1], d.shape[0]
        raise ValueError(f"8-bit GPTQ layer [{n} x {k}]: q - zero point does not fit int8 (asymmetric zero points "
                         "far from 128): not supported; aserve runs symmetric 8-bit GPTQ")  # fmt: skip
    return d.t().contiguous().to(torch.int8)


def _apply_reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Before processing (tests, direct use): dequantise the GPTQ tensors, then matmul."""
    w = to_int8(layer.qweight, layer.qzeros, layer.gptq_version).float() * layer.scales.float().t()
    return F.linear(x, w.to(x.dtype), None if layer.bias is None else layer.bias.to(x.dtype))


class GPTQInt8LinearMethod(LinearMethodBase):
    """State on the layer until processing: qweight / qzeros / scales / g_idx / bias (parameters), `gptq_version`
    and `params_dtype`; then the int8 method's (int8.py)."""

    def __init__(self, version: int) -> None:
        self.version = version

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        if in_features % PACK or out_features % PACK:
            raise ValueError(f"8-bit GPTQ: a [{out_features} x {in_features}] layer is not a multiple of 4 both ways")

        def frozen(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        layer.qweight = frozen(in_features // PACK, out_features, dtype=torch.int32)
        layer.qzeros = frozen(1, out_features // PACK, dtype=torch.int32)
        layer.scales = frozen(1, out_features, dtype=torch.float16)
        layer.g_idx = frozen(in_features, dtype=torch.int32)
        layer.bias = frozen(out_features, dtype=dtype) if bias else None
        layer.gptq_version, layer.params_dtype = self.version, dtype
        layer.kernel = _apply_reference

    def load_output_slice(self, layer, param, start, size, tensor):
        if param is layer.g_idx:  # one per input, the same in every part
            param.data.copy_(tensor)
            return
        pack = PACK if param is layer.qzeros else 1
        assert start % pack == 0 and size % pack == 0, "fused 8-bit GPTQ parts must be multiples of 4 outputs"
        target = param.data[..., start // pack : (start + size) // pack]
        if target.shape != tensor.shape:
            raise ValueError(f"GPTQ tensor of shape {tuple(tensor.shape)} where {tuple(target.shape)} is expected")
        target.copy_(tensor)

    def process_weights_after_loading(self, layer):
        """q - z and the scales -> the int8 method's weight and weight_scale; the layer is handed to it."""
        if torch.count_nonzero(layer.g_idx):
            raise ValueError("8-bit GPTQ with more than one group per output channel (g_idx not all 0): not supported")
        weight = to_int8(layer.qweight, layer.qzeros, layer.gptq_version)
        scale = layer.scales.data[0].float()
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            delattr(layer, name)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.quant_method = Int8LinearMethod()
        layer.quant_method.process_weights_after_loading(layer)

    def apply(self, layer, x):
        return layer.kernel(layer, x)
