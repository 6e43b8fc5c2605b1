"""The rotary tables against transformers' modeling_rope_utils, and a YaRN-scaled model (Qwen3's long-context
setting) token for token against transformers' generate."""

import json
import os
import shutil

import pytest
import torch
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.layers import rotary

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("params", [
    YARN,
    {**YARN, "factor": None},  # from the context lengths' ratio
    {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    {**YARN, "truncate": False, "attention_factor": 1.25},
    {**YARN, "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 32768},
])  # fmt: skip
def test_yarn_matches_transformers(params):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(head_dim=32, max_position_embeddings=512, rope_parameters=dict(params))
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    theta, scaling = rotary.rope_parameters(config)
    assert torch.equal(rotary.rope_inv_freq(32, theta, scaling), want_inv_freq)
    assert rotary.rope_attention_factor(scaling, 512) == pytest.approx(want_factor, rel=1e-12)


def yarn_copy(base: str, path: str, rope: dict) -> str:
    """A copy of the checkpoint whose config.json has `rope` over its rope_parameters."""
    shutil.copytree(base, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["rope_parameters"] = {**config["rope_parameters"], **rope}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.mark.parametrize("how", ["config", "hf_overrides"])
def test_a_yarn_scaled_model_matches_transformers(tiny_model_factory, tmp_path, how):
    """Qwen3 with YaRN (factor 4 over a 64-token original context), in its config.json or given as vLLM's
    hf_overrides (rope_scaling, as Qwen3's model card has it): prompts short and past 64 tokens, greedy, and
    logprobs within 1e-4 of transformers' on the edited config; the scaling changes the tokens."""
    base = tiny_model_factory("qwen3")
    scaling = {k: v for k, v in YARN.items() if k != "rope_theta"}
    path = yarn_copy(base, str(tmp_path / "yarn"), scaling)
    prompts = [list(range(5, 25)), [(7 * i) % 380 + 2 for i in range(90)]]
    expected = hf_greedy(path, prompts, 16)
    assert expected != hf_greedy(base, prompts, 16)
    if how == "config":
        llm = LLM(path, dtype="float32", enforce_eager=True)
    else:
        llm = LLM(base, dtype="float32", enforce_eager=True, hf_overrides={"rope_scaling": {"type": "yarn", **{
            k: v for k, v in scaling.items() if k != "rope_type"}}})  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16,
                                                                                  logprobs=0))  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == expected
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + list(out.outputs[0].token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        want = logits.gather(1, ids[0, len(prompt) :, None])[:, 0]
        got = torch.tensor([next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_hf_overrides_extend_the_context_and_are_checked(tiny_model_factory, capsys):
    """YaRN's context is the original one times the factor (here past max_position_embeddings: 1,024 > 512), as
    vLLM derives it; the flag takes a JSON object, a nested object merges into the sub-config it names."""
    from aserve.cli import build_parser, dashed, engine_args_from
    from aserve.engine.config import load_hf_config

    base = tiny_model_factory("qwen3")
    overrides = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}
    llm = LLM(base, dtype="float32", enforce_eager=True, hf_overrides=overrides)
    assert llm.engine.config.max_model_len == 1024
    theta = llm.engine.config.hf_config.rope_parameters["rope_theta"]
    assert theta == load_hf_config(base, None).rope_parameters["rope_theta"]  # kept beside the scaling
    with pytest.raises(ValueError, match="exceeds what the model supports"):
        LLM(base, dtype="float32", enforce_eager=True, max_model_len=1025, hf_overrides=overrides)
    ns = build_parser().parse_args(dashed(["serve", "--hf_overrides", json.dumps(overrides)]))
    assert engine_args_from(ns).hf_overrides == overrides
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--hf-overrides", "[1]"])
    assert "JSON object" in capsys.readouterr().err
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(base, hf_overrides="rope_scaling")
