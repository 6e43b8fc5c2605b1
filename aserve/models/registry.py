"""Supported architectures: the `architectures` entry of a checkpoint's config.json -> the model class. A new model
family adds its file to aserve/models and one line here."""

from __future__ import annotations

from aserve.models.gemma2 import Gemma2ForCausalLM
from aserve.models.gemma3 import Gemma3ForCausalLM
from aserve.models.llama import LlamaForCausalLM
from aserve.models.mixtral import MixtralForCausalLM
from aserve.models.phi3 import Phi3ForCausalLM
from aserve.models.qwen3 import Qwen3ForCausalLM
from aserve.models.qwen3_moe import Qwen3MoeForCausalLM
from aserve.models.smollm3 import SmolLM3ForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "smollm3": "SmolLM3ForCausalLM"}  # fmt: skip


def architecture_of(hf_config) -> str:
    """config.json's `architectures`; none given: the one of its model_type, else Llama."""
    archs = getattr(hf_config, "architectures", None)
    return archs[0] if archs else _BY_MODEL_TYPE.get(getattr(hf_config, "model_type", None), "LlamaForCausalLM")


def get_model_class(hf_config) -> type:
    """The class of the checkpoint's architecture (architecture_of)."""
    arch = architecture_of(hf_config)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[arch]
