"""Pre-quantised FP8 checkpoints: the tensors of their linear layers, how a fused layer holds its parts' scales, and
the linear method that loads them. The configs that declare them: fp8_config.py (`quant_method: "fp8"`, vLLM's and
AutoFP8's format) and compressed_tensors.py (llm-compressor's).

Each quantised linear of such a checkpoint holds

    weight          float8_e4m3fn [N, K]
    weight_scale    float32 or 16-bit, by the scheme's strategy:
                      tensor    [] or [1]                  one scale for the whole weight
                      channel   [N, 1]                     one per output channel (compressed-tensors FP8_DYNAMIC)
                      block     [ceil(N/bn), ceil(K/bk)]   one per bn x bk tile (`weight_block_size`; the plain fp8
                                                           format names it weight_scale_inv)
    input_scale     [] or [1]                              static activations only: x is quantised as x / input_scale

with W = weight * (its tensor's / channel's / tile's scale).

aserve fuses q/k/v and gate/up along the output dimension, so parts with their own per-tensor scales meet in one
layer. A fused layer keeps one row of scales per output channel, weight_scale [N, KB] (KB = 1, or ceil(K / bk)
block-wise), each part's rows filled from its own scale as it loads: exact, as vLLM's per-channel scales, nothing is
requantised. Its parts' static input scales fill an [N] row the same way, and the layer quantises its input with
the largest of them (as vLLM). A linear that is not fused loads the checkpoint's own shapes (the model copies them
as they are) and process_weights_after_loading expands them the same way.

After loading, block-wise weights are dequantised to the model's dtype (aserve has no block-scaled FP8 GEMM; one
log line says so); the others go to Fp8LinearMethod.use_fp8 (fp8.py) with one scale per output channel.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from aserve.layers.linear import UnquantizedLinearMethod
from aserve.layers.quantization.fp8 import FP8, Fp8LinearMethod

logger = logging.getLogger("aserve")

STRATEGIES = ("tensor", "channel", "block")
ACTIVATIONS = ("dynamic", "static", None)
# scales of FP8 attention's queries and probabilities, which aserve does not run (the KV cache's own k_scale /
# v_scale load into the attention layers: aserve/layers/attention/backend.py)
ATTENTION_SCALES = (".q_scale", ".prob_scale")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 linears are stored. activations: dynamic (quantised per token at run time), static
    (by the checkpoint's input_scale) or None (not quantised: W8A16); block: (bn, bk), a block-wise scale's tile."""

    strategy: str
    activations: str | None
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES or self.activations not in ACTIVATIONS:
            raise ValueError(f"FP8 scheme: strategy {self.strategy!r}, activations {self.activations!r}")
        if (self.strategy == "block") != (self.block is not None):
            raise ValueError("FP8 scheme: a block size goes with the block strategy, and only with it")


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether the module `name` (e.g. model.layers.0.mlp.down_proj) is one of `patterns`: exact names, or regular
    expressions written "re:..." (matched from the start, as compressed-tensors and vLLM do)."""
    return any(re.match(p[3:], name) if p.startswith("re:") else name == p for p in patterns)


def layer_is_quantized(checkpoint_names: Sequence[str], skipped: Sequence[str], what: str) -> bool:
    """False where every part of the layer is in `skipped`; ValueError where only some are (aserve runs a fused layer
    with one method)."""
    skip = [matches(name, skipped) for name in checkpoint_names]
    if checkpoint_names and all(skip):
        return False
    if any(skip):
        raise ValueError(f"{what} leaves part of a fused layer unquantised ({list(checkpoint_names)}): not supported")
    return True


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as aserve's models take them: 0-dim scales as [1]; FP8 attention's query and
    probability scales dropped (one log line says so); an FP8 lm_head or embedding refused."""
    dropped = []
    for name, tensor in weights:
        if name.endswith(ATTENTION_SCALES):
            dropped.append(name)
            continue
        if tensor.dtype == FP8 and ("lm_head" in name or "embed_tokens" in name):
            raise ValueError(f"FP8 checkpoint with a quantised {name!r}: lm_head and embeddings stay 16-bit")
        yield name, tensor.reshape(1) if tensor.dim() == 0 else tensor
    if dropped:
        logger.info("fp8: the checkpoint's %d attention query / probability scales (%s, ...) are not used",
                    len(dropped), dropped[0])  # fmt: skip


def scale_rows(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None) -> torch.Tensor:
    """A part's weight scale as the checkpoint stores it -> float32 [rows, KB]: one row per output channel (KB = 1,
    or ceil(cols / bk) block-wise)."""
    s = scale.float()
    if block is not None:
        bn, bk = block
        want = (-(-rows // bn), -(-cols // bk))
        if tuple(s.shape) != want:
            raise ValueError(f"FP8 block-wise scale of shape {tuple(s.shape)} for a [{rows}, {cols}] weight with "
                             f"{bn} x {bk} blocks (expected {want})")  # fmt: skip
        return s.repeat_interleave(bn, dim=0)[:rows]
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, 1)
    if s.numel() != rows:
        raise ValueError(f"FP8 weight scale of shape {tuple(s.shape)} for a weight of {rows} output channels")
    return s.reshape(rows, 1)


def dequantize_blockwise(weight: torch.Tensor, row_scales: torch.Tensor, bk: int, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 weight [..., N, K] with block-wise scales as rows, [..., N, ceil(K / bk)] (scale_rows) -> W [..., N, K]
    in `dtype` (w * its tile's scale in float32, then rounded)."""
    full = row_scales.repeat_interleave(bk, dim=-1)[..., : weight.shape[-1]]
    return (weight.float() * full).to(dtype)


class Fp8CheckpointLinearMethod(Fp8LinearMethod):
    """A checkpoint's FP8 linear (the module docstring). State on the layer until processing: weight (e4m3),
    the scale parameter (`scheme.scale_name`), input_scale (static activations), `params_dtype`, `fp8_fused`."""

    def __init__(self, scheme: Fp8Scheme, fused: bool) -> None:
        self.scheme = scheme
        self.fused = fused

    def create_weights(self, layer, in_features, out_features, bias, dtype):
        s = self.scheme

        def frozen(*shape, dtype=torch.float32):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        if s.block is not None and not self.fused:
            scale_shape = (-(-out_features // s.block[0]), -(-in_features // s.block[1]))
        elif s.block is not None:
            scale_shape = (out_features, -(-in_features // s.block[1]))
        else:
            scale_shape = (out_features, 1) if self.fused or s.strategy == "channel" else (1,)
        layer.weight = frozen(out_features, in_features, dtype=FP8)
        layer.register_parameter(s.scale_name, frozen(*scale_shape))
        if s.activations == "static":
            layer.input_scale = frozen(out_features if self.fused else 1)
        layer.bias = frozen(out_features, dtype=dtype) if bias else None
        layer.params_dtype, layer.fp8_fused = dtype, self.fused
        self._reset(layer)

    def load_output_slice(self, layer, param, start, size, tensor):
        if param is layer.weight and tensor.dtype != FP8:
            raise ValueError(f"FP8 checkpoint: a weight of dtype {tensor.dtype} where float8_e4m3fn is expected")
        if param is getattr(layer, self.scheme.scale_name):
            tensor = scale_rows(tensor, size, layer.in_features, self.scheme.block)
        elif param is getattr(layer, "input_scale", None):
            tensor = tensor.float().reshape(1).expand(size)
        param.data[start : start + size].copy_(tensor)

    def process_weights_after_loading(self, layer):
        # processed already (this runs again whenever the weights change): dequantised, or FP8 with channel_scale
        if layer.weight.dtype != FP8:
            UnquantizedLinearMethod.process_weights_after_loading(self, layer)
            return
        if hasattr(layer, "channel_scale"):
            super().process_weights_after_loading(layer)
            return
        s = self.scheme
        scale = getattr(layer, s.scale_name).data
        if not layer.fp8_fused:
            scale = scale_rows(scale, layer.out_features, layer.in_features, s.block)
        input_scale = layer.input_scale.data.max() if s.activations == "static" else None
        weight = layer.weight.data
        for name in {s.scale_name, "weight_scale", "input_scale"}:
            if hasattr(layer, name):
                delattr(layer, name)
        if s.block is not None:
            w = dequantize_blockwise(weight, scale, s.block[1], layer.params_dtype)
            self.emulate(layer, w, f"block-wise scales ({s.block[0]} x {s.block[1]}) have no FP8 kernel here")
            return
        self.use_fp8(layer, weight, scale[:, 0].contiguous(), s.activations, layer.params_dtype, input_scale)
