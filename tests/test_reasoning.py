"""--reasoning-parser: a chat reply's thinking apart from its answer, whole and streamed (any chunking), with
include_reasoning and with tool calls read from the content only; a structured-output grammar waiting for `</think>`."""

import json
import random
import re

import pytest
from test_server import MODEL, assert_idle, sse_events

from aserve.entrypoints.openai.reasoning import MARKERS, ReasoningOutput, reading, reasoning_output, split_reasoning


class _Choice:  # what ReasoningOutput reads of a ChoiceState
    def __init__(self) -> None:
        self.index, self.text, self.delta_text, self.finish_reason = 0, "", "", None


THINKING_OFF, CONSTRAINED = {"thinking": False}, {"constrained": True}
CASES = [  # (parser, reading's switches, reply) -> (reasoning, content)
    ("deepseek_r1", {}, "<think>\nhmm</think>\n\nParis.", ("\nhmm", "\n\nParis.")),
    ("deepseek_r1", {}, "hmm, well</think>Paris.", ("hmm, well", "Paris.")),
    ("deepseek_r1", {}, "still thinking", ("still thinking", "")),
    ("deepseek_r1", THINKING_OFF, "hmm</think>Paris.", ("hmm", "Paris.")),  # (deepseek_r1 has no switch)
    ("qwen3", {}, "<think>\nhmm</think>\n\nParis.", ("\nhmm", "\n\nParis.")),
    ("qwen3", {}, "ab</think>Hello", ("ab", "Hello")),  # <think> in the prompt (Qwen3-Thinking-2507)
    ("qwen3", {}, "  <think>cut short", ("cut short", "")),
    ("qwen3", THINKING_OFF, "Paris.", (None, "Paris.")),
    ("qwen3", THINKING_OFF, "<think>x</think>y", (None, "<think>x</think>y")),
    ("qwen3", CONSTRAINED, '{"a": 1}', (None, '{"a": 1}')),
    ("deepseek_r1", CONSTRAINED, "<thin", (None, "<thin")),
    ("deepseek_r1", CONSTRAINED, "<think>ab</think>{}", ("ab", "{}")),
    # Magistral's: reasoning only after a leading [THINK] (vLLM's rule)
    ("mistral", {}, "[THINK]hmm, well[/THINK]Paris.", ("hmm, well", "Paris.")),
    ("mistral", {}, "Paris, surely.", (None, "Paris, surely.")),
    ("mistral", {}, "[THINK]cut short", ("cut short", "")),
    ("mistral", CONSTRAINED, '{"a": 1}', (None, '{"a": 1}')),
]


@pytest.mark.parametrize("parser, switches, reply, expected", CASES)
def test_streamed_in_any_chunking_equals_whole(parser, switches, reply, expected):
    mode, markers = reading(parser, **switches), MARKERS[parser]
    assert split_reasoning(mode, reply, markers) == expected
    rng = random.Random(0)
    for _ in range(30):
        out, choice, got = ReasoningOutput(mode, markers=markers), _Choice(), {"reasoning_content": "", "content": ""}
        cuts = sorted(rng.sample(range(1, len(reply)), k=min(len(reply) - 1, rng.randint(0, 6))))
        for end in [*cuts, len(reply)]:
            choice.text, choice.finish_reason = reply[:end], "stop" if end == len(reply) else None
            body = {"delta": {}}
            out.delta(body, choice)
            for key in got:
                got[key] += body["delta"].get(key, "")
        assert (got["reasoning_content"] or None, got["content"]) == (expected[0] or None, expected[1])


@pytest.fixture(scope="module")
def llm_engine(tiny_model):
    from aserve import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=256,
                                served_model_name=MODEL))  # fmt: skip


async def client_for(llm_engine, **api):
    from test_server import make_client

    return await make_client(llm_engine, **api)


async def assert_streamed_the_same(client, body: dict, message: dict) -> None:
    events = await sse_events(await client.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)  # vLLM's newer name, the same
    assert message.get("reasoning") == message.get("reasoning_content")


async def thinking_off(client, body: dict) -> dict:
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    return (await (await client.post("/v1/chat/completions", json=off)).json())["choices"][0]["message"]


# The tiny model writes what the grammar lets it: a reply in a thinking model's shape
THINKING = "<think>[a-z]{2,6}</think>[a-z]{2,6}"


async def test_reasoning_content_over_http(llm_engine):
    client = await client_for(llm_engine, reasoning_parser="qwen3")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
                "structured_outputs": {"regex": THINKING}}  # fmt: skip
        whole = await (await client.post("/v1/chat/completions", json=body)).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"].isalpha() and message["content"].isalpha()
        await assert_streamed_the_same(client, body, message)
        plain = await thinking_off(client, body)
        assert "reasoning_content" not in plain and plain["content"].startswith("<think>")
        hidden = await (await client.post("/v1/chat/completions", json={**body, "include_reasoning": False})).json()
        assert "reasoning_content" not in hidden["choices"][0]["message"]
        assert hidden["choices"][0]["message"]["content"] == message["content"]
        assert_idle(llm_engine)
    finally:
        await client.close()


async def test_tool_calls_are_read_from_the_content(llm_engine):
    """A named tool call's arguments are the whole content; the reasoning before it stays reasoning."""
    client = await client_for(llm_engine, reasoning_parser="deepseek_r1")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}  # fmt: skip
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30, "temperature": 0,
                "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}  # fmt: skip
        whole = await (await client.post("/v1/chat/completions", json=body)).json()
        message = whole["choices"][0]["message"]
        # the grammar forces the arguments from the first token: no reasoning (deepseek_r1 would otherwise take a
        # reply without </think> for all reasoning), the call read from the content
        assert message["content"] is None and "reasoning_content" not in message
        call = message["tool_calls"][0]["function"]
        assert call["name"] == "f" and isinstance(json.loads(call["arguments"])["a"], int)
        events = await sse_events(await client.post("/v1/chat/completions", json={**body, "stream": True}))
        pieces = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "f"
        assert "".join(p["function"]["arguments"] for p in pieces) == call["arguments"]
        assert_idle(llm_engine)
    finally:
        await client.close()


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory):
    """The tiny model with `<think>` and `</think>` as tokens of its vocabulary (ids 384, 385), as Qwen3's are."""
    import torch
    from tiny_models import VOCAB_SIZE, build_tokenizer, make_config
    from transformers import AutoModelForCausalLM

    from aserve import EngineArgs, LLMEngine

    path = str(tmp_path_factory.mktemp("thinking"))
    config = make_config("gqa")
    config.vocab_size = VOCAB_SIZE + 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer = build_tokenizer(path)
    tokenizer.add_tokens([START := "<think>", "</think>"])
    tokenizer.save_pretrained(path)
    assert tokenizer.convert_tokens_to_ids([START, "</think>"]) == [VOCAB_SIZE, VOCAB_SIZE + 1]
    return LLMEngine(EngineArgs(model=path, dtype="float32", enforce_eager=True, max_model_len=256,
                                served_model_name=MODEL))  # fmt: skip


async def test_grammar_waits_for_the_end_of_the_reasoning(thinking_engine):
    """Where `</think>` is one token the grammar applies after it: the reasoning is free, the content follows the
    grammar (streamed the same); with thinking off the grammar applies from the start and the reply is content."""
    client = await client_for(thinking_engine, reasoning_parser="qwen3")
    try:
        # the random model reaches </think> sooner with a bias on it (which the grammar masks in the content)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 1,
                "seed": 4, "logit_bias": {"385": 6}, "structured_outputs": {"regex": "[a-z]{2,6}"}}  # fmt: skip
        whole = await (await client.post("/v1/chat/completions", json=body)).json()
        message = whole["choices"][0]["message"]
        assert whole["choices"][0]["finish_reason"] == "stop" and re.fullmatch("[a-z]{2,6}", message["content"])
        assert re.search("[^a-z]", message["reasoning_content"])  # written outside the grammar
        await assert_streamed_the_same(client, body, message)
        plain = await thinking_off(client, body)
        assert "reasoning_content" not in plain and re.fullmatch("[a-z]{2,6}", plain["content"])
        # without include_reasoning the grammar applies from the start, as in vLLM
        hidden = {**body, "include_reasoning": False}
        message = (await (await client.post("/v1/chat/completions", json=hidden)).json())["choices"][0]["message"]
        assert "reasoning" not in message and re.fullmatch("[a-z]{2,6}", message["content"])
        assert_idle(thinking_engine)
    finally:
        await client.close()


async def test_forced_tool_call_after_the_reasoning(thinking_engine):
    """A named tool call's grammar waits for `</think>` too: the call is read from the content after it."""
    client = await client_for(thinking_engine, reasoning_parser="deepseek_r1")
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60, "temperature": 1,
                "seed": 4, "logit_bias": {"385": 6}, "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "f"}}}  # fmt: skip
        message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"] is None
        call = message["tool_calls"][0]["function"]
        assert call["name"] == "f" and json.loads(call["arguments"])["a"] in range(10)
        assert_idle(thinking_engine)
    finally:
        await client.close()


async def test_mistral_reasoning_over_http(llm_engine):
    """--reasoning-parser mistral (Magistral's [THINK]...[/THINK]), whole and streamed the same."""
    client = await client_for(llm_engine, reasoning_parser="mistral")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
                "structured_outputs": {"regex": r"\[THINK\][a-z]{2,6}\[/THINK\][a-z]{2,6}"}}  # fmt: skip
        message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
        assert message["reasoning_content"].isalpha() and message["content"].isalpha()
        await assert_streamed_the_same(client, body, message)
        assert_idle(llm_engine)
    finally:
        await client.close()


def test_mistral_keeps_its_markers_in_the_text():
    """[THINK] and [/THINK] are special tokens of Mistral's tokenizers: decoded as usual they would be gone."""
    from aserve import SamplingParams
    from aserve.entrypoints.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    for parser, keeps in (("mistral", True), ("qwen3", False)):
        params = SamplingParams()
        reasoning_output(parser, params, req, None, None)
        assert params.skip_special_tokens is not keeps


async def _usage_of(client, body: dict) -> tuple[dict, list[dict], list[int]]:
    """(the whole reply's usage, the stream's usages (the continuous ones, then the final), its token ids)."""
    whole = await (await client.post("/v1/chat/completions", json={**body, "return_token_ids": True})).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = await sse_events(await client.post("/v1/chat/completions", json=stream))
    return whole["usage"], [e["usage"] for e in events if e.get("usage")], whole["choices"][0]["token_ids"]


async def test_reasoning_tokens_in_usage(thinking_engine):
    """usage.completion_tokens_details.reasoning_tokens, whole and in the stream's usage chunks: the tokens before
    `</think>` (one token here, as in Qwen3's vocabulary), as vLLM counts them; 0 with thinking off."""
    client = await client_for(thinking_engine, reasoning_parser="qwen3")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 1,
                "seed": 4, "logit_bias": {"385": 6}, "structured_outputs": {"regex": "[a-z]{2,6}"}}  # fmt: skip
        usage, streamed, token_ids = await _usage_of(client, body)
        assert 385 in token_ids and usage["completion_tokens_details"] == {"reasoning_tokens": token_ids.index(385)}
        assert streamed[-1]["completion_tokens_details"] == usage["completion_tokens_details"]
        counts = [u["completion_tokens_details"]["reasoning_tokens"] for u in streamed[:-1]]
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == token_ids.index(385)
        off, _, _ = await _usage_of(client, {**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert off["completion_tokens_details"] == {"reasoning_tokens": 0}
    finally:
        await client.close()


async def test_reasoning_tokens_where_the_markers_are_not_tokens(llm_engine):
    """The tiny tokenizer spells `</think>` in several tokens: the count is the reasoning's own tokens; without a
    reasoning parser usage has no completion_tokens_details (as vLLM)."""
    client = await client_for(llm_engine, reasoning_parser="deepseek_r1")
    plain = await client_for(llm_engine)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0,
                "structured_outputs": {"regex": "<think>abc</think>[a-z]{2,6}"}}  # fmt: skip
        usage, streamed, _ = await _usage_of(client, body)
        expected = len(llm_engine.tokenizer.encode("abc", add_special_tokens=False))
        assert usage["completion_tokens_details"] == {"reasoning_tokens": expected} == streamed[-1][
            "completion_tokens_details"]  # fmt: skip
        usage, streamed, _ = await _usage_of(plain, body)
        assert "completion_tokens_details" not in usage and "completion_tokens_details" not in streamed[-1]
    finally:
        await client.close()
        await plain.close()
