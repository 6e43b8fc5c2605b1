"""Prefix caching through the offline API: hits are reported and never change the output."""

import random

from aserve import LLM, SamplingParams


def test_shared_64_token_prefix_is_served_from_cache(tiny_model):
    rng = random.Random(0)
    prefix = [rng.randrange(2, 384) for _ in range(64)]
    first = {"prompt_token_ids": prefix + [rng.randrange(2, 384) for _ in range(7)]}
    second = {"prompt_token_ids": prefix + [rng.randrange(2, 384) for _ in range(11)]}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    cached = LLM(tiny_model, dtype="float32", enforce_eager=True, debug_invariants=True)
    out1 = cached.generate(first, params)[0]
    out2 = cached.generate(second, params)[0]
    assert out1.num_cached_tokens == 0
    assert out2.num_cached_tokens >= 48 and out2.num_cached_tokens % 16 == 0

    uncached = LLM(tiny_model, dtype="float32", enforce_eager=True, enable_prefix_caching=False)
    ref2 = uncached.generate(second, params)[0]
    assert ref2.num_cached_tokens == 0
    assert out2.outputs[0].token_ids == ref2.outputs[0].token_ids

    stats = cached.engine.core.kv_manager.stats
    assert stats.queries == len(first["prompt_token_ids"]) + len(second["prompt_token_ids"])
    assert stats.hits == out2.num_cached_tokens


def test_repeated_prompt_recomputes_only_the_last_token(tiny_model):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True)
    p = {"prompt_token_ids": list(range(2, 66))}  # exactly 4 blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = llm.generate(p, params)[0]
    b = llm.generate(p, params)[0]
    assert b.num_cached_tokens == 48  # the 4th block holds the last token, whose logits are needed
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_generated_tokens_are_cached_for_follow_ups(tiny_model):
    """A multi-turn follow-up (prompt + previous answer + more) hits blocks filled during decoding."""
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True)
    prompt = list(range(2, 22))
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    follow_up = prompt + out.outputs[0].token_ids + [5, 6, 7]
    again = llm.generate({"prompt_token_ids": follow_up}, SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens == 48  # 50 known tokens -> 3 full blocks, all filled by the first request
