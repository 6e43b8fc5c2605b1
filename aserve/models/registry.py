"""Supported architectures: the `architectures` entry of a checkpoint's config.json -> the model class. A new model
family adds its file to aserve/models and one line here."""

from __future__ import annotations

from aserve.models.llama import LlamaForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
