"""Request bodies: the schemas /openapi.json describes them with, and fuzzing (hypothesis) of completions, chat,
tokenize and detokenize bodies against a live server: every body gets a served answer or a clear 4xx OpenAI error,
never a 5xx, and the server keeps serving the same answers with nothing leaked."""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
import reliability_common
from reliability_common import MODEL, assert_openai_error, make_llm_engine, parse_sse, prompt_ids
from test_server import assert_idle

from aserve.engine.async_engine import AsyncEngine
from aserve.entrypoints.openai.server import build_app

llm_engine, client = reliability_common.llm_engine, reliability_common.client  # fixtures, found by their names


async def test_openapi_describes_the_request_bodies(client):
    spec = await (await client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.")
    schemas = spec["components"]["schemas"]
    for path, name in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]:  # fmt: skip
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"} and name in schemas
        assert "429" in spec["paths"][path]["post"]["responses"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert schemas["CompletionRequest"]["properties"]["n"]["maximum"] == 128
    jsonschema = pytest.importorskip("jsonschema")
    defs = json.loads(json.dumps(schemas).replace("#/components/schemas/", "#/$defs/"))  # a standalone 2020-12 schema

    def validate(body, name):
        jsonschema.validate(body, {"$defs": defs, "$ref": f"#/$defs/{name}"})

    validate({"prompt": "hi", "max_tokens": 3, "stop": ["\n"]}, "CompletionRequest")
    validate({"messages": [{"role": "user", "content": "hi"}], "stream": True}, "ChatCompletionRequest")
    with pytest.raises(jsonschema.ValidationError):
        validate({"prompt": "hi", "n": 129}, "CompletionRequest")
    with pytest.raises(jsonschema.ValidationError):
        validate({"max_tokens": 3}, "CompletionRequest")


@pytest.fixture(scope="module")
def live_server(tiny_model):
    """The app on a real port, its event loop in a thread: hypothesis drives it with plain blocking HTTP."""
    from aiohttp import web
    from aserve_server import free_port

    llm_engine = make_llm_engine(tiny_model)
    port, loop, started, runners = free_port(), asyncio.new_event_loop(), threading.Event(), []

    async def start():
        runner = web.AppRunner(build_app(AsyncEngine(llm_engine), MODEL), handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="fuzz-server", daemon=True)
    thread.start()
    assert started.wait(60)
    yield f"http://127.0.0.1:{port}", llm_engine
    asyncio.run_coroutine_threadsafe(runners[0].cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


def send(url: str, path: str, body) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN/Infinity: invalid JSON on purpose
    req = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def request_cases():
    """(path, body): completions, chat, tokenize and detokenize bodies, each field plausible or absent, then either
    left valid, given one bad value (an edge value or arbitrary JSON: wrong types, huge numbers, unicode), or every
    field drawn from anything; plus raw bytes and non-object JSON."""
    from hypothesis import strategies as st

    absent = st.just(None).map(lambda _: _ABSENT)
    scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
               | st.sampled_from(["\ud800", "\u0000", "日本語", "🦊" * 5]))  # fmt: skip
    junk = st.recursive(
        scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6
    )

    def field(plausible, *edges):
        """(a valid value or nothing, a bad value)."""
        return plausible | absent, (st.sampled_from(edges) | junk) if edges else junk

    def body(fields):
        good = st.fixed_dictionaries({k: g for k, (g, _) in fields.items()})

        def one_bad(d):
            return st.sampled_from(list(fields)).flatmap(lambda k: fields[k][1].map(lambda v: {**d, k: v}))

        anything = st.fixed_dictionaries({k: g | b for k, (g, b) in fields.items()})
        return st.one_of(good, good.flatmap(one_bad), anything).map(
            lambda d: {k: v for k, v in d.items() if v is not _ABSENT}
        )

    token_ids = st.lists(st.integers(2, 383), min_size=1, max_size=12)
    bad_ids = [[], [-1], [10**30], [True, 1], [384]]
    common = {
        "model": field(st.just(MODEL), "gpt-4", ""),
        "max_tokens": field(st.integers(1, 6), -1, 0, 250, 256, 10**6, 2**63, 2**70, 2.5, "3"),
        "temperature": field(st.floats(0, 2), -1.0, 1e308, 1e-300, "hot", float("nan"), float("inf")),
        "top_p": field(st.floats(0.01, 1), 0.0, -0.1, 1.5),
        "top_k": field(st.integers(-1, 500), -2, 10**30),
        "min_p": field(st.floats(0, 1), -1.0, 2.0),
        "n": field(st.integers(1, 3), 0, -1, 128, 129, 2**63),
        "stop": field(
            st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
            "",
            [""],
            ["a"] * 65,
            "x" * 300,
        ),
        "seed": field(st.integers(0, 2**32), 2**63 - 1, -(2**63), 2**64, -(2**64)),
        "presence_penalty": field(st.floats(-2, 2), 3.0),
        "frequency_penalty": field(st.floats(-2, 2), -3.0),
        "repetition_penalty": field(st.floats(0.5, 2), 0.0, -1.0, 1e300),
        "min_tokens": field(st.integers(0, 2), -1, 10**9),
        "ignore_eos": field(st.booleans()),
        "stop_token_ids": field(st.lists(st.integers(0, 383), max_size=4), list(range(65)), [10**20], [-1]),
        "stream": field(st.booleans()),
        "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "skip_special_tokens": field(st.booleans()),
        "include_stop_str_in_output": field(st.booleans()),
        "cache_salt": field(st.text(max_size=8)),
        "user": field(st.text(max_size=8)),
        "logit_bias": field(
            st.dictionaries(st.integers(0, 383).map(str), st.floats(-100, 100), max_size=3),
            {"x": 1},
            {"5": 101},
            {"999999": 1},
            {"-1": 1},
            [1],
        ),
        "response_format": field(st.just({"type": "text"}), {"type": "json_object"}, "text"),
        "best_of": field(st.just(1), 2, -1),
    }
    prompt = field(st.text(min_size=1, max_size=40) | token_ids | st.lists(st.text(min_size=1, max_size=10)
                   | token_ids, min_size=1, max_size=3), "", "x" * 3000, [[]], *bad_ids)  # fmt: skip
    completion = {**common, "prompt": prompt, "logprobs": field(st.integers(0, 20), -1, 21, 10**9),
                  "echo": field(st.just(False), True), "suffix": field(st.none(), "s")}  # fmt: skip
    content = st.text(max_size=30) | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2)  # fmt: skip
    message = body({"role": field(st.sampled_from(["user", "system", "assistant"]), 5, None, ""),
                    "content": field(content, {"type": "image"}, [{"type": "image_url"}])})  # fmt: skip
    messages = field(st.lists(message, min_size=1, max_size=3), [], "hi", [{}])
    chat = {
        **common,
        "messages": messages,
        "max_completion_tokens": field(st.integers(1, 6), 0, 10**6),
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(0, 20), 21, -1),
        "add_generation_prompt": field(st.booleans()),
        "chat_template_kwargs": field(st.just({}), {"tokenize": True}, {"continue_final_message": True}),
    }
    tokenize = {"prompt": field(st.text(max_size=40), 5), "messages": messages,
                "add_special_tokens": field(st.booleans())}  # fmt: skip
    detokenize = {"tokens": field(token_ids, *bad_ids)}
    return st.one_of(
        st.tuples(st.just("/v1/completions"), body(completion)),
        st.tuples(st.just("/v1/chat/completions"), body(chat)),
        st.tuples(st.just("/tokenize"), body(tokenize)),
        st.tuples(st.just("/detokenize"), body(detokenize)),
        st.tuples(
            st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]), st.binary(max_size=40) | junk
        ),
    )


_ABSENT = object()


def fuzz(url: str, llm_engine, num_cases: int, derandomize: bool) -> None:
    from hypothesis import HealthCheck, given, settings

    statuses = []
    normal = {"prompt": prompt_ids(0), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, text = send(url, "/v1/completions", normal)
    assert status == 200
    expected = json.loads(text)["choices"][0]["text"]

    @settings(max_examples=num_cases, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=request_cases())
    def check(case):
        path, body = case
        status, text = send(url, path, body)
        statuses.append(status)
        assert status < 500, (status, text[:500])
        if status >= 400:
            assert_openai_error(json.loads(text))
        elif isinstance(body, dict) and body.get("stream") is True and path.startswith("/v1"):
            events = parse_sse(text)
            assert events[-1] == "[DONE]"
            assert not any("error" in e for e in events[:-1]), events[-2]

    check()
    assert len(statuses) >= num_cases
    assert {s // 100 for s in statuses} >= {2, 4}  # both valid and invalid requests were exercised
    # The step loop is alive and right: a normal request gets the same text as before the fuzzing, nothing leaked.
    status, text = send(url, "/v1/completions", normal)
    assert status == 200 and json.loads(text)["choices"][0]["text"] == expected
    assert_idle(llm_engine)


def test_fuzz_request_bodies(live_server):
    url, llm_engine = live_server
    fuzz(url, llm_engine, num_cases=150, derandomize=True)


@pytest.mark.slow
def test_fuzz_request_bodies_1000(live_server):
    url, llm_engine = live_server
    fuzz(url, llm_engine, num_cases=1000, derandomize=False)
