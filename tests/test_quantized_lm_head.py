"""The quantised lm_head (`--quantize-lm-head`): greedy tokens equal transformers' on the checkpoint whose head is
replaced by the rounded head's weights (float32 tiny models; int8 for unquantised and int8 models, fp8 for
`--quantization fp8`, int4 for AWQ and GPTQ; tied and untied heads), prompt logprobs equal transformers' logits there,
speculative decoding and tensor parallelism give the same tokens, the CLI / HTTP path, and the refusals."""

import json
import os
import shutil

import pytest
import torch
from aserve_server import running_server
from safetensors.torch import load_file, save_file
from test_awq_model import MAX_NEW, PROMPTS, autoawq_checkpoint, dequantized_checkpoint
from test_fp8 import fp8_rounding, rounded_copy
from test_gptq import gptq_checkpoint
from test_int8 import int8_rounding
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.layers.linear import Linear
from aserve.layers.quantization.awq import AWQConfig
from aserve.layers.quantization.awq_format import fake_quantize
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.quantization.int8 import Int8LinearMethod
from aserve.layers.quantization.lm_head import (
    Fp8HeadMethod,
    Int4HeadMethod,
    int4_group_size,
    lm_head_method,
)

ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=256, quantize_lm_head=True)


def int4_rounding(group_size: int):
    return lambda w: fake_quantize(w, group_size)


def head_replaced_copy(src: str, dst: str, rounding) -> str:
    """src with lm_head.weight = rounding(its head) (a tied head: of the embedding, which stays as it is; the copy is
    untied), for transformers."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    tensors["lm_head.weight"] = rounding(head.float()).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["tie_word_embeddings"] = False
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]


def model_of(llm: LLM):
    return llm.engine.core.runner.model


@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_int8_head_matches_transformers_on_the_rounded_head(tiny_model_factory, tmp_path, variant):
    path = tiny_model_factory(variant)
    expected = hf_greedy(head_replaced_copy(path, str(tmp_path / "ref"), int8_rounding), PROMPTS, MAX_NEW)
    llm = LLM(path, **ENGINE)
    model = model_of(llm)
    assert type(model.lm_head.quant_method) is Int8LinearMethod and model.lm_head.weight.dtype == torch.int8
    assert model.embed_tokens.weight.dtype == torch.float32  # tied: the embedding keeps its table
    assert greedy(llm) == expected
    # prompt logprobs (more rows than the C kernel's: the widened path) are transformers' on the rounded head
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32).eval()
    prompt = PROMPTS[2]
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(entry[prompt[i]].logprob - want[i - 1, prompt[i]].item()) < 1e-4
    sampled = out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].logprob
    assert abs(sampled - want[-1].max().item()) < 1e-4


def test_int8_head_of_an_int8_model(tiny_model_factory, tmp_path):
    path = tiny_model_factory("qwen2")  # q/k/v biases
    ref = head_replaced_copy(rounded_copy(path, str(tmp_path / "lin"), int8_rounding), str(tmp_path / "ref"),
                             int8_rounding)  # fmt: skip
    llm = LLM(path, quantization="int8", **ENGINE)
    assert model_of(llm).lm_head.weight.dtype == torch.int8
    assert greedy(llm) == hf_greedy(ref, PROMPTS, MAX_NEW)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the weight-only path is the CPU's")
@pytest.mark.parametrize("variant", ["gqa", pytest.param("tied", marks=pytest.mark.slow)])
def test_fp8_head_matches_transformers(tiny_model_factory, tmp_path, variant):
    path = tiny_model_factory(variant)
    ref = head_replaced_copy(rounded_copy(path, str(tmp_path / "lin")), str(tmp_path / "ref"), fp8_rounding)
    llm = LLM(path, quantization="fp8", **ENGINE)
    assert type(model_of(llm).lm_head.quant_method) is Fp8HeadMethod
    assert greedy(llm) == hf_greedy(ref, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("variant", [
    "qwen2_mqa",  # a vocabulary of 385 (padded to 512 rows), hidden 64: the checkpoint's group of 32
    pytest.param("tied", marks=pytest.mark.slow),
])  # fmt: skip
def test_awq_int4_head_matches_transformers(tiny_model_factory, tmp_path, variant):
    awq_dir = autoawq_checkpoint(tiny_model_factory(variant), str(tmp_path / "awq"), 32)
    ref = head_replaced_copy(dequantized_checkpoint(awq_dir, str(tmp_path / "deq")), str(tmp_path / "ref"),
                             int4_rounding(32))  # fmt: skip
    llm = LLM(awq_dir, quantization="awq", **ENGINE)
    head = model_of(llm).lm_head
    assert type(head.quant_method) is Int4HeadMethod and head.weight.numel() == 0
    assert head.int4.out_features % 128 == 0 and head.int4.quant_method.config.group_size == 32
    assert greedy(llm) == hf_greedy(ref, PROMPTS, MAX_NEW)


@pytest.mark.slow
def test_gptq_int4_head_matches_transformers(tiny_model_factory, tmp_path):
    gptq_dir, deq_dir = gptq_checkpoint(tiny_model_factory("gqa"), str(tmp_path / "gptq"), 32, True, False, 1)
    ref = head_replaced_copy(deq_dir, str(tmp_path / "ref"), int4_rounding(32))
    llm = LLM(gptq_dir, quantization="gptq", **ENGINE)
    assert type(model_of(llm).lm_head.quant_method) is Int4HeadMethod
    assert greedy(llm) == hf_greedy(ref, PROMPTS, MAX_NEW)


def test_int4_head_on_the_triton_kernels_matches_its_dense_copy():
    """The int4 head's AWQ layer on the Triton kernels (a GPU, or Triton's interpreter here) computes what the CPU's
    dequantised copy does, its padding rows dropped."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    head = Linear(128, 300, bias=False)
    head.quant_method = Int4HeadMethod(checkpoint_group_size=64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 128, generator=torch.Generator().manual_seed(0)))
    head.to(torch.float16).process_weights_after_loading()
    assert head.int4.out_features == 384 and head.int4.quant_method.config.group_size == 128
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).half()
    want = head(x)
    assert want.shape == (3, 300)
    head.int4.to(device).quant_method.use_triton(head.int4)
    for rows in (1, 3):
        got = head(x[:rows].to(device)).float().cpu()
        torch.testing.assert_close(got, want[:rows].float(), atol=2e-2, rtol=2e-3)


def test_speculative_decoding_keeps_the_quantised_heads_tokens(tiny_model_factory):
    path = tiny_model_factory("gqa")
    expected = greedy(LLM(path, **ENGINE))
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                 {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3}):  # fmt: skip
        llm = LLM(path, speculative_config=spec, **ENGINE)
        assert greedy(llm) == expected
        assert llm.engine.stats.spec_draft_tokens_total > 0


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "awq"])
def test_tensor_parallel_heads_round_each_ranks_rows(tiny_model_factory, tmp_path, quantization):
    """Two ranks, a vocabulary split unevenly (385): each rank rounds its rows (int8 per row; int4 per group of a
    row, each rank's rows padded on their own), the same rounding as one rank's."""
    path = tiny_model_factory("qwen2_mqa")
    if quantization == "awq":
        path = autoawq_checkpoint(path, str(tmp_path / "awq"), 32)
    one_rank = greedy(LLM(path, quantization=quantization, **ENGINE))
    assert greedy(LLM(path, quantization=quantization, tensor_parallel_size=2, **ENGINE)) == one_rank


@pytest.mark.slow
def test_served_over_http_with_the_openai_client(tiny_model_factory, tmp_path):
    openai = pytest.importorskip("openai")
    path = tiny_model_factory("gqa")
    expected = hf_greedy(head_replaced_copy(path, str(tmp_path / "ref"), int8_rounding), PROMPTS[:1], MAX_NEW)
    with running_server("--model", path, "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                        "--quantize-lm-head") as url:  # fmt: skip
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        resp = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0,
                                         extra_body={"return_token_ids": True})  # fmt: skip
    assert resp.choices[0].model_dump()["token_ids"] == expected[0]


def test_refusals(tiny_model_factory):
    with pytest.raises(ValueError, match="--quantize-lm-head cannot run in deterministic mode"):
        LLM(tiny_model_factory("gqa"), deterministic=True, **ENGINE)
    with pytest.raises(ValueError, match="group size that divides the hidden size 576"):
        int4_group_size(576, -1)
    assert int4_group_size(576, 64) == 64 and int4_group_size(4096, 64) == 128

    class Other(QuantizationConfig):
        name = "bitnet"
        from_config = to_hf = get_linear_method = None

    with pytest.raises(ValueError, match="--quantize-lm-head is not supported with bitnet quantisation"):
        lm_head_method(Other())
    assert isinstance(lm_head_method(AWQConfig(group_size=64)), Int4HeadMethod)
    assert type(lm_head_method(None)) is Int8LinearMethod
