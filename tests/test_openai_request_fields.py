"""Every request field of the OpenAI chat and completions APIs (the official `openai` package's CompletionCreateParams
TypedDicts) and of aserve's own request types, driven over HTTP with the official client against `aserve serve` with
the embedded default model: each is implemented (a request with it shows its effect), accepted without effect (one
of request_fields.IGNORED_FIELDS: the output equals the same request without it) or refused with a 400 naming it
(request_fields.REFUSED_FIELDS) -- never parsed and silently ignored. The README lists them all."""

import json
import os
import pathlib
import sys

import msgspec
import pytest
from aserve_server import running_server
from request_field_checks import CAPITAL, COUNT, IMPLEMENTED, OPENAI, call, ids, prompt_ids, refused, text

from aserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from aserve.entrypoints.openai.request_fields import IGNORED_FIELDS, REFUSED_FIELDS

openai = pytest.importorskip("openai")

FIELDS = {
    True: OPENAI[True] | set(ChatCompletionRequest.__struct_fields__),
    False: OPENAI[False] | set(CompletionRequest.__struct_fields__),
}
REFUSED_VALUES = {
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "One, two,"}, "verbosity": "low", "web_search_options": {},
    "moderation": {}, "suffix": " ten.", "priority": 1, "watermarking": True,
    "thinking_token_budget": 10, "logprob_token_ids": [1], "repetition_detection": {"max_pattern_size": 3},
    "kv_transfer_params": {"do_remote_prefill": True}, "ec_transfer_params": {"x": 1}, "vllm_xargs": {"a": 1},
    "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"a": 1},
    "prompt_embeds": "AAAA", "return_prompt_text": True, "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ",
}  # fmt: skip
IGNORED_VALUES = {
    "user": "u-1", "safety_identifier": "s-1", "store": True, "metadata": {"k": "v"}, "service_tier": "flex",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit"},
    "session_id": "s-1",
    "return_token_offsets": True, "return_mm_kwargs": False, "routed_experts_prompt_start": 3,
}  # fmt: skip


@pytest.fixture(scope="module")
def client():
    with running_server("--enable-prompt-tokens-details", "--trust-request-chat-template") as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def base(client):
    """Each endpoint's default request (chat: "One, two," then EOS; completions: 8 tokens), with its token ids."""
    return {chat: call(client, chat, return_token_ids=True) for chat in (True, False)}


def test_every_field_is_classified_once():
    """A field added to OpenAI's API (a newer openai package) or to aserve's request types must be decided here."""
    kinds = [set(IMPLEMENTED), set(IGNORED_FIELDS), set(REFUSED_FIELDS)]
    assert not (kinds[0] & kinds[1] or kinds[0] & kinds[2] or kinds[1] & kinds[2])
    unclassified = (FIELDS[True] | FIELDS[False]) - set().union(*kinds)
    assert not unclassified, f"request fields neither implemented, ignored nor refused: {sorted(unclassified)}"
    assert set(IGNORED_VALUES) == set(IGNORED_FIELDS) and set(REFUSED_VALUES) == set(REFUSED_FIELDS)


def test_the_readme_lists_every_field():
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    missing = sorted(f for f in FIELDS[True] | FIELDS[False] if f"`{f}`" not in readme)
    assert not missing, f"README.md does not name these request fields: {missing}"


def test_a_plain_chat_request_runs_no_feature_code():
    """The request type looks at tools, structured output and messages' tool_calls before calling into them: a plain
    request's checks, sampling parameters, conversation and template arguments run no code of tool calling or
    structured output (bench/request_path.py measures the whole path)."""
    features = tuple(os.path.join("openai", name) for name in ("tool_request.py", "tool_output.py",
                                                                 "structured_request.py"))  # fmt: skip
    entered = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith(features):
            entered.add(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")

    body = json.dumps({"messages": COUNT, "stream": True, "max_tokens": 8, "temperature": 0})
    req = msgspec.json.decode(body, type=ChatCompletionRequest)
    sys.setprofile(profile)
    try:
        req.check_limits()
        params = req.to_sampling_params(req.requested_max_tokens())
        req.conversation()
        req.template_kwargs()
    finally:
        sys.setprofile(None)
    assert not entered, sorted(entered)
    assert params.structured_outputs is None and params.max_tokens == 8


# Both endpoints parse the fields they share with the same code: the default run drives those through chat only
# (and parallel_tool_calls, slow here, through tests/test_tool_calling_server.py).
_SLOW = {(False, field) for field in FIELDS[True] & FIELDS[False]} | {(True, "parallel_tool_calls")}
CASES = [
    pytest.param(chat, field, id=f"{'chat' if chat else 'completions'}-{field}",
                 marks=[pytest.mark.slow] if (chat, field) in _SLOW else [])
    for chat in (True, False) for field in sorted(FIELDS[chat])
]  # fmt: skip


@pytest.mark.parametrize("chat,field", CASES)
def test_field(client, base, chat, field):
    if field in IGNORED_FIELDS:
        body = call(client, chat, **{field: IGNORED_VALUES[field]})
        assert text(body) == text(base[chat])
    elif field in REFUSED_FIELDS:
        refused(client, chat, field, **{field: REFUSED_VALUES[field]})
    else:
        IMPLEMENTED[field](client, chat, base)


# -- the fields' finer points, streamed and not --------------------------------------------------------------------


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client):
    for chat in (True, False):
        chunks = call(client, chat, n=2, stream=True, stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True})  # fmt: skip
        *per_choice, last = chunks
        prompt_tokens = last["usage"]["prompt_tokens"]
        counts = {0: 0, 1: 0}
        for chunk in per_choice:  # one choice per chunk; its usage counts that choice's tokens so far
            [choice] = chunk["choices"]
            counts[choice["index"]] = chunk["usage"]["completion_tokens"]
            assert chunk["usage"]["prompt_tokens"] == prompt_tokens
            assert chunk["usage"]["total_tokens"] == prompt_tokens + counts[choice["index"]]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(counts.values()) > 0
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    # vLLM's shape: continuous_usage_stats alone asks for usage too
    chunks = call(client, True, stream=True, stream_options={"continuous_usage_stats": True})
    assert all(c["usage"] is not None for c in chunks) and chunks[-1]["choices"] == []


def test_cached_tokens_count_the_prefix_cache_hits(client):
    long = "one, two, three, four, five, six, seven, eight, nine, ten. " * 4  # several 16-token KV blocks
    first = call(client, False, prompt=long, max_tokens=1)["usage"]
    chunks = call(client, False, prompt=long, max_tokens=1, stream=True, stream_options={"include_usage": True})
    again = chunks[-1]["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and first["prompt_tokens"] - 16 <= cached < first["prompt_tokens"]


def test_completions_top_logprobs_hold_the_sampled_token(client):
    for n in (0, 1, 3):
        body = call(client, False, temperature=1.5, seed=5, max_tokens=12, logprobs=n, return_token_ids=True)
        lp = body["choices"][0]["logprobs"]
        for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top[token] == value and len(top) <= n + 1
            assert n == 0 or max(top.values()) >= value
        # sampled hot, some tokens are not the most likely one: their top_logprobs have n + 1 entries
        assert n == 0 or any(len(top) == n + 1 for top in lp["top_logprobs"])
        assert all(len(top) == 1 for top in lp["top_logprobs"]) or n > 0


def test_chat_logprobs_in_openai_shape(client):
    body = call(client, True, temperature=1.5, seed=5, max_tokens=12, logprobs=True, top_logprobs=2)
    for entry in body["choices"][0]["logprobs"]["content"]:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
        top = entry["top_logprobs"]
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"] >= -9999.0
        assert entry["token"] in [t["token"] for t in top] or entry["logprob"] <= top[1]["logprob"]


def test_return_token_ids_streamed(client):
    for chat in (True, False):
        whole = call(client, chat, return_token_ids=True)
        chunks = call(client, chat, return_token_ids=True, stream=True)
        sent = [c.get("prompt_token_ids") if chat else c["choices"][0].get("prompt_token_ids") for c in chunks]
        assert [s for s in sent if s is not None] == [prompt_ids(whole)]  # once, first
        assert sent[0] is not None
        streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
        assert streamed == ids(whole)


def test_chat_echo_streamed(client):
    fields = dict(messages=CAPITAL, add_generation_prompt=False, continue_final_message=True, echo=True)
    whole = text(call(client, True, **fields))
    chunks = call(client, True, stream=True, **fields)
    assert chunks[1]["choices"][0]["delta"]["content"] == "The capital of France is"  # after the role chunk
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks) == whole


def test_truncated_completions_prompt_echoes_what_ran(client, base):
    body = call(client, False, truncate_prompt_tokens=2, echo=True, max_tokens=1, return_token_ids=True)
    kept = prompt_ids(base[False])[-2:]
    assert prompt_ids(body) == kept and body["usage"]["prompt_tokens"] == 2
    assert text(body).startswith(" three,")  # the last two tokens of "one, two, three,", not the whole prompt
