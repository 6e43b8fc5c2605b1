"""Prompt logprobs (SamplingParams.prompt_logprobs) offline: equal to transformers' log_softmax of its own logits in
float32, chunked prefill equal to unchunked, no prefix-cache hits for requests that ask."""

import pytest
import torch

from aserve import LLM, SamplingParams

PROMPTS = [
    [0, 17, 45, 200, 33, 91, 120, 5, 250, 64, 77, 18, 300, 2, 99, 143, 61, 12, 8, 240, 180, 33],
    [0, 88, 14, 230, 57],
    [0, 300],
]


def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-distribution of token i + 1 given tokens 0..i."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_matches_reference(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i, entry in enumerate(prompt_logprobs[1:]):
        token = prompt[i + 1]
        assert abs(entry[token].logprob - ref[i, token].item()) < 1e-4
        assert entry[token].rank == int((ref[i] > ref[i, token]).sum()) + 1
        top = torch.topk(ref[i], k).indices.tolist()
        assert {t for t in entry if entry[t].rank <= k} == set(top)
        for t in top:
            assert abs(entry[t].logprob - ref[i, t].item()) < 1e-4
        assert len(entry) in (k, k + 1)


@pytest.fixture(scope="module")
def references(tiny_model):
    return [hf_prompt_logprobs(tiny_model, p) for p in PROMPTS]


def test_prompt_logprobs_equal_transformers(tiny_model, references):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, debug_invariants=True)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for out, prompt, ref in zip(outs, PROMPTS, references):
        assert_matches_reference(out.prompt_logprobs, prompt, ref, 3)
        assert len(out.outputs[0].token_ids) == 3
    # Without the parameter nothing is computed or reported.
    plain = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chunked_prefill_equals_unchunked(tiny_model, references):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    whole = LLM(tiny_model, dtype="float32", enforce_eager=True).generate(prompts, params)
    chunked_llm = LLM(tiny_model, dtype="float32", enforce_eager=True, max_num_batched_tokens=8, max_num_seqs=2)
    chunked = chunked_llm.generate(prompts, params)
    for a, b, prompt, ref in zip(whole, chunked, PROMPTS, references):
        assert_matches_reference(b.prompt_logprobs, prompt, ref, 2)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 and x[t].rank == y[t].rank for t in x)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_prefix_cache_hits_skipped_for_prompt_logprobs(tiny_model, references):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, enable_prefix_caching=True, block_size=4)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert first.num_cached_tokens == 0
    cached = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert cached.num_cached_tokens > 0  # the prefix cache works for this prompt...
    scored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    assert scored.num_cached_tokens == 0  # ...but not for a request scoring its prompt
    assert_matches_reference(scored.prompt_logprobs, PROMPTS[0], references[0], 1)


def test_prompt_logprobs_zero_gives_the_prompt_tokens_only(tiny_model, references):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        assert list(entry) == [PROMPTS[1][i + 1]]
        assert abs(entry[PROMPTS[1][i + 1]].logprob - references[1][i, PROMPTS[1][i + 1]].item()) < 1e-4


def test_n_samples_score_the_prompt_once(tiny_model, references):
    """With n > 1 the first sample alone scores the prompt; the request reports it once, equal to n = 1's."""
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=128)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=3)
    for prompt, out, ref in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params), references):
        assert len(out.outputs) == 3
        assert_matches_reference(out.prompt_logprobs, prompt, ref, 3)
    _, made = llm.engine._make_sequences("x", PROMPTS[0], params)  # the siblings' own parameters
    assert [s.sampling_params.prompt_logprobs for s in made] == [3, None, None]
