"""Model families' long-context features: sliding-window attention (Mistral, Gemma 2/3) served as transformers
applies it, with prefix-cache hits, chunked prefill and preemption, and logprobs as transformers'; LongRoPE's long
factors where a sequence passes their switch length.
generation_config.json's end-of-sequence ids end sequences. (Greedy parity with transformers for every family in
every engine configuration is in tests/test_parity.py.)"""

import json
import os
import random
import shutil

import openai
import pytest
import torch
from aserve_server import running_server
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


def greedy_with_cache(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' model called step by step on its KV cache (generate() would recompute a
    Phi-3 sequence's cache when it passes LongRoPE's switch length; this keeps the keys as computed)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for pos in range(len(prompt), len(prompt) + max_new_tokens - 1):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[pos]]),
                        past_key_values=out.past_key_values, use_cache=True)  # fmt: skip
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_longrope_long_factors_match_transformers(tiny_model_factory, tmp_path):
    """Phi-3 with LongRoPE switching at 32 tokens: a 40-token prompt (the long factors throughout, transformers'
    generate), a 20-token one that grows past 32 (its tokens from position 32 on the long factors, the earlier keys
    kept: transformers' model stepped on its cache), and a 40-token prompt sharing its first block with a short
    prompt served before it (cached apart: no hit). The long factors change the tokens."""
    base = tiny_model_factory("phi3")
    path = edited_copy(base, str(tmp_path / "switch"), original_max_position_embeddings=32)
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    data.get("rope_parameters", {})["original_max_position_embeddings"] = 32
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f)
    long, short = random_prompt(40, seed=3), random_prompt(20, seed=4)
    first_block = short[:4] + long[4:16]
    shared = first_block + random_prompt(24, seed=5)
    expected = hf_greedy(path, [long], 24) + [greedy_with_cache(path, p, 24) for p in (short, first_block)]
    expected += hf_greedy(path, [shared], 24)
    assert [expected[0], expected[1]] != hf_greedy(base, [long, short], 24)  # the long factors change the tokens
    llm = LLM(path, dtype="float32", enforce_eager=True, debug_invariants=True)
    assert llm.engine.config.max_model_len == 256
    params = SamplingParams(temperature=0, max_tokens=24)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in (long, short)], params)]
    got += [llm.generate({"prompt_token_ids": first_block}, params)[0].outputs[0].token_ids]
    hits_before = llm.engine.core.kv_manager.stats.hits
    got += [llm.generate({"prompt_token_ids": shared}, params)[0].outputs[0].token_ids]
    assert got == expected
    assert llm.engine.core.kv_manager.stats.hits == hits_before  # a short prompt's blocks are not a long one's


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
    {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
     "original_max_position_embeddings": 32, "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [1.5, 2.0, 2.5, 3.0]},
])  # fmt: skip
def test_partial_rotary_matches_transformers(tiny_model_factory, tmp_path, rope):
    """Phi-4-mini's partial rotary (the first 3/4 of each head turned; with LongRoPE, half, under its attention
    factor): prompts within and past LongRoPE's 32-token switch, greedy, as transformers'; other families refuse a
    partial rotary by name."""
    base = tiny_model_factory("phi3")
    path = edited_copy(base, str(tmp_path / "partial"), rope_parameters=rope, original_max_position_embeddings=32)
    prompts = [random_prompt(5, seed=6), random_prompt(45, seed=7)]
    expected = hf_greedy(path, prompts, 12)
    assert expected != hf_greedy(base, prompts, 12)
    llm = LLM(path, dtype="float32", enforce_eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected
    llama = edited_copy(tiny_model_factory("gqa"), str(tmp_path / "llama"), partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported for LlamaForCausalLM"):
        LLM(llama, dtype="float32", enforce_eager=True)


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
    # Requests give back the blocks behind their window (Mistral: every layer's; Gemma: the sliding groups' blocks,
    # of one layer each for Gemma 3's three sliding layers to one full, two for Gemma 2's): about half the blocks the
    # three requests would hold make them preempt each other
    blocks = {"mistral_sliding": 4, "gemma2": 7, "gemma3": 20}[variant]
    llm = LLM(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=16, num_gpu_blocks_override=blocks,
              max_model_len=64, debug_invariants=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=20)
    got = [llm.generate({"prompt_token_ids": first}, params)[0].outputs[0].token_ids]
    got += [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
    assert got == expected
    core = llm.engine.core
    assert core.kv_manager.stats.hits >= 32 and core.scheduler.num_preemptions > 0


def test_all_sliding_models_give_back_the_blocks_behind_the_window(tiny_model_factory):
    """Mistral (every layer slides by 12, blocks of 16): two requests of 40 prompt tokens and 60 generated each hold
    at most three blocks at any step (the window, the block being written, one being filled), not the seven their
    length needs; tokens as transformers'; every block back at the end. (Gemma's sliding layers beside full ones:
    tests/test_hybrid_kv_cache.py.)"""
    path = tiny_model_factory("mistral_sliding")
    prompts = [random_prompt(40, seed=11), random_prompt(40, seed=12)]
    expected = hf_greedy(path, prompts, 60)
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=128, debug_invariants=True)
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=60)
    kv = engine.core.kv_manager
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    held, got = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = out.outputs[0].token_ids
        held += [sum(b is not kv.pool.null_block for b in blocks) for blocks in kv.req_to_blocks.values()]
    assert [got[str(i)] for i in range(2)] == expected and min(map(len, expected)) > 30
    assert max(held) <= 3 and kv.pool.num_free_blocks == engine.core.num_kv_blocks


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


@pytest.mark.parametrize(
    "variant",
    ["gemma3", *(pytest.param(v, marks=pytest.mark.slow) for v in ("gemma2", "phi3", "mixtral", "qwen3_moe"))],
)
def test_families_over_http_match_transformers(tiny_model_factory, variant):
    """`aserve serve --model DIR` on each newer family (float32), driven by the official openai client: a batch of
    token-id prompts, greedy, gives transformers' tokens (return_token_ids)."""
    path = tiny_model_factory(variant)
    prompts = [random_prompt(n, seed=20 + n) for n in (5, 23, 41)]
    expected = hf_greedy(path, prompts, 12)
    with running_server(
        "--model", path, "--dtype", "float32", "--max-model-len", "256", "--served-model-name", variant
    ) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        resp = client.completions.create(model=variant, prompt=prompts, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True})  # fmt: skip
    got = [c.model_dump()["token_ids"] for c in sorted(resp.choices, key=lambda c: c.index)]
    assert got == expected
