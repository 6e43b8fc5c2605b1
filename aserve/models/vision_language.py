"""Vision-language checkpoints served by their language model: Gemma 3 (4B and up), Mistral Small 3.1 / 3.2,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA-style models are published as one checkpoint holding a vision encoder, a
projector and a text decoder of a family aserve runs. aserve serves the decoder: text prompts and chat messages of
text parts (an image part is refused with a 400, aserve/entrypoints/chat_utils.py); the vision weights are not
loaded.

    config.json                      -> text_side: the text_config as the text family's own config (architectures
                                        set to its CausalLM class; the quantisation config and the head's tying
                                        carried over; Qwen's multimodal rotary, whose three position streams are
                                        equal for text, as the plain rotary it then is)
    checkpoint tensor names          -> language_model_weights: the decoder's under the text model's names
                                        (transformers writes `language_model.model.*` / `language_model.lm_head.*`
                                        or `model.language_model.*`, older Qwen-VL checkpoints `model.*`), the
                                        vision tower's and projector's skipped
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from aserve.models.model_path import checkpoint_tensor_names

# vision-language architecture -> (the text model's architecture, its config class in transformers; None: the
# text_config's own class)
TEXT_SIDES = {
    "Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", None),
    "Mistral3ForConditionalGeneration": ("MistralForCausalLM", None),
    "LlavaForConditionalGeneration": (None, None),  # by the text_config's model_type
    "Qwen2VLForConditionalGeneration": ("Qwen2ForCausalLM", "Qwen2Config"),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2ForCausalLM", "Qwen2Config"),
    "Qwen3VLForConditionalGeneration": ("Qwen3ForCausalLM", "Qwen3Config"),
}
_LLAVA_TEXT = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Tensors of the vision side (transformers' names, older and newer), not loaded
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.", "vision_model.")
# Prefixes of the decoder's tensors -> the text model's
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."))  # fmt: skip


def text_side(hf_config, model_dir: str):
    """The config of the checkpoint's text model: hf_config itself unless its architecture is one of TEXT_SIDES.
    Tied head: as the checkpoint has it (no lm_head tensor: tied)."""
    archs = getattr(hf_config, "architectures", None) or []
    if not archs or archs[0] not in TEXT_SIDES:
        return hf_config
    arch = archs[0]
    text_arch, config_class = TEXT_SIDES[arch]
    text = hf_config.get_text_config()
    if text_arch is None:
        text_arch = _LLAVA_TEXT.get(text.model_type)
        if text_arch is None:
            raise ValueError(f"{arch} with a {text.model_type!r} language model is not supported (supported: "
                             f"{', '.join(_LLAVA_TEXT)})")  # fmt: skip
    fields = text.to_dict()
    for name in ("rope_parameters", "rope_scaling"):  # Qwen's multimodal rotary: the plain one for text
        rope = fields.get(name)
        if isinstance(rope, dict) and "mrope_section" in rope:
            rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
            if rope.get("rope_type", rope.get("type")) == "mrope":
                rope.pop("type", None)
                rope["rope_type"] = "default"
            fields[name] = rope
    fields.pop("model_type", None)
    fields.pop("architectures", None)
    if config_class is None:
        cfg = type(text)(**fields)
    else:
        import transformers

        cfg = getattr(transformers, config_class)(**fields)
    cfg.architectures = [text_arch]
    cfg.tie_word_embeddings = not _has_lm_head(model_dir)
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is not None:
        cfg.quantization_config = quantization
    cfg.vision_language_architecture = arch  # language_model_weights renames the checkpoint's tensors
    return cfg


def is_text_side(hf_config) -> bool:
    """Was hf_config made by text_side from a vision-language checkpoint?"""
    return getattr(hf_config, "vision_language_architecture", None) is not None


def language_model_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A vision-language checkpoint's tensors -> its decoder's, under the text model's names (module docstring)."""
    for name, tensor in weights:
        name = _text_name(name)
        if name is not None:
            yield name, tensor


def _text_name(name: str) -> str | None:
    """The text model's name of a checkpoint tensor, None for the vision side's."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    bare = name.removeprefix("model.")
    if bare.startswith(_VISION_PREFIXES):
        return None
    return name


def _has_lm_head(model_dir: str) -> bool:
    """Does the checkpoint hold an lm_head tensor (under any of the names _RENAMES maps to lm_head)?"""
    return any((_text_name(name) or "").startswith("lm_head.") for name in checkpoint_tensor_names(model_dir))
