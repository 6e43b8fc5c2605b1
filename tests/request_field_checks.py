"""The request-field checks tests/test_openai_request_fields.py runs over HTTP: one request through the official
`openai` client (`call`), and for each implemented field a check that a request with it shows its effect
(IMPLEMENTED: field -> check(client, chat, base responses))."""

import json
import re

import jsonschema
import msgspec
import pytest

from aserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

openai = pytest.importorskip("openai")
from openai.types import completion_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
COUNT = [{"role": "user", "content": "Count from one to ten: one, two,"}]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]  # fmt: skip
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip

# OpenAI's request fields (`stream` is in the streaming / non-streaming subclasses), and aserve's
OPENAI = {
    True: set(chat_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"},
    False: set(completion_create_params.CompletionCreateParamsBase.__annotations__) | {"stream"},
}


def call(client, chat: bool, **fields):
    """One request: the endpoint's defaults (greedy, 8 tokens, COUNT / "one, two, three,") with `fields` over them;
    OpenAI's fields as the client's arguments, aserve's in extra_body -> the response as a dict (a stream: its chunks
    as dicts)."""
    fields = {"model": MODEL, "max_tokens": 8, "temperature": 0,
              **({"messages": COUNT} if chat else {"prompt": "one, two, three,"}), **fields}  # fmt: skip
    known = {k: v for k, v in fields.items() if k in OPENAI[chat]}
    extra = {k: v for k, v in fields.items() if k not in OPENAI[chat]}
    api = client.chat.completions if chat else client.completions
    resp = api.create(**known, extra_body=extra or None)
    return [chunk.model_dump() for chunk in resp] if fields.get("stream") else resp.model_dump()


def text(body: dict, i: int = 0) -> str:
    choice = body["choices"][i]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def refused(client, chat: bool, field: str, **fields) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call(client, chat, **fields)
    assert e.value.body["param"] == field, e.value.body


def differs(client, chat: bool, field: str, value, **fields) -> None:
    assert text(call(client, chat, **fields, **{field: value})) != text(call(client, chat, **fields))


def ids(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def prompt_ids(body: dict) -> list[int]:
    return body["prompt_token_ids"] if "prompt_token_ids" in body else body["choices"][0]["prompt_token_ids"]


# -- what each implemented field does, as a check (client, chat, base response) ----------------------------------


def _model(client, chat, base):
    assert call(client, chat, model=MODEL)["model"] == MODEL
    with pytest.raises(openai.NotFoundError):
        call(client, chat, model="gpt-4o")


def _max_tokens(field):
    def check(client, chat, base):
        body = call(client, chat, **{field: 3})
        assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"

    return check


def _sampled(**fields):
    """A sampling field that makes a hot, seeded request greedy: the output equals the greedy one."""

    def check(client, chat, base):
        assert text(call(client, chat, temperature=2.0, seed=1, **fields)) == text(base[chat])

    return check


def _temperature(client, chat, base):
    outputs = {text(call(client, chat, temperature=1.5, seed=s)) for s in range(3)}
    assert outputs - {text(base[chat])}


def _seed(client, chat, base):
    a, b = (text(call(client, chat, temperature=1.5, seed=7)) for _ in range(2))
    assert a == b != text(call(client, chat, temperature=1.5, seed=8))


def _stop(client, chat, base):
    body = call(client, chat, stop=",")
    assert text(body) == text(base[chat]).split(",")[0] and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["stop_reason"] == ","


def _include_stop_str(client, chat, base):
    assert text(call(client, chat, stop=",", include_stop_str_in_output=True)) == text(base[chat]).split(",")[0] + ","


def _stop_token_ids(client, chat, base):
    comma = ids(base[chat])[1]
    body = call(client, chat, stop_token_ids=[comma])
    assert body["usage"]["completion_tokens"] == 2 and body["choices"][0]["stop_reason"] == comma


def _penalty(field, chat_value, completion_value):
    def check(client, chat, base):  # on a longer output, which repeats itself
        differs(client, chat, field, chat_value if chat else completion_value, max_tokens=16, ignore_eos=True)

    return check


def _logit_bias(client, chat, base):
    first = ids(base[chat])[0]
    assert ids(call(client, chat, logit_bias={str(first): -100}, return_token_ids=True))[0] != first


def _logprobs(client, chat, base):
    if chat:
        body = call(client, chat, logprobs=True)
        content = body["choices"][0]["logprobs"]["content"]  # one entry per token, the end-of-turn one included
        assert len(content) == body["usage"]["completion_tokens"] and all(not c["top_logprobs"] for c in content)
        assert "".join(c["token"] for c in content).startswith(text(base[chat]))
    else:
        lp = call(client, chat, logprobs=2)["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == text(base[chat]) and all(len(top) == 2 for top in lp["top_logprobs"])


def _top_logprobs(client, chat, base):
    content = call(client, chat, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    for entry in content:  # greedy: the sampled token is the most likely one
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token"] == entry["token"]


def _n(client, chat, base):
    assert sorted(c["index"] for c in call(client, chat, n=2)["choices"]) == [0, 1]


def _best_of(client, chat, base):
    assert len(call(client, chat, n=2, best_of=2)["choices"]) == 2
    refused(client, chat, "best_of", best_of=2)


def _stream(client, chat, base):
    chunks = call(client, chat, stream=True)
    pieces = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks]
    assert "".join(p or "" for p in pieces) == text(base[chat])


def _stream_options(client, chat, base):
    chunks = call(client, chat, stream=True, stream_options={"include_usage": True})
    assert (
        chunks[-1]["choices"] == []
        and chunks[-1]["usage"]["completion_tokens"] == base[chat]["usage"]["completion_tokens"]
    )
    refused(client, chat, "stream_options", stream_options={"include_usage": True})


def _structured(field, value, valid):
    def check(client, chat, base):
        assert valid(text(call(client, chat, max_tokens=12, **{field: value})))

    return check


def _echo(client, chat, base):
    if chat:  # vLLM's: the reply continues the last (assistant) message, which comes first
        body = call(client, chat, messages=CAPITAL, add_generation_prompt=False, continue_final_message=True,
                    echo=True)  # fmt: skip
        assert text(body).startswith("The capital of France is") and "Paris" in text(body)
    else:
        assert text(call(client, chat, echo=True)) == "one, two, three," + text(base[chat])


def _tools(client, chat, base):
    refused(client, chat, "tool_choice", tools=[TIME_TOOL])  # "auto" needs --enable-auto-tool-choice
    body = call(client, chat, tools=[TIME_TOOL], tool_choice="none")
    assert body["choices"][0]["message"]["tool_calls"] is None and text(body) == text(base[chat])


def _tool_choice(client, chat, base):
    body = call(client, chat, tools=[TIME_TOOL], tool_choice={"type": "function", "function": {"name": "get_time"}},
                max_tokens=30)  # fmt: skip
    [tool_call] = body["choices"][0]["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(tool_call["function"]["arguments"]), TIME_TOOL["function"]["parameters"])


def _parallel_tool_calls(client, chat, base):
    body = call(client, chat, tools=[TIME_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    assert len(body["choices"][0]["message"]["tool_calls"]) == 1


def _ignore_eos(client, chat, base):
    assert call(client, chat, ignore_eos=True)["usage"]["completion_tokens"] == 8  # the default request stops at 5


def _min_tokens(client, chat, base):
    assert call(client, chat, min_tokens=7)["usage"]["completion_tokens"] >= 7


def _bad_words(client, chat, base):
    word = text(base[chat]).split()[0]  # the default reply's first word, never written with it banned
    banned = text(call(client, chat, bad_words=[word]))
    assert banned != text(base[chat]) and word not in banned.split()
    refused(client, chat, "bad_words", bad_words=[""])


def _skip_special_tokens(client, chat, base):
    special = prompt_ids(base[True])[0]  # <|im_start|>
    assert text(call(client, chat, allowed_token_ids=[special], max_tokens=2)) == ""
    kept = text(call(client, chat, allowed_token_ids=[special], max_tokens=2, skip_special_tokens=False))
    assert kept == "<|im_start|>" * 2


def _spaces_between_special_tokens(client, chat, base):
    """Byte-level BPE (SmolLM2's) puts no space between added tokens either way (the WordPiece case, where the flag
    changes the text: test_offline_vllm_compat.py)."""
    special = prompt_ids(base[True])[0]
    fields = {"allowed_token_ids": [special], "max_tokens": 2, "skip_special_tokens": False}
    assert text(call(client, chat, spaces_between_special_tokens=False, **fields)) == "<|im_start|>" * 2
    body = {"model": MODEL, "spaces_between_special_tokens": False, **({"messages": COUNT} if chat else {"prompt": ""})}
    request = msgspec.convert(body, ChatCompletionRequest if chat else CompletionRequest)
    assert request.to_sampling_params(8).spaces_between_special_tokens is False


def _cache_salt(client, chat, base):
    long = {} if chat else {"prompt": "one, two, three, " * 8}  # more than two KV blocks of prompt
    for _ in range(2):
        cached = call(client, chat, max_tokens=1, **long)["usage"]["prompt_tokens_details"]["cached_tokens"]
    salted = call(client, chat, max_tokens=1, cache_salt=f"tenant-b-{chat}", **long)
    assert cached >= 32 and salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _prompt_logprobs(client, chat, base):
    body = call(client, chat, prompt_logprobs=0)
    entries = body["prompt_logprobs"] if chat else body["choices"][0]["prompt_logprobs"]
    assert len(entries) == body["usage"]["prompt_tokens"] and entries[0] is None


def _allowed_token_ids(client, chat, base):
    allowed = set(ids(base[chat])[:2])
    assert set(ids(call(client, chat, allowed_token_ids=sorted(allowed), return_token_ids=True))) <= allowed


def _truncate_prompt_tokens(client, chat, base):
    body = call(client, chat, truncate_prompt_tokens=4, return_token_ids=True)
    assert prompt_ids(body) == prompt_ids(base[chat])[-4:] and body["usage"]["prompt_tokens"] == 4
    refused(client, chat, "truncate_prompt_tokens", truncate_prompt_tokens=10**6)


def _return_token_ids(client, chat, base):
    body = base[chat]
    assert len(prompt_ids(body)) == body["usage"]["prompt_tokens"]
    assert len(ids(body)) == body["usage"]["completion_tokens"]


def _prompt(client, chat, base):
    assert text(call(client, chat, prompt=prompt_ids(base[chat]))) == text(base[chat])


def _messages(client, chat, base):
    assert "Paris" in text(call(client, chat, messages=CAPITAL[:1], max_tokens=16))


def _add_generation_prompt(client, chat, base):
    body = call(client, chat, add_generation_prompt=False, max_tokens=1)
    assert body["usage"]["prompt_tokens"] < base[chat]["usage"]["prompt_tokens"]


def _continue_final_message(client, chat, base):
    body = call(client, chat, messages=CAPITAL, add_generation_prompt=False, continue_final_message=True)
    assert text(body).lstrip().startswith("Paris")
    refused(client, chat, "continue_final_message", messages=CAPITAL, continue_final_message=True)


def _chat_template_kwargs(client, chat, base):
    assert text(call(client, chat, chat_template_kwargs={"unused_by_the_template": 1})) == text(base[chat])
    refused(client, chat, "chat_template_kwargs", chat_template_kwargs={"add_generation_prompt": False})


def _include_reasoning(client, chat, base):  # no --reasoning-parser here: nothing to drop (test_reasoning.py)
    assert text(call(client, chat, include_reasoning=False)) == text(base[chat])


def _reasoning_effort(client, chat, base):  # the default model's template has no reasoning switch
    assert text(call(client, chat, reasoning_effort="low")) == text(base[chat])
    refused(client, chat, "reasoning_effort", reasoning_effort="extreme")


def _add_special_tokens(client, chat, base):  # the default model's tokenizer adds none (test_server.py: one that does)
    body = call(client, chat, add_special_tokens=not chat, return_token_ids=True)
    assert prompt_ids(body) == prompt_ids(base[chat]) and text(body) == text(base[chat])


def _truncation_side(client, chat, base):
    body = call(client, chat, truncate_prompt_tokens=4, truncation_side="right", return_token_ids=True)
    assert prompt_ids(body) == prompt_ids(base[chat])[:4]
    refused(client, chat, "truncation_side", truncation_side="middle")


def _request_id(client, chat, base):
    assert call(client, chat, request_id="job-7")["id"] == ("chatcmpl-job-7" if chat else "cmpl-job-7")


def _return_tokens_as_token_ids(client, chat, base):
    fields = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    body = call(client, chat, return_tokens_as_token_ids=True, return_token_ids=True, **fields)
    lp = body["choices"][0]["logprobs"]
    tokens = [entry["token"] for entry in lp["content"]] if chat else lp["tokens"]
    assert tokens == [f"token_id:{t}" for t in ids(body)]
    tops = [[t["token"] for t in e["top_logprobs"]] for e in lp["content"]] if chat else lp["top_logprobs"]
    assert all(all(re.fullmatch(r"token_id:\d+", t) for t in top) for top in tops)


def _stream_interval(client, chat, base):
    chunks = call(client, chat, stream=True, stream_interval=3, max_tokens=10, ignore_eos=True, return_token_ids=True)
    counts = [len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"] and c["choices"][0].get("token_ids")]
    assert counts[0] == 1 and all(n >= 3 for n in counts[1:-1]) and sum(counts) == 10 and len(counts) < 10
    pieces = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in chunks]
    whole = text(call(client, chat, max_tokens=10, ignore_eos=True))
    assert "".join(p or "" for p in pieces) == whole
    refused(client, chat, "stream_interval", stream=True, stream_interval=0)


def _use_beam_search(client, chat, base):  # (test_beam_search.py: the beams equal the offline search's)
    body = call(client, chat, use_beam_search=True, n=2, max_tokens=8)
    assert [c["index"] for c in body["choices"]] == [0, 1] and text(body, 0) != text(body, 1)
    assert {c["finish_reason"] for c in body["choices"]} <= {"stop", "length"}
    refused(client, chat, "stream", use_beam_search=True, n=2, stream=True)


def _length_penalty(client, chat, base):  # a strong one ranks the longer beams first
    differs(client, chat, "length_penalty", 10.0, use_beam_search=True, n=2, max_tokens=8)


LAST_MESSAGE_TEMPLATE = "{{ messages[-1]['content'] }}"
DOCUMENTS_TEMPLATE = "{% for d in documents %}{{ d['text'] }} {% endfor %}" + LAST_MESSAGE_TEMPLATE


def _chat_template(client, chat, base):  # (the server runs with --trust-request-chat-template)
    body = call(client, chat, chat_template=LAST_MESSAGE_TEMPLATE, return_token_ids=True)
    tokenized = client.post("/../tokenize", cast_to=object, body={"prompt": COUNT[-1]["content"]})
    assert prompt_ids(body) == tokenized["tokens"]


def _documents(client, chat, base):
    body = call(client, chat, chat_template=DOCUMENTS_TEMPLATE, documents=[{"title": "t", "text": "Numbers:"}],
                return_token_ids=True)  # fmt: skip
    tokenized = client.post("/../tokenize", cast_to=object, body={"prompt": "Numbers: " + COUNT[-1]["content"]})
    assert prompt_ids(body) == tokenized["tokens"]


_JSON_ENUM = {"type": "string", "enum": ["yes", "no"]}
IMPLEMENTED = {
    "model": _model, "messages": _messages, "prompt": _prompt,
    "max_tokens": _max_tokens("max_tokens"), "max_completion_tokens": _max_tokens("max_completion_tokens"),
    "temperature": _temperature, "top_p": _sampled(top_p=1e-6), "top_k": _sampled(top_k=1),
    "min_p": _sampled(min_p=1.0), "seed": _seed, "n": _n, "best_of": _best_of,
    "stop": _stop, "include_stop_str_in_output": _include_stop_str, "stop_token_ids": _stop_token_ids,
    "presence_penalty": _penalty("presence_penalty", -2.0, 2.0),
    "frequency_penalty": _penalty("frequency_penalty", -2.0, 2.0),
    "repetition_penalty": _penalty("repetition_penalty", 2.0, 2.0), "logit_bias": _logit_bias,
    "logprobs": _logprobs, "top_logprobs": _top_logprobs, "prompt_logprobs": _prompt_logprobs,
    "stream": _stream, "stream_options": _stream_options, "echo": _echo,
    "response_format": _structured("response_format", {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": _JSON_ENUM}}, lambda t: json.loads(t) in ("yes", "no")),
    "structured_outputs": _structured("structured_outputs", {"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    "guided_json": _structured("guided_json", _JSON_ENUM, lambda t: json.loads(t) in ("yes", "no")),
    "guided_regex": _structured("guided_regex", "[ab]{3}", lambda t: re.fullmatch("[ab]{3}", t) is not None),
    "guided_choice": _structured("guided_choice", ["maybe"], lambda t: t == "maybe"),
    "guided_grammar": _structured("guided_grammar", 'root ::= "hi" | "ho"', lambda t: t in ("hi", "ho")),
    "tools": _tools, "tool_choice": _tool_choice, "parallel_tool_calls": _parallel_tool_calls,
    "ignore_eos": _ignore_eos, "min_tokens": _min_tokens, "skip_special_tokens": _skip_special_tokens,
    "spaces_between_special_tokens": _spaces_between_special_tokens,
    "bad_words": _bad_words,
    "cache_salt": _cache_salt, "allowed_token_ids": _allowed_token_ids,
    "truncate_prompt_tokens": _truncate_prompt_tokens, "return_token_ids": _return_token_ids,
    "add_generation_prompt": _add_generation_prompt, "continue_final_message": _continue_final_message,
    "chat_template_kwargs": _chat_template_kwargs, "reasoning_effort": _reasoning_effort,
    "include_reasoning": _include_reasoning, "add_special_tokens": _add_special_tokens,
    "truncation_side": _truncation_side, "request_id": _request_id,
    "return_tokens_as_token_ids": _return_tokens_as_token_ids, "chat_template": _chat_template,
    "documents": _documents, "stream_interval": _stream_interval, "use_beam_search": _use_beam_search,
    "length_penalty": _length_penalty,
}  # fmt: skip
