"""GGUF files of the newer model families (Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3) load and generate what
transformers generates on the original checkpoint.

Each test writes a tiny random model as llama.cpp's convert_hf_to_gguf.py would (the architecture's metadata keys,
gguf's tensor names, Gemma's norms stored as 1 + w, Phi-3's LongRoPE factors as tensors, a byte-level BPE tokenizer
section, or Gemma's SentencePiece one), in F32 holding values rounded to bfloat16 (tests/test_gguf_quantized.py
writes the quantised types): the directory aserve converts a GGUF to is bf16, so those values round-trip exactly.
Greedy tokens of `LLM(file.gguf)` must equal transformers' greedy generate on the original checkpoint with its weights
rounded to bf16 (so the file says what the checkpoint says), and the converted config must hold the checkpoint's
values of the fields below.

The tiny configs set, apart from the defaults, the fields that transformers' GGUF loader does not read back
(integrations/ggml.py GGUF_CONFIG_MAPPING) and aserve reads from the file's metadata (aserve/models/gguf_config.py):
  Qwen3       head_dim 32 (attention.key_length)
  Qwen3-MoE   moe_intermediate_size 48 (expert_feed_forward_length)
  Gemma 2     soft-capping 5 / 10 (attn_logit_softcapping, final_logit_softcapping)
  Gemma 3     linear rotary scaling 8 on the global layers, local base 100 (rope.scaling.*, rope.freq_base_swa)
              logit soft-capping 10 (final_logit_softcapping)
  Phi-3       LongRoPE factors (the tensors rope_factors_short / rope_factors_long, rope.scaling.attn_factor and
              original_context_length)
transformers' own reading of these files (`from_pretrained(gguf_file=...)`) therefore differs from the checkpoint
(a shape mismatch for Qwen3 and Qwen3-MoE, other soft-caps or rotary otherwise) and is not compared.
Fields GGUF does not carry keep the value transformers and llama.cpp assume:
  Qwen3-MoE   every layer sparse (no mlp_only_layers), norm_topk_prob on (llama.cpp renormalises the top-k weights)
  Gemma 2/3   query_pre_attn_scalar = head_dim (llama.cpp scales by head_dim except on the 27B models, where it
              takes hidden_size / num_heads; aserve/models/gguf_config.py does the same)
  Gemma 3     sliding layers 5 of every 6 (llama.cpp's fixed pattern)
  Phi-3       LongRoPE without `factor` (as in the released configs): llama.cpp writes the attention factor of the
              context extension max_position_embeddings / original_max_position_embeddings (1024 / 256)
"""

from __future__ import annotations

import json
import math
import os
import random

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import _CORPUS as CORPUS
from tiny_models import BOS_ID, EOS_ID, VOCAB_SIZE, build_tokenizer, hf_greedy, make_config
from transformers import AutoConfig, AutoTokenizer, Gemma2Config, Gemma3TextConfig

from aserve import LLM, SamplingParams, envs
from aserve.models.gguf_config import _gemma_query_pre_attn_scalar
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
    """The tiny config of `variant` with the fields GGUF cannot carry set to what transformers and llama.cpp assume."""
    config = make_config(variant)
    if variant == "qwen3_moe":
        config.num_experts = 4
        config.mlp_only_layers = []
        config.norm_topk_prob = True
    elif variant == "gemma2":
        config.query_pre_attn_scalar = config.head_dim
    elif variant == "gemma3":
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}  # fmt: skip
        fields = dict(num_hidden_layers=6, query_pre_attn_scalar=config.head_dim, sliding_window_pattern=6,
                      layer_types=None,
                      rope_parameters=rope, final_logit_softcapping=10.0)  # fmt: skip
        config = type(config)(**{**config.to_dict(), **fields})
    elif variant == "phi3":  # as released configs: no `factor`, the context grows by max / original positions
        rope = {k: v for k, v in config.rope_parameters.items() if k != "factor"}
        config = type(config)(**{**config.to_dict(), "max_position_embeddings": 1024, "rope_parameters": rope})
    return config


# what aserve reads from the file's metadata: model_type -> config fields the converted directory must hold
READ_FIELDS = {
    "qwen3": ("head_dim",),
    "qwen3_moe": ("head_dim", "moe_intermediate_size"),
    "gemma2": ("head_dim", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window"),
    "gemma3_text": ("head_dim", "sliding_window", "rope_parameters", "final_logit_softcapping"),
    "phi3": ("original_max_position_embeddings",),
}


def make_bf16_model(path: str, variant: str, seed: int = 0, config=None) -> str:
    """A tiny random checkpoint of `variant` (its gguf_config, or `config`) whose float32 weights hold bf16 values."""
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or gguf_config(variant), dtype=torch.float32)
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


# Gemma's layout: pad, eos, bos, unk, then the chat markers, the 256 byte tokens and the pieces, best merge first
SPM_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SPM_BOS, SPM_EOS = 2, 1
SPM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _sentencepiece_section(writer: gguf.GGUFWriter, hf_dir: str) -> None:
    """tokenizer.ggml.*: what convert_hf_to_gguf.py's _set_vocab_sentencepiece writes for Gemma (model "llama":
    tokens, scores, token types; no merges), for a BPE with byte fallback learned on the tiny corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")  # pieces start at "\u2581", no prefix
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPM_SPECIAL + byte_tokens, show_progress=False)
    tok.train_from_iterator([CORPUS] * 20, trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)  # the trainer numbers pieces in merge order
    kinds = {"<unk>": gguf.TokenType.UNKNOWN, **dict.fromkeys(byte_tokens, gguf.TokenType.BYTE)}
    types = [kinds.get(t, gguf.TokenType.CONTROL if t in SPM_SPECIAL else gguf.TokenType.NORMAL) for t in tokens]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) if k == gguf.TokenType.NORMAL else 0.0 for i, k in enumerate(types)])
    writer.add_token_types(types)
    writer.add_bos_token_id(SPM_BOS)
    writer.add_eos_token_id(SPM_EOS)
    writer.add_unk_token_id(SPM_SPECIAL.index("<unk>"))
    writer.add_pad_token_id(SPM_SPECIAL.index("<pad>"))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(SPM_CHAT_TEMPLATE)


def _hparams(writer: gguf.GGUFWriter, config, file_type=gguf.LlamaFileType.ALL_F32) -> None:
    """{arch}.*: the hyperparameters convert_hf_to_gguf.py writes for these families."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if "sliding_attention" in config.rope_parameters:
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(file_type)
    if config.model_type == "qwen3_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type == "gemma3_text" and config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "phi3":
        writer.add_rope_dimension_count(head_dim)
        original = config.original_max_position_embeddings
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_rope_scaling_orig_ctx_len(original)


def _gguf_tensors(model, arch) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under gguf's names, transformed as convert_hf_to_gguf.py does for `arch`."""
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out = {}
    if config.rope_parameters.get("rope_type") == "longrope":
        for kind, tensor in (
            ("short", gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT),
            ("long", gguf.MODEL_TENSOR.ROPE_FACTORS_LONG),
        ):
            out[f"{gguf.TENSOR_NAMES[tensor]}.weight"] = np.array(config.rope_parameters[f"{kind}_factor"], np.float32)
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


def write_gguf(hf_dir: str, gguf_path: str, encode=None, file_type=gguf.LlamaFileType.ALL_F32, vocab=None) -> str:
    """Writes the checkpoint in `hf_dir` as a GGUF file. `encode(name, array) -> (data, ggml type)` stores a tensor in
    another type than F32 (`file_type` names the mix); `vocab(writer, hf_dir)` writes the tokenizer section."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    arch = GGUF_ARCH[model.config.model_type]
    writer = gguf.GGUFWriter(gguf_path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(os.path.basename(gguf_path).removesuffix(".gguf"))
    _hparams(writer, model.config, file_type)
    (vocab or _tokenizer_section)(writer, hf_dir)
    for name, array in _gguf_tensors(model, arch).items():
        if encode is None:
            writer.add_tensor(name, array)
        else:
            data, ggml_type = encode(name, array)
            writer.add_tensor(name, data, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


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
    # the fields transformers' GGUF loader leaves at defaults hold the checkpoint's values
    original, got = (AutoConfig.from_pretrained(d) for d in (hf_dir, converted))
    for field in READ_FIELDS[original.model_type]:
        assert getattr(got, field) == getattr(original, field), field
    if original.model_type == "phi3":
        for kind in ("short_factor", "long_factor"):
            assert got.rope_parameters[kind] == pytest.approx(original.rope_parameters[kind], rel=1e-6)
        assert got.rope_parameters["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))


def test_gemma_attention_scale_is_llama_cpps():
    """GGUF has no key for query_pre_attn_scalar: the 27B models (by llama.cpp's layer counts) scale by
    hidden_size / num_heads, the others by head_dim, as llama.cpp runs them."""
    gemma2_27b = Gemma2Config(num_hidden_layers=46, hidden_size=4608, num_attention_heads=32, head_dim=128)
    gemma3_27b = Gemma3TextConfig(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, head_dim=128)
    gemma3_12b = Gemma3TextConfig(num_hidden_layers=48, hidden_size=3840, num_attention_heads=16, head_dim=256)
    assert _gemma_query_pre_attn_scalar(gemma2_27b, "gemma2") == 144
    assert _gemma_query_pre_attn_scalar(gemma3_27b, "gemma3_text") == 168
    assert _gemma_query_pre_attn_scalar(gemma3_12b, "gemma3_text") == 256


SPM_TEXTS = [
    "Hello world! The quick brown fox: prefix caching, 0123.",
    "  two  spaces, a tab\tand a newline\n",
    "\u00e9moji \U0001f642 \u00fcn\u00efcode",  # not in the vocabulary: byte fallback
    "<start_of_turn>user\nhi<end_of_turn>",
]


def test_gemma_gguf_with_sentencepiece_vocabulary(tmp_path, cache):
    """A Gemma 3 GGUF with the SentencePiece section real Gemma files carry (tokenizer.ggml.model "llama"): aserve's
    tokenizer encodes and decodes as transformers' tokenizer of the file, adds BOS as the file says, renders the
    file's chat template, and text prompts generate transformers' tokens and text."""
    config = gguf_config("gemma3")
    config.bos_token_id, config.eos_token_id, config.pad_token_id = SPM_BOS, SPM_EOS, SPM_SPECIAL.index("<pad>")
    hf_dir = make_bf16_model(str(tmp_path / "gemma3"), "gemma3", config=config)
    # 256 of the 384 tokens are bytes, which a trained model seldom emits and this random one mostly would: zero
    # embeddings (tied to the head: logits 0) keep its outputs to the pieces, whose text is fixed
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    weights["model.embed_tokens.weight"][len(SPM_SPECIAL) : len(SPM_SPECIAL) + 256] = 0.0
    save_file(weights, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    gguf_path = write_gguf(hf_dir, str(tmp_path / "tiny-gemma3-spm.gguf"), vocab=_sentencepiece_section)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=os.path.basename(gguf_path))

    llm = LLM(gguf_path, dtype="float32", enforce_eager=True)
    tokenizer = llm.get_tokenizer()
    for text in SPM_TEXTS:
        ids = reference.encode(text)
        assert ids[0] == SPM_BOS
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids) == reference.decode(ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(reference.encode(SPM_TEXTS[2]), skip_special_tokens=True) == SPM_TEXTS[2]

    prompts = SPM_TEXTS[:2]
    expected = hf_greedy(hf_dir, [reference.encode(p) for p in prompts], MAX_NEW)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.prompt_token_ids for o in outs] == [reference.encode(p) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert [o.outputs[0].text for o in outs] == [reference.decode(e, skip_special_tokens=True) for e in expected]

    messages = [{"role": "user", "content": "Hello world!"}]
    chat_ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert llm.apply_chat_template(messages) == list(chat_ids)
    assert chat_ids[:2] == [SPM_BOS, SPM_SPECIAL.index("<start_of_turn>")]
