"""Quantised GGUF files of the newer model families load and generate what transformers generates on a checkpoint
holding the file's dequantised values.

The files are written as tests/test_gguf_families.py writes them, with the weight matrices stored the way llama.cpp's
quantiser stores them (llama_tensor_get_type, simplified): norms, rotary factors and the MoE router stay F32;
  Q8_0     every other matrix Q8_0 (blocks of 32: int8 and one fp16 scale)
  Q4_K_M   Q4_K (super-blocks of 256: 8 scales and mins of 6 bits, 4-bit values), with Q6_K for the output matrix
           (the token embedding where the head is tied) and for the attention values and MLP down projections of
           the layers llama.cpp gives more bits (use_more_bits), Q5_K for Phi-3's fused qkv
  Q5_K_M   the same with Q5_K (5-bit values) in place of Q4_K
  F16, BF16  the unquantised files llama.cpp's converter writes
A matrix whose rows are not a multiple of 256 takes llama.cpp's fallback type (Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0). The gguf package quantises Q8_0 and Q5_0/Q5_1 but not the K-quants: quantize() below encodes those
blocks (round to nearest on each block's range, not llama.cpp's search for the best scales; any valid block is
exercised the same way by the loader). The configs are widened to rows of 256 so that the K-quants are used.

The reference is transformers' greedy generate on the original checkpoint with every tensor replaced by the file's
tensor decoded by gguf.quants.dequantize (independent of aserve's conversion) and rounded to bf16, as aserve's
converted directory holds it.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_families import (
    GGUF_ARCH,
    MAX_NEW,
    cache,  # noqa: F401  (the fixture the tests use)
    gguf_config,
    make_bf16_model,
    prompts_for,
    write_gguf,
)
from tiny_models import hf_greedy
from transformers import AutoModelForCausalLM

from aserve import LLM, SamplingParams
from aserve.models.model_path import gguf_cache_dir

QK_K = 256
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
FILE_TYPES = {
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K_M": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
}


def _min_blocks(x: np.ndarray, top: int):
    """Q4_K / Q5_K: x ~ d * sc[j] * q - dmin * m[j] on 8 sub-blocks of 32, q in 0..top, sc and m of 6 bits."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale, mins = (sub.max(-1) - low) / top, -low
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / np.where(dmin == 0, 1, dmin)), 0, 63).astype(np.uint8)
    step = d.astype(np.float32) * sc
    q = np.rint((sub + (dmin.astype(np.float32) * m)[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.clip(q, 0, top).astype(np.uint8)
    scales = np.concatenate(
        [sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6, (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4],
        axis=-1,
    )
    low_bits = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low_bits[:, :, 0] | low_bits[:, :, 1] << 4).reshape(-1, 128)
    return [d.view(np.uint8), dmin.view(np.uint8), scales], q, qs


def _q4_k(x: np.ndarray) -> np.ndarray:
    head, _, qs = _min_blocks(x, 15)
    return np.concatenate([*head, qs], axis=-1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    head, q, qs = _min_blocks(x, 31)
    high = ((q >> 4) & 1).astype(np.uint32) << np.arange(8, dtype=np.uint32)[None, :, None]  # bit j: sub-block j
    qh = high.sum(1).astype(np.uint8)
    return np.concatenate([*head, qh, qs], axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """x ~ d * sc[j] * (q - 32) on 16 sub-blocks of 16, q of 6 bits, sc int8."""
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d == 0, 1, d)), 0, 127).astype(np.int8)
    step = (d.astype(np.float32) * sc)[..., None]
    q = (np.clip(np.rint(sub / np.where(step == 0, 1, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, QK_K)
    low, high = (q & 15).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0] | low[:, :, 1] << 4).reshape(-1, 128)
    qh = (high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=-1)


_K_QUANTS = {Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def quantize(array: np.ndarray, qtype: Q) -> np.ndarray:
    """array [..., n] -> the bytes of `qtype` [..., n / block * bytes per block], as gguf.quants.quantize gives."""
    if qtype not in _K_QUANTS:
        return gguf.quants.quantize(array, qtype)
    blocks = _K_QUANTS[qtype](np.ascontiguousarray(array, dtype=np.float32).reshape(-1, QK_K))
    return blocks.reshape(*array.shape[:-1], -1)


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers whose attention values and MLP down projections get more bits."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(scheme: str, name: str, shape: tuple[int, ...], n_layers: int, tied: bool) -> Q:
    """The type llama.cpp's quantiser gives tensor `name` in a file of `scheme`."""
    if len(shape) == 1 or ".ffn_gate_inp." in name:
        return Q.F32
    if scheme in ("Q8_0", "F16", "BF16"):
        return Q[scheme]
    base = Q.Q4_K if scheme == "Q4_K_M" else Q.Q5_K
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = Q.Q6_K
    elif (".attn_v." in name or ".ffn_down" in name) and _use_more_bits(layer, n_layers):
        qtype = Q.Q6_K
    elif ".attn_qkv." in name:
        qtype = Q.Q5_K
    else:
        qtype = base
    return _FALLBACK[qtype] if shape[-1] % QK_K else qtype


# rows of 256 (hidden size and every projection's input), so that the K-quants are used
WIDE = {
    "qwen3": dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64),
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256, num_attention_heads=4, head_dim=64),
    "gemma3": dict(hidden_size=256, intermediate_size=256, head_dim=64),
    "phi3": dict(hidden_size=256, intermediate_size=256, num_attention_heads=16),  # head_dim 16: its 8 factors
}


def wide_config(variant: str):
    config = gguf_config(variant)
    config = type(config)(**{**config.to_dict(), **WIDE[variant]})
    if variant.startswith("gemma"):  # what a GGUF implies (test_gguf_families.gguf_config)
        config.query_pre_attn_scalar = config.head_dim
    return config


def dequantised_checkpoint(hf_dir: str, gguf_path: str, out_dir: str) -> str:
    """The checkpoint in `hf_dir` with every tensor the file's (gguf.quants.dequantize), rounded to bf16."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = model.config
    arch = GGUF_ARCH[config.model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(gguf_path).tensors}
    state = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        if base.endswith("mlp.experts"):  # gate_up_proj [E, 2I, H] is ffn_gate_exps and ffn_up_exps
            block = f"blk.{base.split('.')[2]}"
            parts = ("ffn_gate_exps", "ffn_up_exps") if suffix == "gate_up_proj" else ("ffn_down_exps",)
            value = np.concatenate([stored[f"{block}.{part}.weight"] for part in parts], axis=1)
        else:
            value = stored[f"{names.get_name(base)}.{suffix}"]
            if config.model_type.startswith("gemma") and hf_name.endswith("norm.weight"):
                value = value - 1  # stored as 1 + w
        state[hf_name] = torch.from_numpy(np.array(value)).reshape(tensor.shape).bfloat16().float()
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    model.save_pretrained(out_dir)
    return out_dir


def write_quantised(tmp_path, variant: str, scheme: str) -> tuple[str, str]:
    """-> (GGUF file of `scheme`, reference checkpoint holding its dequantised values)."""
    config = wide_config(variant)
    hf_dir = make_bf16_model(str(tmp_path / variant), variant, config=config)
    tied = config.tie_word_embeddings

    def encode(name, array):
        qtype = tensor_type(scheme, name, array.shape, config.num_hidden_layers, tied)
        return quantize(array, qtype), qtype

    gguf_path = write_gguf(hf_dir, str(tmp_path / f"tiny-{variant}-{scheme}.gguf"), encode, FILE_TYPES[scheme])
    return gguf_path, dequantised_checkpoint(hf_dir, gguf_path, str(tmp_path / f"{variant}-{scheme}-dequantised"))


def test_k_quant_blocks_decode_to_the_values():
    """The encoders write blocks gguf's decoder reads back within each type's rounding error."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 2 * QK_K)) * rng.uniform(0.01, 3.0, (6, 1))).astype(np.float32)
    x[1, :QK_K] = 0.0  # an all-zero super-block
    x[2] = np.abs(x[2])  # no negative values: a zero minimum
    for qtype, tolerance in ((Q.Q4_K, 0.12), (Q.Q5_K, 0.06), (Q.Q6_K, 0.025)):
        data = quantize(x, qtype)
        assert data.dtype == np.uint8 and data.shape == (6, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
        error = np.abs(gguf.quants.dequantize(data, qtype) - x).max(-1)
        assert (error <= tolerance * np.abs(x).max(-1)).all(), (qtype.name, error)


# (variant, scheme): Q8_0 and Q4_K_M on a dense family and on Qwen3-MoE's 3-D expert tensors, Gemma 3's tied Q6_K
# embedding and Phi-3's Q5_K fused qkv in the default run (~1-3 s each); the other mixes are slow
CASES = [
    ("qwen3", "Q4_K_M"),
    ("qwen3_moe", "Q4_K_M"),
    ("qwen3", "Q8_0"),
    ("qwen3_moe", "Q8_0"),
    ("gemma3", "Q4_K_M"),
    ("phi3", "Q4_K_M"),
    pytest.param("qwen3", "Q5_K_M", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "Q5_K_M", marks=pytest.mark.slow),
    pytest.param("gemma3", "Q8_0", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "BF16", marks=pytest.mark.slow),
    pytest.param("gemma3", "F16", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("variant,scheme", CASES)
@pytest.mark.usefixtures("cache")
def test_quantised_gguf_matches_transformers_on_its_values(tmp_path, variant, scheme):
    gguf_path, reference = write_quantised(tmp_path, variant, scheme)
    types = {t.tensor_type for t in gguf.GGUFReader(gguf_path).tensors}
    mixes = {"Q4_K_M": {Q.Q4_K, Q.Q6_K}, "Q5_K_M": {Q.Q5_K, Q.Q6_K}}
    expected_types = mixes[scheme] if scheme in mixes else {Q[scheme]}
    assert expected_types <= types and types <= expected_types | {Q.F32, Q.Q5_K}, types
    prompts = prompts_for()

    expected = hf_greedy(reference, prompts, MAX_NEW)

    llm = LLM(gguf_path, dtype="float32", enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    # the converted directory holds exactly the file's values in bf16
    converted = AutoModelForCausalLM.from_pretrained(gguf_cache_dir(gguf_path), dtype=torch.float32).state_dict()
    for name, tensor in AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).state_dict().items():
        assert torch.equal(converted[name], tensor), name
