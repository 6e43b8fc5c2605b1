"""Long-context features of a model family that aserve does not implement (sliding-window attention, LongRoPE's
long factors) cap the context length where the model is still served exactly: the default max_model_len stops
there and a longer one is refused, naming why. (Greedy parity with transformers for every family is in
tests/test_parity.py.)"""

import json
import os
import shutil

import pytest

from aserve import LLM, SamplingParams


def edited_copy(src: str, dst: str, **config) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        data = json.load(f)
    data.update(config)
    with open(path, "w") as f:
        json.dump(data, f)
    return dst


@pytest.mark.parametrize(
    "variant, config, limit",
    [
        ("gqa", {"sliding_window": 32}, 32),  # Mistral-style sliding-window attention
        ("phi3", {"original_max_position_embeddings": 64}, 64),  # LongRoPE's long factors
    ],
)
def test_unimplemented_long_context_features_cap_the_context_length(
    tiny_model_factory, tmp_path, variant, config, limit
):
    path = edited_copy(tiny_model_factory(variant), str(tmp_path / variant), **config)
    with pytest.raises(ValueError, match=f"exceeds what the model supports \\({limit}"):
        LLM(path, dtype="float32", enforce_eager=True, max_model_len=limit + 1)
    llm = LLM(path, dtype="float32", enforce_eager=True)
    assert llm.engine.config.max_model_len == limit
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
