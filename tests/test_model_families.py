"""Model families' long-context features: sliding-window attention (Mistral, Gemma 2/3) served as transformers
applies it, with prefix-cache hits, chunked prefill and preemption, and logprobs as transformers'; a feature aserve
does not implement (LongRoPE's long factors) caps the context length where the model is still served exactly.
generation_config.json's end-of-sequence ids end sequences. (Greedy parity with transformers for every family in
every engine configuration is in tests/test_parity.py.)"""

import json
import os
import random
import shutil

import pytest
import torch
from tiny_models import EOS_ID, VOCAB_SIZE, hf_greedy

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


SLIDING = ["mistral_sliding", "gemma2", "gemma3"]


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB_SIZE) for _ in range(n)]


def test_sliding_windows_are_served_at_full_context_length(tiny_model_factory, tmp_path):
    """Sliding-window attention is served as transformers applies it, not capped: max_model_len is
    max_position_embeddings and each layer holds its window (Mistral: every layer; Gemma 2: every other one;
    Gemma 3: config.layer_types, with the sliding layers on the local rotary table). transformers' Llama has no
    sliding window: a Llama config's sliding_window is ignored."""
    expected = {"mistral_sliding": [12, 12], "gemma2": [8, None, 8, None], "gemma3": [20, 20, None, 20]}
    expected["llama"] = [None, None]
    paths = {v: tiny_model_factory(v) for v in SLIDING}
    paths["llama"] = edited_copy(tiny_model_factory("gqa"), str(tmp_path / "llama"), sliding_window=8)
    for variant, windows in expected.items():
        llm = LLM(paths[variant], dtype="float32", enforce_eager=True)
        layers = llm.engine.core.runner.model.layers
        assert llm.engine.config.max_model_len == 512
        assert [layer.self_attn.attn_params.sliding_window for layer in layers] == windows
        if variant == "gemma3":
            assert [layer.rotary_index for layer in layers] == [1, 1, 0, 1]


@pytest.mark.parametrize("variant", SLIDING)
def test_sliding_window_prefix_hits_chunks_and_preemption(tiny_model_factory, variant):
    """Three prompts sharing two blocks with one served before them (prefix-cache hits), a 16-token budget
    (chunked prefill) and KV blocks for fewer than all three (preemption): transformers' greedy tokens."""
    path = tiny_model_factory(variant)
    first = random_prompt(40, seed=1)
    batch = [first[:32] + random_prompt(9, seed=2 + i) for i in range(3)]
    expected = hf_greedy(path, [first, *batch], 20)
    llm = LLM(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=16, num_gpu_blocks_override=7,
              max_model_len=64, debug_invariants=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=20)
    got = [llm.generate({"prompt_token_ids": first}, params)[0].outputs[0].token_ids]
    got += [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
    assert got == expected
    core = llm.engine.core
    assert core.kv_manager.stats.hits >= 32 and core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("variant", SLIDING)
def test_sliding_window_logprobs_match_transformers(tiny_model_factory, variant):
    """Top-3 logprobs of 20 greedy tokens after a 40-token prompt (prefill in chunks of 16) within 1e-4 of
    transformers' log-softmax of its logits over the same sequence (Gemma 2: soft-capped)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(variant)
    prompt = random_prompt(40, seed=7)
    llm = LLM(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=16)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20, logprobs=3,
                                                                      ignore_eos=True))[0].outputs[0]  # fmt: skip
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1).topk(3)
    assert len(out.logprobs) == 20
    for token_id, lp, ids, values in zip(out.token_ids, out.logprobs, ref.indices.tolist(), ref.values.tolist()):
        assert ids[0] == token_id
        for rank, (tid, value) in enumerate(zip(ids, values), start=1):
            assert lp[tid].rank == rank and abs(lp[tid].logprob - value) < 1e-4


def test_generation_config_eos_ids_end_sequences(tiny_model_factory, tmp_path):
    """generation_config.json's eos_token_id list (Gemma 3's [<eos>, <end_of_turn>]): a sequence stops at any of
    them, as in transformers' generate, unless ignore_eos."""
    src = tiny_model_factory("gemma3")
    prompt = random_prompt(30, seed=3)
    stop_at = hf_greedy(src, [prompt], 8)[0][3]  # the 4th token transformers generates
    path = edited_copy(src, str(tmp_path / "gemma3_eos"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [EOS_ID, stop_at], "bos_token_id": 0}, f)
    expected = hf_greedy(path, [prompt], 8)[0]
    assert expected[-1] == stop_at and len(expected) <= 4
    llm = LLM(path, dtype="float32", enforce_eager=True)
    assert llm.engine.config.extra_eos_token_ids == (stop_at,)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == expected and out.finish_reason == "stop"
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
