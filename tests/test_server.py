"""The OpenAI-compatible app, driven over HTTP (aiohttp test server) with a tiny model."""

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from aserve import EngineArgs, LLMEngine
from aserve.engine.async_engine import AsyncEngine
from aserve.entrypoints.openai.server import SERVER_OPTIONS, build_app

MODEL = "tiny"


@pytest.fixture(scope="module")
def llm_engine(tiny_model):
    return LLMEngine(
        EngineArgs(
            model=tiny_model,
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            served_model_name=MODEL,
            debug_invariants=True,
        )
    )


async def make_client(llm_engine, api_key=None, **api):
    app = build_app(AsyncEngine(llm_engine), MODEL, api_key, **api)
    client = TestClient(TestServer(app, **SERVER_OPTIONS))
    await client.start_server()
    return client


@pytest.fixture
async def client(llm_engine):
    client = await make_client(llm_engine)
    yield client
    await client.close()


def assert_idle(llm_engine):
    assert not llm_engine.output_processor.states and not llm_engine.core.scheduler.has_unfinished()
    assert llm_engine.core.kv_manager.pool.num_free_blocks == llm_engine.core.num_kv_blocks


async def sse_events(resp):
    """Parses an SSE body into JSON events (and the final [DONE] marker)."""
    text = await resp.text()
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


async def test_completion_and_usage(client, llm_engine):
    resp = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 7, "temperature": 0, "ignore_eos": True},
    )
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["text"]
    prompt_tokens = len(llm_engine.tokenizer.encode("Hello"))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 7, "total_tokens": prompt_tokens + 7}
    assert_idle(llm_engine)


async def test_streamed_completion_equals_non_streamed(client, llm_engine):
    req = {"prompt": "The cache", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = await (await client.post("/v1/completions", json=req)).json()
    resp = await client.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(resp)
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == whole["choices"][0]["text"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    assert [c["finish_reason"] for e in events[:-1] for c in e["choices"]][-1] == "length"
    assert_idle(llm_engine)


async def test_prompt_forms_and_n(client, llm_engine):
    ids = llm_engine.tokenizer.encode("blocks")
    resp = await client.post(
        "/v1/completions",
        json={"prompt": ["one", ids], "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 5, "ignore_eos": True},
    )
    body = await resp.json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == len(llm_engine.tokenizer.encode("one")) + len(ids)


async def test_chat_completion_stream_shapes(client, llm_engine):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}]
    req = {"model": MODEL, "messages": msgs, "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = await (await client.post("/v1/chat/completions", json=req)).json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    prompt_ids = llm_engine.tokenizer.encode("user: Hi\n there\nassistant:", add_special_tokens=False)  # parts: "\n"
    assert whole["usage"]["prompt_tokens"] == len(prompt_ids)
    events = await sse_events(await client.post("/v1/chat/completions", json={**req, "stream": True}))
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_stop_and_logprobs(client, llm_engine):
    base = {"prompt": "Prefix caching", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    full = (await (await client.post("/v1/completions", json=base)).json())["choices"][0]["text"]
    stop = full[8:10]
    cut = (await (await client.post("/v1/completions", json={**base, "stop": stop})).json())["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    lp = await (await client.post("/v1/completions", json={**base, "max_tokens": 4, "logprobs": 2})).json()
    logprobs = lp["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 4 and len(logprobs["token_logprobs"]) == 4
    assert all(len(t) == 2 for t in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    chat = await (
        await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 3,
                "logprobs": True,
                "top_logprobs": 3,
                "temperature": 0,
            },
        )
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 3 and c["logprob"] <= 0 for c in content)
    assert content[0]["top_logprobs"][0]["logprob"] >= content[0]["top_logprobs"][1]["logprob"]


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", {"prompt": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * 300}, 400, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 100.5}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a("}, 400, "guided_regex"),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"json": {"type": "strin"}}},
            400,
            "structured_outputs",
        ),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            400,
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            400,
            "tool_choice",  # "auto" (the default with tools) needs --enable-auto-tool-choice
        ),
        ("/v1/nope", {}, 404, None),
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),  # unrecognised
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "regex": "a"}, 400, "regex"),
        ("/tokenize", {"prompt": "x", "unknown": True}, 400, "unknown"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
            400,
            "chat_template",
        ),  # without --trust-request-chat-template
        ("/v1/completions", {"prompt": "x", "priority": 2}, 400, "priority"),
        ("/v1/completions", {"prompt": "x", "bad_words": ["w"] * 257}, 400, "bad_words"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)],
            },
            400,
            "tools",
        ),
        ("/v1/completions", {"prompt": "x", "bad_words": ["w" * 257]}, 400, "bad_words"),
        (  # a tool call's arguments nested past the JSON parser's depth
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 1100 + "]" * 1100}}],
                    },
                ]
            },
            400,
            "messages",
        ),
    ],
)
async def test_bad_requests_get_openai_errors_and_server_keeps_serving(client, llm_engine, path, body, status, param):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    resp = await client.post(path, **kwargs)
    assert resp.status == status
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = await client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert ok.status == 200
    assert_idle(llm_engine)


async def test_logit_bias_and_accepted_no_op_fields(client, llm_engine):
    """logit_bias (token ids as string keys) reaches the sampler: +100 forces a token; fields aserve accepts only
    where they change nothing (response_format text, tools with tool_choice none, best_of = n) give the plain
    output."""
    base = {"prompt": "Bias", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = (await (await client.post("/v1/completions", json=base)).json())["choices"][0]["text"]
    token = llm_engine.tokenizer.encode("z", add_special_tokens=False)[0]
    forced = await (await client.post("/v1/completions", json={**base, "logit_bias": {str(token): 100}})).json()
    assert forced["choices"][0]["text"] == llm_engine.tokenizer.decode([token] * 4) != plain
    same = {**base, "best_of": 1}
    assert (await (await client.post("/v1/completions", json=same)).json())["choices"][0]["text"] == plain
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    reference = (await (await client.post("/v1/chat/completions", json=chat)).json())["choices"][0]["message"]
    extras = {"response_format": {"type": "text"}, "tool_choice": "none",
              "tools": [{"type": "function", "function": {"name": "f"}}]}  # fmt: skip
    resp = await client.post("/v1/chat/completions", json={**chat, **extras})
    assert resp.status == 200 and (await resp.json())["choices"][0]["message"] == reference
    assert_idle(llm_engine)


async def test_wrong_method_and_models(client):
    resp = await client.get("/v1/completions")
    assert resp.status == 405 and "error" in await resp.json()
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 256
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ping")).status == 200 and (await client.post("/ping")).status == 200


async def test_api_key(llm_engine):
    client = await make_client(llm_engine, api_key="sekrit")
    try:
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        resp = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer sekrit"}
        )
        assert resp.status == 200
        assert (await client.get("/health")).status == 200  # health is not behind the key
    finally:
        await client.close()


async def test_constraints_that_leave_no_token_are_the_clients_error(client, llm_engine):
    """A grammar whose language is empty or never ends, or allowed_token_ids that bad_words empty: a 400 naming
    the conflict (the sampled token would lie outside the constraints), and the server goes on."""
    letter = llm_engine.tokenizer.convert_tokens_to_ids("q")
    for extra in ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, {"guided_grammar": "root ::= root"},
                  {"allowed_token_ids": [letter], "bad_words": ["q"]}):  # fmt: skip
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **extra})
        assert resp.status == 400, (extra, await resp.text())
        assert "no token satisfies every constraint" in (await resp.json())["error"]["message"]
    assert_idle(llm_engine)


async def test_compressed_bodies_are_refused(client, llm_engine):
    """A compressed body's size says nothing of what it inflates to: refused, valid or not, and the server goes on."""
    import gzip

    import aiohttp

    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    for encoding, data in (("gzip", gzip.compress(body)), ("x-custom", body)):
        resp = await client.post("/v1/completions", data=data, headers={
            "Content-Encoding": encoding, "Content-Type": "application/json"})  # fmt: skip
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "unsupported_content_encoding"
    try:  # one that does not inflate: aiohttp's parser answers 400 (or drops the connection) before the app
        resp = await client.post("/v1/completions", data=b"not deflate", headers={"Content-Encoding": "deflate",
                                                                                   "Connection": "close"})  # fmt: skip
        assert resp.status == 400
    except aiohttp.ServerDisconnectedError:
        pass
    assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status == 200
    assert_idle(llm_engine)


async def test_request_id_and_x_request_id(client, llm_engine):
    """The response's id after its prefix: an X-Request-Id header, else the request_id field; two requests may carry
    the same one at once (the engine's own ids stay unique)."""
    body = {"prompt": "x", "max_tokens": 2, "request_id": "mine"}
    assert (await (await client.post("/v1/completions", json=body)).json())["id"] == "cmpl-mine"
    both = [client.post("/v1/completions", json=body, headers={"X-Request-Id": "hdr"}) for _ in range(2)]
    assert [(await r.json())["id"] for r in await asyncio.gather(*both)] == ["cmpl-hdr"] * 2
    for bad in ("a\nX-Evil: 1", "", "x" * 257, "with space", "\u00e9"):  # ids go into headers and log lines
        resp = await client.post("/v1/completions", json={**body, "request_id": bad, "stream": True})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "request_id"
    resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 300})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "X-Request-Id"
    assert_idle(llm_engine)


async def test_add_special_tokens(tmp_path, tiny_model):
    """With a tokenizer that adds BOS: completions' prompts get it unless add_special_tokens is false; chat's only
    with add_special_tokens true (the template places the rest), as in vLLM."""
    import shutil

    from tokenizers import processors
    from transformers import AutoTokenizer

    path = tmp_path / "bos"
    shutil.copytree(tiny_model, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tokenizer.bos_token_id)])  # fmt: skip
    tokenizer.save_pretrained(path)
    bos = tokenizer.bos_token_id
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", enforce_eager=True, max_model_len=128,
                                  served_model_name=MODEL))  # fmt: skip
    client = await make_client(engine)
    try:
        base = {"max_tokens": 1, "return_token_ids": True}
        for extra, first in (({}, bos), ({"add_special_tokens": False}, None), ({"add_special_tokens": True}, bos)):
            body = await (await client.post("/v1/completions", json={"prompt": "Hi", **base, **extra})).json()
            ids = body["choices"][0]["prompt_token_ids"]
            assert (ids[0] == bos) == (first is not None) and ids[-1] != bos
            chat = {"messages": [{"role": "user", "content": "Hi"}], **base, **extra}
            ids = (await (await client.post("/v1/chat/completions", json=chat)).json())["prompt_token_ids"]
            assert (ids[0] == bos) == (extra.get("add_special_tokens") is True)
    finally:
        await client.close()


async def test_tokenize_detokenize(client, llm_engine):
    tok = await (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert tok["tokens"] == llm_engine.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    detok = await (await client.post("/detokenize", json={"tokens": tok["tokens"]})).json()
    assert detok["prompt"] == "Hello world"
    chat = await (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
    assert chat["tokens"] == llm_engine.tokenizer.encode("user: Hi\nassistant:", add_special_tokens=False)
    bad = await client.post("/detokenize", json={"tokens": [-1]})
    assert bad.status == 400


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def test_disconnect_mid_stream_aborts_and_frees_kv(client, llm_engine):
    resp = await client.post(
        "/v1/completions", json={"prompt": "x" * 50, "max_tokens": 200, "stream": True, "ignore_eos": True}
    )
    await resp.content.readuntil(b"\n\n")  # first event
    text = await (await client.get("/metrics")).text()
    assert metric(text, "aserve:num_requests_running") == 1
    assert metric(text, "aserve:kv_cache_usage_perc") > 0
    resp.close()  # the client goes away
    for _ in range(200):
        text = await (await client.get("/metrics")).text()
        if metric(text, "aserve:num_requests_running") == 0:
            break
        await asyncio.sleep(0.01)
    assert metric(text, "aserve:num_requests_running") == 0
    assert metric(text, "aserve:kv_cache_usage_perc") == 0
    assert metric(text, 'aserve:request_success_total{finished_reason="abort",model_name="tiny"}') >= 1
    assert_idle(llm_engine)


async def test_metrics_names(client):
    await client.post("/v1/completions", json={"prompt": "metrics please", "max_tokens": 3, "ignore_eos": True})
    text = await (await client.get("/metrics")).text()
    for name in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "iteration_tokens_total_count",
        "request_prompt_tokens_count",
        "request_generation_tokens_count",
        "request_params_max_tokens_count",
        "request_inference_time_seconds_count",
        "request_prefill_time_seconds_count",
        "request_decode_time_seconds_count",
    ]:
        assert f"aserve:{name}{{" in text, name
    assert metric(text, "aserve:request_generation_tokens_sum") >= 3  # the completion's 3 (ignore_eos)
    assert metric(text, "aserve:request_params_max_tokens_count") >= 1
    assert 'model_name="tiny"' in text
    assert "_created" not in text  # no creation-time series beside counters and histograms (vLLM turns them off)
    assert metric(text, "aserve:generation_tokens_total") >= 3
    assert metric(text, "aserve:time_to_first_token_seconds_count") >= 1


def test_version_flag(capsys):
    from aserve import __version__
    from aserve.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == __version__  # the number alone, as vLLM


async def test_tokenizer_info_endpoint(llm_engine):
    """--enable-tokenizer-info-endpoint: GET /tokenizer_info gives what a client tokenising through /tokenize needs
    (lm-evaluation-harness' tokenizer_backend=remote reads eos_token and encodes it there); 404 without the flag."""
    plain = await make_client(llm_engine)
    try:
        assert (await plain.get("/tokenizer_info")).status == 404
    finally:
        await plain.close()
    client = await make_client(llm_engine, enable_tokenizer_info_endpoint=True)
    try:
        resp = await client.get("/tokenizer_info")
        info = await resp.json()
        tokenizer = llm_engine.config.tokenizer
        assert resp.status == 200 and info["eos_token"] == tokenizer.eos_token and info["model_max_length"] == 256
        assert info["tokenizer_class"] == type(tokenizer).__name__ and "chat_template" in info
        resp = await client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
        assert (await resp.json())["tokens"] == [tokenizer.eos_token_id]
    finally:
        await client.close()


@pytest.mark.parametrize("body, param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"stream": True, "stream_options": {"include_usage": True, "frobnicate": 1}}, "stream_options"),
    ({"response_format": {"type": "json_object", "frobnicate": 1}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "frobnicate": 1}}},
     "response_format.json_schema"),
])  # fmt: skip
async def test_unknown_fields_are_refused_at_any_depth(client, llm_engine, body, param):
    """A field aserve does not know is a 400 naming it (OpenAI's answer at the top level), inside the request's
    objects too: never parsed and ignored."""
    resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2, **body})  # fmt: skip
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param and "frobnicate" in error["message"]
    assert (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status == 200
    assert_idle(llm_engine)
