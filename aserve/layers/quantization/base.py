"""The checkpoint side of quantisation at run time (vLLM's QuantizationConfig): what a checkpoint's config.json says
about its quantisation. At model construction it hands every linear layer its LinearMethodBase, which the layer keeps;
that interface, and the unquantised method, live with the layer in aserve/layers/linear.py."""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aserve.layers.linear import LinearMethodBase


class QuantizationConfig(ABC):
    """A checkpoint's quantisation, parsed from the `quantization_config` entry of its config.json."""

    name: str  # the checkpoint's `quant_method`
    legacy_file: str | None = None  # older writers' file beside config.json (AutoAWQ's quant_config.json, ...)

    @classmethod
    @abstractmethod
    def from_config(cls, raw: dict[str, Any]) -> QuantizationConfig:
        """Parses a `quantization_config` dict (clear errors for variants aserve does not run)."""

    @classmethod
    def from_legacy_file(cls, model_dir: str) -> QuantizationConfig | None:
        """Checkpoints of older writers: no quantization_config in config.json, `legacy_file` beside it (None where
        there is none)."""
        path = os.path.join(model_dir, cls.legacy_file) if cls.legacy_file else ""
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return cls.from_config(json.load(f))

    @abstractmethod
    def to_hf(self) -> dict[str, Any]:
        """The `quantization_config` entry of config.json (what transformers and vLLM read)."""

    def checkpoint_weights(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's (name, tensor) pairs as the model's load_weights takes them (a format may reshape,
        check or drop tensors here); as they are by default."""
        return weights

    @abstractmethod
    def get_linear_method(self, checkpoint_names: Sequence[str]) -> LinearMethodBase:
        """The method of a linear layer that holds the checkpoint's linears `checkpoint_names` (one, or the parts
        of a fused layer, e.g. model.layers.0.self_attn.{q,k,v}_proj), called at model construction."""

    def get_moe_method(self, expert_names: Sequence[str]) -> Any | None:
        """The method of a mixture-of-experts block's experts (aserve/layers/moe.py: it makes the block's w13 / w2,
        loads their scales and, in process_weights_after_loading(layer), turns them into what the block's kernels
        run), or None where this quantisation of experts is not supported (the block refuses it). `expert_names`:
        the checkpoint's modules of one expert's gate, up and down projections. None by default."""
        return None
