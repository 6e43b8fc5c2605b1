"""Prompt scoring through the official openai client over HTTP, as lm-evaluation-harness `local-completions` sends
it (`echo: true, logprobs: 1, max_tokens: 0, temperature: 0`): the values equal a separate scoring of the same tokens
with transformers in float32; vLLM's `prompt_logprobs` on both endpoints; a small multiple-choice check."""

import json
import math
import urllib.request

import pytest
import torch
from aserve_server import running_server

openai = pytest.importorskip("openai")

MODEL = "tiny"
PROMPT = [0, 17, 45, 200, 33, 91, 120, 5, 250, 64, 77, 18, 300, 2, 99, 143, 61, 12, 8, 240]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-distribution of token i + 1 given tokens 0..i."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]


@pytest.fixture(scope="module", params=["whole", "chunked"])
def client(request, tiny_model):
    # chunked: prompts are prefilled 8 tokens per step
    chunk = ["--max-num-batched-tokens", "8", "--max-num-seqs", "2"] if request.param == "chunked" else []
    args = ["--model", tiny_model, "--dtype", "float32", "--served-model-name", MODEL, "--max-model-len", "512"]
    with running_server(*args, *chunk) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_echo_score_only_equals_transformers(client, hf_model):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = resp.choices[0]
    ref = hf_logprobs(hf_model, PROMPT)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(PROMPT) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i, (value, top) in enumerate(zip(lp.token_logprobs[1:], lp.top_logprobs[1:])):
        assert abs(value - ref[i, PROMPT[i + 1]].item()) < 1e-4
        # the most likely token, and the prompt's own wherever it ranks (up to logprobs + 1 entries, as vLLM)
        assert len(top) <= 2 and abs(max(top.values()) - ref[i].max().item()) < 1e-4 and lp.tokens[i + 1] in top
    assert "".join(lp.tokens) == choice.text  # the echoed prompt text, nothing generated
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(PROMPT))]
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(PROMPT)


def test_echo_with_generation_and_stream(client, hf_model):
    kw = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0]
    assert whole.text.endswith(plain.text) and len(whole.text) > len(plain.text)
    prompt_text = whole.text[: len(whole.text) - len(plain.text)]
    assert len(whole.logprobs.tokens) == len(PROMPT) + 4
    ref = hf_logprobs(hf_model, PROMPT)
    for i, value in enumerate(whole.logprobs.token_logprobs[1 : len(PROMPT)]):
        assert abs(value - ref[i, PROMPT[i + 1]].item()) < 1e-4
    chunks = list(client.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].text.startswith(prompt_text)  # the first chunk carries the prompt
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs


def test_max_tokens_zero_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert "echo" in str(e.value)


def test_prompt_logprobs_field_on_both_endpoints(client, hf_model):
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = resp.choices[0].model_extra["prompt_logprobs"]
    ref = hf_logprobs(hf_model, PROMPT)
    assert entries[0] is None and len(entries) == len(PROMPT)
    for i, entry in enumerate(entries[1:]):
        token = str(PROMPT[i + 1])
        assert abs(entry[token]["logprob"] - ref[i, PROMPT[i + 1]].item()) < 1e-4
        assert {t for t, v in entry.items() if v["rank"] <= 2} == {str(t) for t in ref[i].topk(2).indices.tolist()}
    messages = [{"role": "user", "content": "Hello world!"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    chat_entries = chat.model_extra["prompt_logprobs"]
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    tokenize = urllib.request.Request(f"{root}/tokenize", body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(tokenize) as r:
        ids = json.load(r)["tokens"]
    ref = hf_logprobs(hf_model, ids)
    assert chat_entries[0] is None and len(chat_entries) == len(ids)
    for i, entry in enumerate(chat_entries[1:]):
        assert list(entry) == [str(ids[i + 1])]
        assert abs(entry[str(ids[i + 1])]["logprob"] - ref[i, ids[i + 1]].item()) < 1e-4
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, stream=True, extra_body={"prompt_logprobs": 2}
    )
    reported = [c.choices[0].model_extra.get("prompt_logprobs") for c in stream]
    assert [r for r in reported if r is not None] == [entries]  # once, in a stream


def test_multiple_choice_picks_the_most_likely_continuation(client, hf_model):
    """lm-eval's log-likelihood scoring: sum the continuation's token logprobs of echo'd context + continuation."""
    items = [
        ([0, 17, 45, 200], [[33, 91], [120, 5], [250, 64], [77, 18]]),
        ([0, 88, 14], [[230, 57, 9], [12], [300, 2], [143, 61]]),
        ([0, 5, 6, 7, 8], [[9], [10], [11], [12]]),
    ]
    for context, continuations in items:
        scores, expected = [], []
        for cont in continuations:
            tokens = context + cont
            resp = client.completions.create(
                model=MODEL, prompt=tokens, echo=True, logprobs=1, max_tokens=0, temperature=0
            )
            scores.append(sum(resp.choices[0].logprobs.token_logprobs[len(context) :]))
            ref = hf_logprobs(hf_model, tokens)
            expected.append(sum(ref[len(context) - 1 + j, t].item() for j, t in enumerate(cont)))
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(scores, expected))
        assert scores.index(max(scores)) == expected.index(max(expected))


def test_lm_eval_batched_request_with_one_generated_token(client, hf_model):
    """lm-eval 0.4.13's `local-completions` loglikelihood request: a batch of token-id prompts, `echo: true,
    logprobs: 1, max_tokens: 1, seed`; it reads each choice (by index) as token_logprobs[ctxlen:-1] (the generated
    token last) and calls a continuation greedy when each of its logprobs is the top one."""
    context = [0, 17, 45, 200, 33]
    continuations = [[91, 120], [5], [250, 64, 77]]
    prompts = [context + cont for cont in continuations]
    resp = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0,
                                     seed=1234)  # fmt: skip
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert len(choices) == len(prompts)
    for tokens, cont, choice in zip(prompts, continuations, choices):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(tokens) + 1 and choice.finish_reason == "length"
        score = sum(lp.token_logprobs[len(context) : -1])
        greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[len(context) : -1],
                                                                lp.top_logprobs[len(context) : -1]))  # fmt: skip
        ref = hf_logprobs(hf_model, tokens)
        expected = sum(ref[len(context) - 1 + j, t].item() for j, t in enumerate(cont))
        assert math.isclose(score, expected, abs_tol=1e-4)
        assert greedy == all(ref[len(context) - 1 + j].argmax().item() == t for j, t in enumerate(cont))
