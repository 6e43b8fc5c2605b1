"""Request fields whose meaning follows vLLM's, over HTTP (aiohttp test server, tiny model): min_tokens against stop
strings, structured output and allowed_token_ids; max_tokens absent, null and past the context; chat content parts."""

import json

import pytest
from test_server import MODEL, assert_idle, make_client

from aserve import SamplingParams

PROMPT = [5, 9, 33, 2, 71, 14, 15, 16]


@pytest.fixture(scope="module")
def llm_engine(tiny_model):
    from aserve import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=64,
                                served_model_name=MODEL, debug_invariants=True))  # fmt: skip


@pytest.fixture
async def client(llm_engine):
    client = await make_client(llm_engine)
    yield client
    await client.close()


async def complete(client, status=200, **fields):
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0, **fields})
    body = await resp.json()
    assert resp.status == status, body
    return body


async def test_stop_strings_wait_for_min_tokens(client, llm_engine):
    base = await complete(client, max_tokens=12, ignore_eos=True, return_token_ids=True)
    ids = base["choices"][0]["token_ids"]
    text = llm_engine.tokenizer.decode(ids[:2])
    stop = text.strip()[-1]  # a character of the first two tokens' text
    early = await complete(client, max_tokens=12, ignore_eos=True, stop=[stop])
    assert early["usage"]["completion_tokens"] <= 2 and early["choices"][0]["finish_reason"] == "stop"
    late = await complete(client, max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=6, return_token_ids=True)
    assert late["usage"]["completion_tokens"] >= 6 and late["choices"][0]["token_ids"][:6] == ids[:6]
    assert_idle(llm_engine)


async def test_min_tokens_gives_way_to_a_finished_grammar(client, llm_engine):
    """The grammar allows only EOS once "yes" or "no" is out: min_tokens does not mask it (no 500, a valid output)."""
    for stream in (False, True):
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                          "min_tokens": 5, "guided_choice": ["yes", "no"],
                                                          "stream": stream})  # fmt: skip
        assert resp.status == 200
        text = await resp.text()
        assert "error" not in text
        if not stream:
            body = json.loads(text)
            assert body["choices"][0]["text"] in ("yes", "no") and body["choices"][0]["finish_reason"] == "stop"
    assert_idle(llm_engine)


async def test_a_grammar_outside_allowed_token_ids_is_the_clients_error(client, llm_engine):
    yes = llm_engine.tokenizer.encode("yes", add_special_tokens=False)
    others = [t for t in range(3, 40) if t not in yes][:4]
    body = await complete(client, 400, max_tokens=4, guided_choice=["yes"], allowed_token_ids=others)
    assert body["error"]["type"] == "invalid_request_error"
    assert "no token satisfies every constraint" in body["error"]["message"]
    assert (await complete(client, max_tokens=4))["choices"][0]["text"] is not None  # still serving
    assert_idle(llm_engine)


async def test_max_tokens_absent_null_and_past_the_context(client, llm_engine):
    assert (await complete(client, ignore_eos=True))["usage"]["completion_tokens"] == 16  # absent: 16
    body = await complete(client, ignore_eos=True, max_tokens=None)  # null: up to the context length (64)
    assert body["usage"]["completion_tokens"] == 64 - len(PROMPT)
    full = [7] * 64
    for fields in ({"max_tokens": None}, {}):  # a prompt that fills the context leaves nothing to generate
        body = await complete(client, 400, **{**fields, "prompt": full})
        assert body["error"]["code"] == "context_length_exceeded"
    resp = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi " * 80}]})  # fmt: skip
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "context_length_exceeded"
    assert_idle(llm_engine)


async def test_chat_text_parts_join_with_newlines(client):
    async def tokens(content):
        resp = await client.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
        return (await resp.json())["tokens"]

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert await tokens(parts) == await tokens("Hello\nworld") != await tokens("Helloworld")


async def test_tokenize_messages_takes_the_chat_template_arguments(client, llm_engine):
    async def tokenize(status=200, **fields):
        resp = await client.post("/tokenize", json=fields)
        body = await resp.json()
        assert resp.status == status, body
        return body

    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    closed = (await tokenize(messages=msgs, add_generation_prompt=False))["tokens"]
    body = await tokenize(messages=msgs, add_generation_prompt=False, continue_final_message=True,
                          return_token_strs=True)  # fmt: skip
    assert body["tokens"] != closed and closed[: len(body["tokens"])] == body["tokens"]  # the reply left open
    assert body["token_strs"] == llm_engine.tokenizer.convert_ids_to_tokens(body["tokens"])
    prompt = await tokenize(prompt="Hi there", return_token_strs=True, add_special_tokens=False)
    assert prompt["tokens"] == llm_engine.tokenizer.encode("Hi there", add_special_tokens=False)
    assert len(prompt["token_strs"]) == prompt["count"]
    for fields, param in (({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
                          ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                          ({"chat_template": "{{ 1 }}"}, "chat_template")):  # untrusted here  # fmt: skip
        assert (await tokenize(400, messages=msgs, **fields))["error"]["param"] == param


async def test_errors_name_the_chat_requests_own_fields(client):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    for fields, param in (({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens"),
                          ({"logprobs": True, "top_logprobs": -1}, "top_logprobs")):  # fmt: skip
        resp = await client.post("/v1/chat/completions", json={**base, **fields})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == param


async def test_logprobs_minus_one_lists_the_vocabulary_when_allowed(tiny_model):
    from aserve import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=64,
                                  served_model_name=MODEL, max_logprobs=-1))  # fmt: skip
    client = await make_client(engine)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
                "top_logprobs": -1}  # fmt: skip
        resp = await client.post("/v1/chat/completions", json=body)
        content = (await resp.json())["choices"][0]["logprobs"]["content"]
        assert len(content[0]["top_logprobs"]) == engine.config.vocab_size
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 1,
                                                          "logprobs": -1})  # fmt: skip
        top = (await resp.json())["choices"][0]["logprobs"]["top_logprobs"][0]  # keyed by text: tokens may share one
        texts = {engine.tokenizer.decode([t]) for t in range(engine.config.vocab_size)}
        assert len(top) > 20 and len(top) == len(texts)
    finally:
        await client.close()


PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for item in m['content'] %}[{{ item['text'] }}]{% endfor %}{% endif %}{% endfor %}"
)


async def test_templates_that_loop_over_content_get_the_parts(tiny_model):
    """vLLM's content-format detection: a template that loops over a message's content gets the text parts as a list
    (Gemma 3's does); others get them joined with newlines."""
    from aserve import LLM, EngineArgs, LLMEngine
    from aserve.entrypoints.chat_utils import takes_content_parts

    assert takes_content_parts(PARTS_TEMPLATE) and takes_content_parts("{%- for item in message.content -%}")
    assert not takes_content_parts("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    assert takes_content_parts({"default": "x", "tool_use": PARTS_TEMPLATE}) and not takes_content_parts(None)
    parts = [{"type": "text", "text": "Thanks"}, {"type": "text", "text": "again"}]
    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=64,
                                  served_model_name=MODEL))  # fmt: skip
    engine.config.tokenizer.chat_template = PARTS_TEMPLATE
    client = await make_client(engine)
    try:
        resp = await client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}],
                                                    "add_generation_prompt": False})  # fmt: skip
        expected = engine.tokenizer.encode("<user>[Thanks][again]", add_special_tokens=False)
        assert (await resp.json())["tokens"] == expected
    finally:
        await client.close()
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=64)
    params = SamplingParams(max_tokens=1)
    out = llm.chat(
        [{"role": "user", "content": parts}], params, chat_template=PARTS_TEMPLATE, add_generation_prompt=False
    )
    assert out[0].prompt == "<user>[Thanks][again]"
