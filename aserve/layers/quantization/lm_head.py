"""The quantised lm_head (`--quantize-lm-head`, `LLM(..., quantize_lm_head=True)`): the output projection [vocab,
hidden] rounded at load, the method chosen once from the model's quantisation (`lm_head_method`):

    unquantised, int8, 8-bit GPTQ    int8, one scale per vocabulary row, symmetric (Int8LinearMethod: the C kernel on
                                     CPU, aserve/kernels/int8.py's Triton GEMV / GEMM on GPUs)
    fp8 (quantised at load, or an    e4m3, one scale per vocabulary row, weight-only: the activations stay 16-bit at
    FP8 checkpoint)                  every row count (Fp8HeadMethod; dequantised at load where there are no FP8
                                     tensor cores, as every FP8 layer there)
    AWQ, 4-bit GPTQ                  int4 in the AutoAWQ layout, round-to-nearest per group of HEAD_GROUP_SIZE
                                     inputs (the checkpoint's group size where the hidden size is not a multiple of
                                     it), run by the AWQ method (Int4HeadMethod: the Triton int4 kernels on GPUs, a
                                     dequantised copy on CPUs)

Every head method loads the checkpoint's 16-bit lm_head.weight as an unquantised layer does (so tensor parallelism
splits its rows as it splits the unquantised head's, and each rank rounds its own rows: every scale belongs to one
row) and rounds it in process_weights_after_loading. With tied embeddings the head is rounded from the embedding
matrix into its own tensors; the embedding keeps the 16-bit table, so a tied model holds both (the docs give the
cost). `quantize_lm_head(model, quant_config)` gives a model built on the meta device its head method.
"""

from __future__ import annotations

import torch
from torch import nn

from aserve.layers.linear import Linear, LinearMethodBase, UnquantizedLinearMethod
from aserve.layers.quantization.awq import AWQConfig
from aserve.layers.quantization.awq_format import pack_linear
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.fp8 import FP8, Fp8LinearMethod, quantize_per_channel
from aserve.layers.quantization.int8 import Int8Config, Int8LinearMethod

HEAD_GROUP_SIZE = 128  # int4 head: inputs per group (the AWQ kernels' repacked layout on GPUs takes 128)
PAD_ROWS = 128  # int4 head: vocabulary rows padded (zero rows) to a multiple of this, which every AWQ kernel takes


def int4_group_size(hidden_size: int, checkpoint_group_size: int) -> int:
    """The int4 head's group: HEAD_GROUP_SIZE where it divides the hidden size, else the checkpoint's linears'."""
    for group in (HEAD_GROUP_SIZE, checkpoint_group_size):
        if group > 0 and hidden_size % group == 0:
            return group
    raise ValueError(
        f"--quantize-lm-head: the int4 head needs a group size that divides the hidden size "
        f"{hidden_size} (tried {HEAD_GROUP_SIZE} and the checkpoint's, {checkpoint_group_size})"
    )


class Fp8HeadMethod(Fp8LinearMethod):
    """Fp8LinearMethod with weight-only activations at every row count (the large-M path dequantises the weight
    and runs cuBLAS instead of rounding the activations to e4m3): the logits of long prompts keep 16-bit
    activations."""

    def process_weights_after_loading(self, layer):
        w = layer.weight
        if w.dtype == FP8:  # prepared already (this runs again whenever the weights change)
            self.use_fp8(layer, w.data, layer.channel_scale, None, layer.params_dtype)
            return
        weight_fp8, scale = quantize_per_channel(w.detach())
        self.use_fp8(layer, weight_fp8, scale, None, w.dtype)


def _int4(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer.int4(x)


def _int4_padded(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The padded head's logits less the zero rows past the vocabulary."""
    return layer.int4(x)[:, : layer.out_features].contiguous()


class Int4HeadMethod(UnquantizedLinearMethod):
    """Loads the 16-bit head, then rounds it into an AWQ layer of its own (`layer.int4`: a Linear with the AWQ
    method, held as a plain attribute outside the module tree, as the other methods' copies are) and frees the
    16-bit weight (`layer.weight` becomes an empty placeholder; a tied embedding keeps its table). The rows are
    padded with zero rows to a multiple of PAD_ROWS; `kernel` drops their logits."""

    def __init__(self, checkpoint_group_size: int) -> None:
        self.checkpoint_group_size = checkpoint_group_size

    def process_weights_after_loading(self, layer):
        w = layer.weight
        if getattr(layer, "int4", None) is not None and w.numel() == 0:  # rounded already
            layer.int4.process_weights_after_loading()
            return
        self._reset(layer)
        vocab, hidden = w.shape
        group = int4_group_size(hidden, self.checkpoint_group_size)
        rows = -(-vocab // PAD_ROWS) * PAD_ROWS
        padded = torch.cat([w.detach(), w.new_zeros(rows - vocab, hidden)]) if rows > vocab else w.detach()
        with torch.device("meta"):
            int4 = Linear(hidden, rows, bias=False, quant_config=AWQConfig(group_size=group), params_dtype=w.dtype)
        for name, tensor in pack_linear(padded, group).items():
            setattr(int4, name, nn.Parameter(tensor, requires_grad=False))
        int4.process_weights_after_loading()
        layer.__dict__["int4"] = int4  # not a submodule: the model's own passes over its modules skip it
        layer.weight = nn.Parameter(w.new_empty(0, hidden), requires_grad=False)
        layer.kernel = _int4_padded if rows > vocab else _int4


# a model's quantisation (its QuantizationConfig's name; None: unquantised) -> the head's method
def lm_head_method(quant_config: QuantizationConfig | None) -> LinearMethodBase:
    """The method of the quantised head for a model quantised with `quant_config` (the module docstring)."""
    name = None if quant_config is None else quant_config.name
    bits = getattr(quant_config, "bits", 4)
    if name in (None, "int8") or (name == "gptq" and bits == 8):
        return Int8LinearMethod()
    if name in ("fp8", "compressed-tensors"):
        return Fp8HeadMethod()
    if name in ("awq", "gptq"):
        return Int4HeadMethod(quant_config.group_size)
    raise ValueError(f"--quantize-lm-head is not supported with {name} quantisation")


def quantize_lm_head(model: nn.Module, quant_config: QuantizationConfig | None) -> None:
    """Gives the lm_head of a model built on the meta device (before its weights load) the quantised head's method,
    and its (16-bit) parameters again; a tied head shares the embedding again once the model is materialised."""
    head = model.lm_head
    if not isinstance(head, Linear) or head.bias is not None:
        raise ValueError(f"--quantize-lm-head: {type(model).__name__}'s lm_head is not a linear layer without bias")
    head.quant_method = lm_head_method(quant_config)
    with torch.device("meta"):
        head.quant_method.create_weights(head, head.in_features, head.out_features, False, head.weight.dtype)
    model.tie_weights()


def use_checkpoint_head(model: nn.Module, quant_config: QuantizationConfig) -> None:
    """A checkpoint whose lm_head is quantised as its linears are (GPTQ's `"lm_head": true`): the head of a model
    built on the meta device takes the checkpoint's method and parameters instead of its 16-bit weight, and no
    longer shares the embedding's table."""
    head = model.lm_head
    if not isinstance(head, Linear) or head.bias is not None:
        raise ValueError(f"{type(model).__name__}'s lm_head is not a linear layer without bias: its quantised "
                         "checkpoint head cannot load")  # fmt: skip
    dtype = head.weight.dtype
    del head.weight
    head.quant_method = quant_config.get_linear_method(("lm_head",))
    head.quant_method.create_weights(head, head.in_features, head.out_features, False, dtype)
    model.tie_word_embeddings = False


def int8_copy(head: Linear) -> Linear:
    """An int8 copy (Int8LinearMethod: one scale per vocabulary row) of a loaded head, beside it: layer_skip's
    `"draft_head": "int8"`. A head that is int8 already is its own copy."""
    w = getattr(head, "weight", None)
    if w is not None and w.dtype == torch.int8:
        return head
    if not isinstance(head.quant_method, UnquantizedLinearMethod) or head.bias is not None or w.numel() == 0:
        raise ValueError(f"an int8 draft head needs a 16-bit lm_head without bias; this one runs "
                         f"{type(head.quant_method).__name__}")  # fmt: skip
    with torch.device("meta"):
        copy = Linear(head.in_features, head.out_features, bias=False, quant_config=Int8Config(), params_dtype=w.dtype)
    copy.weight = nn.Parameter(w.detach(), requires_grad=False)  # replaced by its int8 rounding
    copy.process_weights_after_loading()
    return copy
