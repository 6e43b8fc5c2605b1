"""Supported architectures: the `architectures` entry of a checkpoint's config.json -> the model class. A new model
family adds its file to aserve/models and one line here."""

from __future__ import annotations

from aserve.models.llama import LlamaForCausalLM
from aserve.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(hf_config) -> type:
    """The class of the checkpoint's architecture (config.json's `architectures`; none given: Llama)."""
    arch = (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[arch]
