"""GPTQ checkpoints whose lm_head is quantised too (GPTQModel's `"lm_head": true`): written by `aserve quantize
--format gptq --quantize-lm-head` (the head calibrated by GPTQ on the final norm's outputs), loaded with the head on
the int4 kernels, greedy tokens equal to transformers' on the dequantised weights."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_awq_model import MAX_NEW, PROMPTS, aserve_greedy, copy_model_dir
from tiny_models import hf_greedy

from aserve import LLM
from aserve.cli import main as cli_main
from aserve.distributed.sharding import check_shardable
from aserve.layers.quantization import gptq_format
from aserve.layers.quantization.awq import AWQLinearMethod
from aserve.layers.quantization.gptq import FORMAT_VERSIONS, GPTQConfig
from aserve.quantize.quantize import quantize_model


def gptq_dequantized_checkpoint(gptq_dir: str, out_dir: str) -> str:
    """The float checkpoint of the weights a GPTQ checkpoint stands for, for transformers."""
    with open(os.path.join(gptq_dir, "config.json")) as f:
        version = FORMAT_VERSIONS[json.load(f)["quantization_config"]["checkpoint_format"]]
    state = load_file(os.path.join(gptq_dir, "model.safetensors"))
    tensors = {}
    for name, t in state.items():
        if name.endswith(".qweight"):
            m = name.removesuffix(".qweight")
            tensors[f"{m}.weight"] = gptq_format.dequantize(
                t, state[f"{m}.qzeros"], state[f"{m}.scales"], state[f"{m}.g_idx"], version
            )
        elif not name.endswith((".qzeros", ".scales", ".g_idx")):
            tensors[name] = t.float()
    return copy_model_dir(gptq_dir, out_dir, tensors, None)


@pytest.mark.parametrize("variant, method", [("tied", "gptq"), ("qwen2", "rtn")])
def test_a_quantized_head_checkpoint_matches_transformers(tiny_model_factory, tmp_path, variant, method):
    out = str(tmp_path / "q")
    model = tiny_model_factory(variant)
    if method == "gptq":
        report = quantize_model(model, out, group_size=32, method=method, num_samples=4, seq_len=64, progress=False,
                                fmt="gptq", quantize_lm_head=True)  # fmt: skip
        assert report["lm_head"]["gptq"] < report["lm_head"]["rtn"]
    else:  # the CLI
        cli_main(["quantize", "--model", model, "--out", out, "--group-size", "32", "--method", method, "--format",
                  "gptq", "--quantize-lm-head"])  # fmt: skip
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["quantization_config"]["lm_head"] is True and config["tie_word_embeddings"] is False
    state = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.qweight" in state and "lm_head.weight" not in state
    assert state["model.embed_tokens.weight"].dtype != torch.int32  # the embedding stays 16-bit
    expected = hf_greedy(gptq_dequantized_checkpoint(out, str(tmp_path / "deq")), PROMPTS, MAX_NEW)
    assert aserve_greedy(out, quantization="gptq") == expected
    llm = LLM(out, dtype="float32", enforce_eager=True, max_model_len=256)
    model = llm.engine.core.runner.model
    assert isinstance(model.lm_head.quant_method, AWQLinearMethod)
    assert model.embed_tokens.weight.dtype == torch.float32


def test_quantized_head_errors(tiny_model_factory, tmp_path):
    model = tiny_model_factory("gqa")
    with pytest.raises(ValueError, match="--quantize-lm-head needs --format gptq"):
        quantize_model(model, str(tmp_path / "awq"), group_size=32, method="rtn", progress=False,
                       quantize_lm_head=True)  # fmt: skip
    out = str(tmp_path / "q")
    quantize_model(model, out, group_size=32, method="rtn", progress=False, fmt="gptq", quantize_lm_head=True)
    with pytest.raises(ValueError, match="lm_head is quantised already"):
        LLM(out, dtype="float32", enforce_eager=True, max_model_len=256, quantize_lm_head=True)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(out)
    with pytest.raises(ValueError, match="quantised lm_head cannot split across ranks"):
        check_shardable(hf_config, 2, GPTQConfig.from_config(hf_config.quantization_config))
    with pytest.raises(ValueError, match="8-bit quantised lm_head"):
        GPTQConfig.from_config({"bits": 8, "group_size": -1, "lm_head": True})
