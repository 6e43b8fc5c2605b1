"""Tiny random models with real tokenizers, written to disk like any HF checkpoint, for exact-parity tests."""

from __future__ import annotations

import json
import os

import torch

VOCAB_SIZE = 384
EOS_ID = 1
BOS_ID = 0

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks of sixteen "
    "tokens. Prefix caching shares blocks between requests that start with the same tokens. Continuous batching "
    "adds and removes requests at every step. Chunked prefill splits long prompts. Hello world! 0123456789 "
)


def build_tokenizer(path: str):
    """A byte-level BPE trained on a small corpus: every byte decodes, merges make multi-byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 20, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf_tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    hf_tok.save_pretrained(path)
    return hf_tok


def make_config(variant: str):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
    )

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        initializer_range=0.25,  # peaked logits: argmax is not decided by float rounding
        tie_word_embeddings=False,
    )
    if variant == "mha":
        return LlamaConfig(**common)
    if variant == "gqa":
        return LlamaConfig(**{**common, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16})
    if variant == "tied":
        return LlamaConfig(**{**common, "num_key_value_heads": 2, "tie_word_embeddings": True})
    if variant == "llama3_rope":
        return LlamaConfig(
            **{**common, "num_key_value_heads": 2},
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if variant == "wide":  # AWQ group 128: o / gate_up / down fit the GPU's repacked layout, qkv (192 outputs) not
        return LlamaConfig(**{**common, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
                              "num_key_value_heads": 2, "head_dim": 16})  # fmt: skip
    if variant == "vocab8":  # for statistical tests of sampling: every next-token distribution is spread out
        return LlamaConfig(**{**common, "vocab_size": 8, "num_key_value_heads": 2, "initializer_range": 0.08})
    if variant == "qwen2":
        return Qwen2Config(**{**common, "num_key_value_heads": 2, "use_sliding_window": False})
    if variant == "qwen2_mqa":  # one KV head (tensor parallelism replicates it), a vocabulary 2 ranks split unevenly
        return Qwen2Config(**{**common, "num_key_value_heads": 1, "vocab_size": VOCAB_SIZE + 1,
                              "use_sliding_window": False})  # fmt: skip
    if variant == "qwen3":  # head_dim apart from hidden / heads, as in the released models
        return Qwen3Config(**{**common, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                              "use_sliding_window": False})  # fmt: skip
    if variant == "phi3":  # LongRoPE: short factors per frequency, cos/sin scaled by the attention factor
        half = 8  # head_dim 16
        return Phi3Config(**{**common, "num_key_value_heads": 2, "max_position_embeddings": 256,
                             "original_max_position_embeddings": 256, "sliding_window": None, "rope_parameters": {
                                 "rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                                 "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                 "long_factor": [1.5 + 0.5 * i for i in range(half)]}})  # fmt: skip
    if variant == "mixtral":  # 4 experts of 64, top-2 renormalised, in every layer
        return MixtralConfig(**{**common, "num_hidden_layers": 3, "num_key_value_heads": 2, "intermediate_size": 64,
                                "num_local_experts": 4, "num_experts_per_tok": 2})  # fmt: skip
    if variant == "qwen3_moe":  # 8 experts of 48, top-2 not renormalised; layer 1 keeps a dense MLP
        return Qwen3MoeConfig(**{**common, "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 32,
                                 "moe_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
                                 "norm_topk_prob": False, "mlp_only_layers": [1],
                                 "use_sliding_window": False})  # fmt: skip
    if variant == "smollm3":  # the fourth layer without rotary (NoPE), tied embeddings as released
        return SmolLM3Config(**{**common, "num_hidden_layers": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
                                "no_rope_layers": [1, 1, 1, 0], "use_sliding_window": False})  # fmt: skip
    # Sliding windows shorter than most prompts (tests/test_parity.py: 3..64 tokens, 24 generated; blocks of 16).
    if variant == "mistral_sliding":  # every layer slides
        return MistralConfig(**{**common, "num_key_value_heads": 2, "sliding_window": 12})
    gemma = {**common, "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
             "query_pre_attn_scalar": 24}  # fmt: skip
    if variant == "gemma2":  # sliding / full alternating; soft-capped attention scores and logits
        return Gemma2Config(**gemma, sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
    if variant == "gemma3":  # two sliding layers to one full (the pattern of older configs), two rotary bases
        return Gemma3TextConfig(**gemma, sliding_window=20, sliding_window_pattern=3, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})  # fmt: skip
    raise ValueError(variant)


# Vision-language checkpoints (aserve serves their language model): variant -> (class, language model's variant)
VISION_LANGUAGE = {
    "gemma3_vl": ("Gemma3ForConditionalGeneration", "gemma3"),
    "mistral3": ("Mistral3ForConditionalGeneration", "gqa"),
    "llava": ("LlavaForConditionalGeneration", "gqa"),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "qwen2"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "qwen2"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "qwen3"),
}


def make_vision_language_config(variant: str):
    """A tiny vision tower and projector around make_config's language model (Qwen: multimodal rotary sections)."""
    import transformers

    cls_name, text_variant = VISION_LANGUAGE[variant]
    text = make_config(text_variant).to_dict()
    if variant == "mistral3":
        text["model_type"] = "mistral"
    if variant.startswith("qwen"):
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                   "mrope_section": [2, 3, 3] if text_variant == "qwen2" else [4, 6, 6]}  # fmt: skip
    siglip = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    qwen_vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    vision = {
        "gemma3_vl": siglip,
        "mistral3": {**siglip, "head_dim": 16},
        "llava": {**siglip, "model_type": "clip_vision_model", "projection_dim": 32},
        "qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2),
        "qwen2_5_vl": qwen_vision,
        "qwen3_vl": {**qwen_vision, "deepstack_visual_indexes": [0]},
    }[variant]
    config_cls = getattr(transformers, cls_name.replace("ForConditionalGeneration", "Config"))
    return config_cls(text_config=text, vision_config=vision)


def make_tiny_model(path: str, variant: str, seed: int = 0) -> str:
    """Writes config.json + model.safetensors + tokenizer to `path` (once) and returns it."""
    import transformers
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    if variant in VISION_LANGUAGE:
        model = getattr(transformers, VISION_LANGUAGE[variant][0])(make_vision_language_config(variant)).float()
    else:
        model = AutoModelForCausalLM.from_config(make_config(variant), dtype=torch.float32)
    if variant.startswith("gemma"):  # transformers starts Gemma's (1 + w) norms at w = 0: make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    build_tokenizer(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time; output tokens up to and including EOS."""
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )[0, len(ids) :].tolist()
            if EOS_ID in gen:
                gen = gen[: gen.index(EOS_ID) + 1]
            outs.append(gen)
    return outs
