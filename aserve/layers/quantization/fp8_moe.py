"""FP8 (e4m3) experts of a mixture-of-experts block (aserve/layers/moe.py), quantised when the model is loaded
(`--quantization fp8` on a 16-bit checkpoint: Fp8MoEMethod), as the linear layers are (fp8.py), or read from an FP8
checkpoint (Fp8CheckpointMoEMethod). Either way each expert's projections end with one scale per output row,

    w13 e4m3 [E, 2 I, H]   w13_scale float32 [E, 2 I]
    w2  e4m3 [E, H, I]     w2_scale  float32 [E, H]

with W = w * scale row by row (fp8.py's quantize_per_channel and fp8_reference.dequantize, per matrix of the stack).
Quantised at load, a row's scale is its largest magnitude / 448. A checkpoint stores
each expert's gate, up and down projections as FP8 linears (fp8_checkpoint.py: one scale per tensor or per channel,
or per tile with block-wise scales); per-tensor and per-channel scales become rows exactly (the gate's and the up
projection's rows keep their own scales), block-wise experts are dequantised to the model's dtype at load (no
block-scaled kernel; one log line says so), and static input scales go unused (the experts' activations stay
16-bit; one log line). What runs, chosen once the weights are in:

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

from aserve.kernels.fp8_reference import dequantize
from aserve.layers.moe import UnquantizedMoEMethod
from aserve.layers.quantization.fp8 import FP8, has_fp8_tensor_cores, quantize_per_channel
from aserve.layers.quantization.fp8_checkpoint import Fp8Scheme, dequantize_blockwise, scale_rows

logger = logging.getLogger("aserve")


def _log_once(message: str, *args) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message, *args)


_logged: set[str] = set()


def use_rows(layer: nn.Module, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
             dtype: torch.dtype) -> None:  # fmt: skip
    """e4m3 experts with row scales -> the layer keeps them where FP8 runs, or their dequantised values (module
    docstring)."""
    frozen = nn.Parameter
    if has_fp8_tensor_cores(w13.device) and dtype in (torch.bfloat16, torch.float16):
        layer.w13, layer.w2 = frozen(w13, requires_grad=False), frozen(w2, requires_grad=False)
        layer.w13_scale, layer.w2_scale = w13_scale.float().contiguous(), w2_scale.float().contiguous()
        return
    _log_once("fp8: no FP8 support on %s for %s experts: experts dequantised at load, computed 16-bit", w13.device,
              str(dtype).removeprefix("torch."))  # fmt: skip
    layer.w13 = frozen(dequantize(w13, w13_scale, dtype), requires_grad=False)
    layer.w2 = frozen(dequantize(w2, w2_scale, dtype), requires_grad=False)
    layer.w13_scale = layer.w2_scale = None


class Fp8MoEMethod(UnquantizedMoEMethod):
    """Quantised at load: the block loads its 16-bit experts as an unquantised one does, then each output row of
    every expert is rounded to e4m3 here (the module docstring)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.w13_scale is not None:  # prepared already: e4m3 experts with their scales
            return
        dtype = layer.w13.dtype
        w13, w13_scale = quantize_per_channel(layer.w13.detach())
        w2, w2_scale = quantize_per_channel(layer.w2.detach())
        use_rows(layer, w13, w13_scale, w2, w2_scale, dtype)


class Fp8CheckpointMoEMethod(UnquantizedMoEMethod):
    """A checkpoint's FP8 experts (the module docstring). Until processed the block holds e4m3 w13 / w2 and scale
    parameters with one row per output channel, w13_scale [E, 2 I, KB] and w2_scale [E, H, KB] (KB = 1, or the
    number of block-wise tiles along K), filled per expert and projection as they load."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, hidden_size: int) -> None:
        e, i, block = layer.num_experts, layer.intermediate_size, self.scheme.block

        def frozen(*shape, dtype=torch.float32):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        layer.w13, layer.w2 = frozen(e, 2 * i, hidden_size, dtype=FP8), frozen(e, hidden_size, i, dtype=FP8)
        tiles = (lambda k: 1) if block is None else (lambda k: -(-k // block[1]))
        layer.w13_scale, layer.w2_scale = frozen(e, 2 * i, tiles(hidden_size)), frozen(e, hidden_size, tiles(i))
        layer.params_dtype = torch.get_default_dtype()

    def load_scale(self, layer: nn.Module, param_name: str, expert: int, shard: int | None, tensor) -> None:
        """`param_name` w13 / w2: the projection's weight scale, as rows; "input_scale" (static activations): not
        used."""
        if param_name == "input_scale":
            _log_once("fp8: the checkpoint's static input scales of experts are not used (their activations stay "
                      "16-bit)")  # fmt: skip
            return
        weight = getattr(layer, param_name)[expert]
        scales = getattr(layer, f"{param_name}_scale").data[expert]
        if shard is not None:
            rows = slice(shard * layer.intermediate_size, (shard + 1) * layer.intermediate_size)
            weight, scales = weight[rows], scales[rows]
        scales.copy_(scale_rows(tensor, weight.shape[0], weight.shape[1], self.scheme.block))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.w13.dtype != FP8 or layer.w13_scale.dim() == 2:  # prepared already
            return
        dtype, block = layer.params_dtype, self.scheme.block
        w13, w2 = layer.w13.data, layer.w2.data
        s13, s2 = layer.w13_scale.data, layer.w2_scale.data
        del layer.w13_scale, layer.w2_scale  # (parameters until now; plain tensors or None from here)
        if block is None:
            use_rows(layer, w13, s13[..., 0], w2, s2[..., 0], dtype)
            return
        _log_once("fp8: block-wise scales (%d x %d) have no FP8 kernel for experts here: experts dequantised to %s at "
                  "load", block[0], block[1], str(dtype).removeprefix("torch."))  # fmt: skip
        for name, w, s in (("w13", w13, s13), ("w2", w2, s2)):
            setattr(layer, name, nn.Parameter(dequantize_blockwise(w, s, block[1], dtype), requires_grad=False))
        layer.w13_scale = layer.w2_scale = None
