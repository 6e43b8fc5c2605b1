"""Beam search (vLLM's LLM.beam_search and the servers' use_beam_search): the same beams, scores and order as a beam
search written here over transformers' float32 logits; end-of-sequence beams complete, ignore_eos keeps them going,
length_penalty ranks, and bad parameters are refused."""

import math

import pytest
import torch

from aserve import LLM
from aserve.beam_search import BeamSearchParams
from aserve.sampling_params import ParamError


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=128)


def reference(path: str, prompt: list[int], width: int, max_tokens: int, eos: int, ignore_eos=False, penalty=1.0):
    """The search over transformers' logprobs: 2 x width candidates per beam, EOS completes, best width go on."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def score(tokens, cum):
        return cum / ((len(tokens) - (tokens[-1] == eos)) ** penalty)

    beams, completed = [(prompt, 0.0)], []
    with torch.no_grad():
        for _ in range(max_tokens):
            candidates = []
            for tokens, cum in beams:
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], dim=-1)
                top = torch.topk(logprobs, 2 * width)
                for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                    child = (tokens + [t], cum + lp)
                    (completed if t == eos and not ignore_eos else candidates).append(child)
            beams = sorted(candidates, key=lambda b: score(*b), reverse=True)[:width]
    return sorted(completed + beams, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.parametrize("width, max_tokens, ignore_eos, penalty", [(1, 5, False, 1.0), (3, 6, False, 1.0),
                                                                    (2, 6, True, 0.5)])  # fmt: skip
def test_beams_equal_a_search_over_transformers_logprobs(llm, tiny_model, width, max_tokens, ignore_eos, penalty):
    prompts = ["Hello world", {"prompt_token_ids": [5, 6, 7, 8]}]
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos, length_penalty=penalty)
    outputs = llm.beam_search(prompts, params)
    eos = llm.engine.config.eos_token_id
    for prompt, output in zip(prompts, outputs):
        ids = llm.engine.tokenize_prompt(prompt)[1]
        expected = reference(tiny_model, ids, width, max_tokens, eos, ignore_eos, penalty)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        for seq, (_, cum) in zip(output.sequences, expected):
            assert math.isclose(seq.cum_logprob, cum, abs_tol=1e-4)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)
            assert len(seq.logprobs) == len(seq.tokens) - len(ids)
            assert seq.finish_reason == ("stop" if seq.tokens[-1] == eos and not ignore_eos else "length")
    core = llm.engine.core
    assert not core.scheduler.has_unfinished() and core.kv_manager.pool.num_free_blocks == core.num_kv_blocks


def test_concurrency_limit_and_bad_parameters(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    prompts = ["a", "bb", "ccc"]
    one_at_a_time = llm.beam_search(prompts, params, concurrency_limit=1)
    for alone, together in zip(one_at_a_time, llm.beam_search(prompts, params)):
        assert [s.tokens for s in alone.sequences] == [s.tokens for s in together.sequences]
        assert all(math.isclose(a.cum_logprob, b.cum_logprob, abs_tol=1e-4)
                   for a, b in zip(alone.sequences, together.sequences))  # fmt: skip
    for bad in ({"beam_width": 0, "max_tokens": 3}, {"beam_width": 2, "max_tokens": 0},
                {"beam_width": 2, "max_tokens": 3, "temperature": -1.0}):  # fmt: skip
        with pytest.raises(ParamError):
            BeamSearchParams(**bad)
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search(prompts, params, lora_request=object())


async def test_use_beam_search_over_http(llm):
    """Both endpoints: the n choices are the offline search's n beams, best first, their text the generated tokens'
    (without the end-of-sequence token); a stream, logprobs or n above --max-logprobs / 2 are refused."""
    from test_server import assert_idle, make_client

    client = await make_client(llm.engine)
    try:
        offline = llm.beam_search(["Hello world"], BeamSearchParams(beam_width=3, max_tokens=6))[0].sequences
        prompt_len = len(llm.engine.tokenize_prompt("Hello world")[1])
        eos = llm.engine.config.eos_token_id
        expected = [s.tokens[prompt_len:] for s in offline]
        body = {"prompt": "Hello world", "n": 3, "max_tokens": 6, "temperature": 0, "use_beam_search": True,
                "return_token_ids": True}  # fmt: skip
        got = await (await client.post("/v1/completions", json=body)).json()
        assert [c["token_ids"] for c in got["choices"]] == expected
        for choice, tokens in zip(got["choices"], expected):
            text_ids = tokens[:-1] if tokens[-1] == eos else tokens
            assert choice["text"] == llm.get_tokenizer().decode(text_ids)
            assert choice["finish_reason"] == ("stop" if tokens[-1] == eos else "length")
        assert got["usage"]["completion_tokens"] == sum(map(len, expected))
        chat = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 4, "temperature": 0,
                "use_beam_search": True, "length_penalty": 0.5}  # fmt: skip
        reply = await (await client.post("/v1/chat/completions", json=chat)).json()
        assert [c["index"] for c in reply["choices"]] == [0, 1]
        long = {"prompt": [5] * 128, "max_tokens": None}  # fills the context: no room for a token
        for field, extra in (("stream", {"stream": True}), ("logprobs", {"logprobs": 2}), ("n", {"n": 11}),
                             ("length_penalty", {"length_penalty": 1e308}), ("max_tokens", {"max_tokens": 500}),
                             ("prompt", long), ("stop", {"stop": ["x"]}), ("seed", {"seed": 3}),
                             ("min_tokens", {"min_tokens": 2}), ("top_p", {"top_p": 0.5})):  # fmt: skip
            resp = await client.post("/v1/completions", json={**body, **extra})
            assert resp.status == 400 and (await resp.json())["error"]["param"] == field, extra
        several = {**body, "prompt": [[5, 6], [5] * 40], "max_tokens": 20, "ignore_eos": True, "length_penalty": 50}
        reply = await (await client.post("/v1/completions", json=several)).json()
        assert [c["index"] for c in reply["choices"]] == list(range(6))  # prompt index x n + beam
        assert_idle(llm.engine)
    finally:
        await client.close()


async def test_use_beam_search_cache_salt(llm):
    """A beam search's steps carry the request's cache_salt: they share prefix-cache blocks with the same tenant's
    earlier search and not with another tenant's."""
    from test_server import make_client, metric

    client = await make_client(llm.engine)
    body = {"prompt": list(range(10, 50)), "n": 2, "max_tokens": 3, "temperature": 0, "use_beam_search": True}

    async def hits_of(salt) -> float:
        before = metric(await (await client.get("/metrics")).text(), "aserve:prefix_cache_hits_total")
        resp = await client.post("/v1/completions", json={**body, **({} if salt is None else {"cache_salt": salt})})
        assert resp.status == 200
        return metric(await (await client.get("/metrics")).text(), "aserve:prefix_cache_hits_total") - before

    try:
        await hits_of(None)
        again = await hits_of(None)  # an earlier search of the same prompt: every step hits its blocks
        first = await hits_of("tenant-a")  # no earlier search of this tenant: its later steps hit its own blocks only
        assert first < again
        assert await hits_of("tenant-a") == again
        assert await hits_of("tenant-b") == first
    finally:
        await client.close()
