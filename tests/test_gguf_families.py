"""GGUF files of the newer model families (Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3) load and generate what
transformers generates.

Each test writes a tiny random model as llama.cpp's convert_hf_to_gguf.py would (the architecture's metadata keys,
gguf's tensor names, Gemma's norms stored as 1 + w, a byte-level BPE tokenizer section), in F32 holding values
rounded to bfloat16: the directory aserve converts a GGUF to is bf16, so those values round-trip exactly. Greedy
tokens of `LLM(file.gguf)` must equal transformers' greedy generate on the same file, and transformers' on the
original checkpoint with its weights rounded to bf16 (so the file says what the checkpoint says).

The tiny configs keep only what transformers' GGUF loader reads back (integrations/ggml.py GGUF_CONFIG_MAPPING);
every other field is left at the config class's default, which the loader fills in:
  Qwen3       head_dim 128 (the mapping has no attention.key_length for qwen3: Qwen3Config's default 128 applies)
  Qwen3-MoE   4 experts, top-2; moe_intermediate_size 768 (expert_feed_forward_length is not read), every layer
              sparse (no mlp_only_layers in GGUF), norm_topk_prob on (the loader's default for qwen3moe, as
              llama.cpp runs it)
  Gemma 2     soft-capping 50 / 30 and query_pre_attn_scalar 256 (written by llama.cpp, not read)
  Gemma 3     query_pre_attn_scalar 256, sliding layers 5 of every 6, default rotary (no linear scaling)
  Phi-3       default rotary (LongRoPE factors are tensors transformers does not load)
"""

from __future__ import annotations

import json
import os
import random

import gguf
import numpy as np
import pytest
import torch
from tiny_models import BOS_ID, EOS_ID, build_tokenizer, hf_greedy, make_config
from transformers import AutoTokenizer

from aserve import LLM, SamplingParams, envs
from aserve.models.model_path import gguf_cache_dir

MAX_NEW = 12
PROMPT_LENS = (3, 11, 29)

# model_type -> gguf architecture (gguf.MODEL_ARCH_NAMES)
GGUF_ARCH = {
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3_text": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}


def gguf_config(variant: str):
    """The tiny config of `variant` with the fields GGUF cannot carry set to what transformers' loader assumes."""
    config = make_config(variant)
    if variant == "qwen3":
        config.head_dim = 128
    elif variant == "qwen3_moe":
        config.moe_intermediate_size = 768
        config.num_experts = 4
        config.mlp_only_layers = []
        config.norm_topk_prob = True
    elif variant == "gemma2":
        config.attn_logit_softcapping, config.final_logit_softcapping = 50.0, 30.0
        config.query_pre_attn_scalar = 256
    elif variant == "gemma3":
        fields = dict(num_hidden_layers=6, query_pre_attn_scalar=256, sliding_window_pattern=6, layer_types=None,
                      rope_parameters=None)  # fmt: skip
        config = type(config)(**{**config.to_dict(), **fields})
    elif variant == "phi3":
        fields = dict(rope_parameters=None, original_max_position_embeddings=4096)
        config = type(config)(**{**config.to_dict(), **fields})
    return config


def make_bf16_model(path: str, variant: str, seed: int = 0) -> str:
    """A tiny random checkpoint of `variant` whose float32 weights hold bf16 values."""
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gguf_config(variant), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if variant.startswith("gemma") and "norm" in name:  # make Gemma's (1 + w) norms count
                param.normal_(0.0, 0.2)
            if variant.startswith("gemma") and name.endswith("embed_tokens.weight"):
                # scaled by sqrt(hidden) and tied to the head, larger embeddings make every step repeat its input
                param.mul_(0.2)
            param.copy_(param.to(torch.bfloat16).float())
    model.save_pretrained(path)
    build_tokenizer(path)
    return path


def _tokenizer_section(writer: gguf.GGUFWriter, hf_dir: str) -> None:
    """tokenizer.ggml.*: what convert_hf_to_gguf.py's _set_vocab_gpt2 writes for a byte-level BPE."""
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [None] * len(vocab)
    for text, idx in vocab.items():
        tokens[idx] = text
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(EOS_ID)


def _hparams(writer: gguf.GGUFWriter, config) -> None:
    """{arch}.*: the hyperparameters convert_hf_to_gguf.py writes for these families."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters.get("full_attention", config.rope_parameters)["rope_theta"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if config.model_type == "qwen3_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "phi3":
        writer.add_rope_dimension_count(head_dim)


def _gguf_tensors(model, arch) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under gguf's names, transformed as convert_hf_to_gguf.py does for `arch`."""
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for a tied head
        tensor = tensor.float()
        base, suffix = hf_name.rsplit(".", 1)
        if base.endswith("mlp.experts"):  # fused experts: gate_up_proj [E, 2I, H] -> ffn_gate_exps, ffn_up_exps
            bid = base.split(".")[2]
            if suffix == "gate_up_proj":
                gate, up = tensor.chunk(2, dim=1)
                out[f"blk.{bid}.ffn_gate_exps.weight"] = gate.numpy()
                out[f"blk.{bid}.ffn_up_exps.weight"] = up.numpy()
            else:
                out[f"blk.{bid}.ffn_down_exps.weight"] = tensor.numpy()
            continue
        if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3) and hf_name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's RMSNorm multiplies by w; Gemma's by 1 + w
        gguf_name = names.get_name(base)
        assert gguf_name is not None, hf_name
        out[f"{gguf_name}.{suffix}"] = tensor.contiguous().numpy()
    return out


def write_gguf(hf_dir: str, gguf_path: str) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    arch = GGUF_ARCH[model.config.model_type]
    writer = gguf.GGUFWriter(gguf_path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(os.path.basename(gguf_path).removesuffix(".gguf"))
    _hparams(writer, model.config)
    _tokenizer_section(writer, hf_dir)
    for name, array in _gguf_tensors(model, arch).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def hf_gguf_greedy(gguf_path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate on the GGUF file itself: its config and weights as transformers' GGUF loader reads
    them (`from_pretrained(gguf_file=...)` calls the same `load_gguf_checkpoint` for these architectures, but needs
    accelerate, which aserve does not depend on)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    model.tie_weights()
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


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """ASERVE_CACHE in tmp_path, so that conversions stay in the test; the compiled CPU kernels are shared with the
    cache in use (a link), so that they are not rebuilt."""
    kernels = os.path.join(envs.ASERVE_CACHE, "torch_extensions")
    os.makedirs(kernels, exist_ok=True)
    root = tmp_path / "cache"
    root.mkdir()
    os.symlink(kernels, root / "torch_extensions")
    monkeypatch.setenv("ASERVE_CACHE", str(root))
    return root


def prompts_for(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(n)] for n in PROMPT_LENS]


FAMILIES = ["qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3"]  # ~2 s each


@pytest.mark.parametrize("variant", FAMILIES)
def test_gguf_family_matches_transformers(tmp_path, cache, variant):
    hf_dir = make_bf16_model(str(tmp_path / variant), variant)
    gguf_path = write_gguf(hf_dir, str(tmp_path / f"tiny-{variant}.gguf"))
    prompts = prompts_for()

    expected = hf_greedy(hf_dir, prompts, MAX_NEW)
    assert hf_gguf_greedy(gguf_path, prompts, MAX_NEW) == expected

    llm = LLM(gguf_path, dtype="float32", enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    # the tokenizer of the file's tokenizer.ggml.* section splits text as transformers' and the original do
    text = "Hello world! The quick brown fox: prefix caching, 0123."
    ids = AutoTokenizer.from_pretrained(hf_dir).encode(text)
    assert AutoTokenizer.from_pretrained(tmp_path, gguf_file=os.path.basename(gguf_path)).encode(text) == ids
    assert llm.get_tokenizer().encode(text) == ids
    converted = gguf_cache_dir(gguf_path)
    assert converted.startswith(str(cache)) and os.path.exists(os.path.join(converted, "model.safetensors"))
