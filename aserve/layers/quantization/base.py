"""The two interfaces of quantisation at run time (vLLM's QuantizationConfig / LinearMethodBase).

A `QuantizationConfig` is what a checkpoint's config.json says about its quantisation; at model construction it
hands every linear layer its `LinearMethodBase`, which the layer keeps. The method owns everything that depends on
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
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


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


class QuantizationConfig(ABC):
    """A checkpoint's quantisation, parsed from the `quantization_config` entry of its config.json."""

    name: str  # the checkpoint's `quant_method`

    @classmethod
    @abstractmethod
    def from_config(cls, raw: dict[str, Any]) -> QuantizationConfig:
        """Parses a `quantization_config` dict (clear errors for variants aserve does not run)."""

    @abstractmethod
    def to_hf(self) -> dict[str, Any]:
        """The `quantization_config` entry of config.json (what transformers and vLLM read)."""

    @abstractmethod
    def get_linear_method(self, checkpoint_names: Sequence[str]) -> LinearMethodBase:
        """The method of a linear layer that holds the checkpoint's linears `checkpoint_names` (one, or the parts
        of a fused layer, e.g. model.layers.0.self_attn.{q,k,v}_proj), called at model construction."""
