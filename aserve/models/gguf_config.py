"""Config fields a GGUF file carries but transformers' GGUF loader does not read back (its integrations/ggml.py
GGUF_CONFIG_MAPPING leaves them at the config class's defaults), set from the file's own metadata: the keys and
tensors llama.cpp's convert_hf_to_gguf.py writes. A field is set only where the file has its key; Gemma's
query_pre_attn_scalar, which no key carries, is what llama.cpp uses; what else GGUF does not express (Gemma 3's
sliding-layer pattern, Qwen3-MoE's mlp_only_layers) keeps the default transformers gives it."""

from __future__ import annotations

import numpy as np
from gguf import MODEL_TENSOR, TENSOR_NAMES, GGUFReader, Keys, RopeScalingType

# model types whose head_dim is a config field (`{arch}.attention.key_length` is not mapped for all of them)
_HEAD_DIM = ("qwen3", "qwen3_moe", "gemma2", "gemma3_text")
_SOFTCAPPING = {
    "gemma2": (Keys.LLM.ATTN_LOGIT_SOFTCAPPING, Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
    "gemma3_text": (Keys.LLM.FINAL_LOGIT_SOFTCAPPING,),
}


def apply_gguf_metadata(config, reader: GGUFReader) -> None:
    """Sets on `config` (built by transformers from the file `reader` reads) the fields its loader leaves at
    defaults."""
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()

    def value(key: str):
        field = reader.fields.get(key.format(arch=arch))
        return None if field is None else field.contents()

    model_type = config.model_type
    if model_type in _HEAD_DIM and (head_dim := value(Keys.Attention.KEY_LENGTH)) is not None:
        config.head_dim = int(head_dim)
    if model_type == "qwen3_moe" and (moe_intermediate_size := value(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)) is not None:
        config.moe_intermediate_size = int(moe_intermediate_size)
    for key in _SOFTCAPPING.get(model_type, ()):
        if (cap := value(key)) is not None:
            setattr(config, key.removeprefix("{arch}."), float(cap))
    if model_type in _LLAMA_CPP_27B_LAYERS:
        config.query_pre_attn_scalar = _gemma_query_pre_attn_scalar(config, model_type)
    if model_type == "gemma3_text":
        _gemma3_rope(config, value)
    if model_type == "phi3":
        _phi3_longrope(config, value, {t.name: t for t in reader.tensors})


# GGUF has no key for Gemma's query_pre_attn_scalar; llama.cpp, whose reading defines the format, scales attention by
# hidden_size / num_heads on the 27B models (recognised by their layer count) and by head_dim on the others
_LLAMA_CPP_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def _gemma_query_pre_attn_scalar(config, model_type: str) -> int:
    if config.num_hidden_layers == _LLAMA_CPP_27B_LAYERS[model_type]:
        return config.hidden_size // config.num_attention_heads
    return config.head_dim


def _gemma3_rope(config, value) -> None:
    """Gemma 3's two rotary setups: the global layers' base and linear scaling (`rope.freq_base`,
    `rope.scaling.type` / `.factor`), the sliding layers' base (`rope.freq_base_swa`)."""
    params = {kind: dict(p) for kind, p in config.rope_parameters.items()}
    if (base := value(Keys.Rope.FREQ_BASE)) is not None:
        params["full_attention"]["rope_theta"] = float(base)
    if (base_swa := value(Keys.Rope.FREQ_BASE_SWA)) is not None:
        params["sliding_attention"]["rope_theta"] = float(base_swa)
    factor = value(Keys.Rope.SCALING_FACTOR)
    if value(Keys.Rope.SCALING_TYPE) == RopeScalingType.LINEAR.value and factor is not None:
        params["full_attention"].update(rope_type="linear", factor=float(factor))
    config.rope_parameters = params


def _phi3_longrope(config, value, tensors: dict) -> None:
    """Phi-3's LongRoPE: the factors are the tensors rope_factors_short / rope_factors_long, with
    `rope.scaling.original_context_length` and `rope.scaling.attn_factor`."""
    short = tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_SHORT]}.weight")
    long = tensors.get(f"{TENSOR_NAMES[MODEL_TENSOR.ROPE_FACTORS_LONG]}.weight")
    original = value(Keys.Rope.SCALING_ORIG_CTX_LEN)
    if short is None or long is None or original is None:
        return
    params = {
        "rope_type": "longrope",
        "rope_theta": float(config.rope_parameters["rope_theta"]),
        "short_factor": np.asarray(short.data, dtype=np.float64).tolist(),
        "long_factor": np.asarray(long.data, dtype=np.float64).tolist(),
        "original_max_position_embeddings": int(original),
    }
    if (attn_factor := value(Keys.Rope.SCALING_ATTN_FACTOR)) is not None:
        params["attention_factor"] = float(attn_factor)
    if "partial_rotary_factor" in config.rope_parameters:
        params["partial_rotary_factor"] = config.rope_parameters["partial_rotary_factor"]
    config.original_max_position_embeddings = int(original)
    config.rope_parameters = params
