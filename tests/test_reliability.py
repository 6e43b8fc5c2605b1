"""Reliability (issue 8): overload (429), graceful shutdown (SIGTERM), request limits, fault isolation.

In-process tests drive the aiohttp app over HTTP (aiohttp's test server) with a tiny model; the shutdown tests run
`aserve serve` as a subprocess and signal it, as an orchestrator would.
"""

import asyncio
import importlib.util
import json
import pathlib
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
from aserve_server import start_server, stop_server
from test_server import assert_idle, make_client, metric

from aserve import EngineArgs, LLMEngine
from aserve.cli import build_parser, engine_args_from
from aserve.engine.async_engine import AsyncEngine
from aserve.engine.detokenizer import IncrementalDetokenizer
from aserve.engine.llm_engine import INLINE_CHARS
from aserve.entrypoints.openai import responses as streaming_module
from aserve.entrypoints.openai.server import MAX_BODY_BYTES, build_app

MODEL = "tiny"


def make_llm_engine(tiny_model, **overrides) -> LLMEngine:
    args = dict(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, served_model_name=MODEL,
                debug_invariants=True)  # fmt: skip
    return LLMEngine(EngineArgs(**{**args, **overrides}))


@pytest.fixture(scope="module")
def llm_engine(tiny_model):
    return make_llm_engine(tiny_model)


@pytest.fixture
async def client(llm_engine):
    client = await make_client(llm_engine)
    yield client
    await client.close()


def assert_openai_error(body: dict, param=None) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def parse_sse(text: str) -> list:
    """data: lines -> JSON events, with the final "[DONE]" kept as a string."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), text[:500]
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def stream_text(events: list) -> str:
    return "".join(c.get("text", "") for e in events if isinstance(e, dict) for c in e.get("choices", []))


def prompt_ids(i: int, n: int = 12) -> list[int]:
    return [(7 * i + 3 * j) % 300 + 2 for j in range(n)]


async def reference_texts(client, prompts, max_tokens: int) -> list[str]:
    """Greedy outputs, one request at a time: what each prompt must produce under any load."""
    texts = []
    for p in prompts:
        body = await (
            await client.post(
                "/v1/completions", json={"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            )
        ).json()
        texts.append(body["choices"][0]["text"])
    return texts


# -- 1. overload -------------------------------------------------------------------------------------------------


def test_max_queue_len_and_shutdown_timeout_flags():
    ns = build_parser().parse_args(["serve", "--max-queue-len", "3", "--shutdown-timeout", "2.5"])
    assert engine_args_from(ns).max_queue_len == 3 and ns.shutdown_timeout == 2.5
    ns = build_parser().parse_args(["serve"])
    assert engine_args_from(ns).max_queue_len is None and ns.shutdown_timeout == 30
    with pytest.raises(ValueError, match="max_queue_len"):
        EngineArgs(max_queue_len=0).validate()


async def test_overload_gets_429_and_admitted_requests_complete(tiny_model):
    llm_engine = make_llm_engine(tiny_model, max_num_seqs=1, max_queue_len=1)
    client = await make_client(llm_engine)
    try:
        prompts = [prompt_ids(i) for i in range(10)]
        expected = await reference_texts(client, prompts, max_tokens=24)

        async def one(i):
            if i % 3 == 2:  # chat requests are admitted (or refused) by the same queue
                req = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4, "stream": True}
                resp = await client.post("/v1/chat/completions", json=req)
            else:
                req = {"prompt": prompts[i], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
                resp = await client.post("/v1/completions", json=req)
            return i, resp.status, resp.headers.get("Retry-After"), await resp.text()

        async def poll_health():
            statuses = []
            for _ in range(5):
                statuses.append((await asyncio.wait_for(client.get("/health"), 10)).status)
                await asyncio.sleep(0.01)
            return statuses

        flood = asyncio.gather(*(one(i) for i in range(10)), poll_health())
        *results, health = await asyncio.wait_for(flood, 120)
        assert health == [200] * 5  # /health does not queue behind the engine
        admitted = [r for r in results if r[1] == 200]
        refused = [r for r in results if r[1] == 429]
        assert admitted and refused and len(admitted) + len(refused) == len(results)
        for _, _, retry_after, text in refused:
            assert retry_after is not None and int(retry_after) >= 1
            error = assert_openai_error(json.loads(text))
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        for i, _, _, text in admitted:
            events = parse_sse(text)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if isinstance(e, dict))
            if i % 3 != 2:
                assert stream_text(events) == expected[i]  # untouched by the requests refused around it
        metrics = await (await client.get("/metrics")).text()
        assert metric(metrics, 'aserve:request_rejected_total{model_name="tiny",reason="queue_full"}') == len(refused)
        # Once the queue has room again, requests are admitted; a request that could never fit is a 400, not a 429.
        ok = await client.post(
            "/v1/completions", json={"prompt": prompts[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        )
        assert ok.status == 200 and (await ok.json())["choices"][0]["text"] == expected[0]
        never = await client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 2})
        assert never.status == 400 and "max-queue-len" in assert_openai_error(await never.json())["message"]
        assert_idle(llm_engine)  # no KV blocks held after the drain
    finally:
        await client.close()


# -- 2. graceful shutdown ----------------------------------------------------------------------------------------


def tiny_server(tiny_model, *args):
    return start_server("--model", tiny_model, "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                        "--max-num-seqs", "1", *args, timeout=120)  # fmt: skip


def open_stream(url: str, max_tokens: int):
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    return urllib.request.urlopen(req, timeout=60)


def post_status(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_exit(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_server(proc)
        pytest.fail("aserve serve did not exit after SIGTERM")
    return proc.returncode, out


def test_sigterm_lets_in_flight_streams_finish_and_exits_0(tiny_model):
    proc, url = tiny_server(tiny_model, "--shutdown-timeout", "60")
    try:
        first = open_stream(url, 400)
        second = open_stream(url, 400)  # queued behind the first (max_num_seqs 1): in flight for a while yet
        assert first.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        # Draining (the second stream has hundreds of tokens to go): new requests get a clear 503, and so does
        # /health, so that a load balancer stops sending any.
        status, body = post_status(url, "/v1/completions", {"prompt": "new", "max_tokens": 2})
        assert status == 503 and assert_openai_error(body)["code"] == "shutting_down"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{url}/health", timeout=30)
        assert health.value.code == 503
        for stream in (first, second):
            events = parse_sse(stream.read().decode().removeprefix("\n"))
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 400
            finishes = [c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["finish_reason"]]
            assert finishes == ["length"]
        code, out = wait_exit(proc)
        assert code == 0, out
        assert "aserve: stopped" in out
    finally:
        stop_server(proc)


def test_sigterm_after_timeout_ends_streams_with_error_event(tiny_model):
    proc, url = tiny_server(tiny_model, "--shutdown-timeout", "0")
    try:
        first = open_stream(url, 500)
        second = open_stream(url, 500)  # waiting for a slot when the signal comes: it cannot have finished
        assert first.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        tails = []
        for stream in (first, second):
            events = parse_sse(stream.read().decode().removeprefix("\n"))
            assert events[-1] == "[DONE]"
            tails.append(events[-2])
        for tail in tails[1:]:
            error = assert_openai_error(tail)
            assert error["code"] == 503 and "shutting down" in error["message"]
        code, out = wait_exit(proc)
        assert code == 0, out
    finally:
        stop_server(proc)


# -- 3. limits ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,body,param,words",
    [
        ("/v1/completions", {"prompt": "x", "n": 129}, "n", "n must be <= 128"),
        ("/v1/completions", {"prompt": ["a"] * 9, "n": 128}, "n", "prompts x n"),
        ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64"),
        ("/v1/completions", {"prompt": "x", "stop": "y" * 257}, "stop", "256 characters"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "at most 20"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "at most 20",
        ),
        ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed", "64-bit"),
        ("/v1/completions", {"prompt": "x", "top_k": 10**30}, "top_k", "64-bit"),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 300}, "max_tokens", "maximum context length is 256"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**20},
            "max_tokens",
            "maximum context length is 256",
        ),
    ],
)
async def test_limits_get_clear_400s(client, llm_engine, path, body, param, words):
    resp = await asyncio.wait_for(client.post(path, json=body), 60)
    assert resp.status == 400
    error = assert_openai_error(await resp.json(), param)
    assert words in error["message"]
    ok = await client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert ok.status == 200
    assert_idle(llm_engine)


async def test_limits_at_the_cap_are_served(client, llm_engine):
    body = {"prompt": "x", "n": 3, "max_tokens": 2, "stop": [f"s{i}" for i in range(63)] + ["y" * 256],
            "stop_token_ids": list(range(2, 66)), "logprobs": 20, "seed": 2**63 - 3}  # fmt: skip
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert len((await resp.json())["choices"]) == 3
    assert_idle(llm_engine)


async def test_too_large_body_gets_413_json(client, llm_engine):
    body = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    resp = await client.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert assert_openai_error(await resp.json())["code"] == "request_too_large"
    assert (await client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})).status == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_long_prompts_are_tokenised_off_the_event_loop(tiny_model, monkeypatch, path):
    """The tokeniser is made to block on a long prompt (longer than is tokenised inline, short enough to be worth
    tokenising: max_model_len 512 admits texts up to 512 x the longest token) until the test lets it go: if it ran on
    the event loop, the test itself (on the same loop) could not ask /health anything, let alone release it."""
    llm_engine = make_llm_engine(tiny_model, max_model_len=512)
    client = await make_client(llm_engine)
    real_encode = llm_engine.tokenizer.encode
    entered, release = threading.Event(), threading.Event()
    released_by_test = []

    def encode(text, *args, **kwargs):
        if len(text) > INLINE_CHARS:
            entered.set()
            released_by_test.append(release.wait(timeout=10))
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(llm_engine.tokenizer, "encode", encode)
    huge = "the quick brown fox " * 210
    assert INLINE_CHARS < len(huge) <= llm_engine.config.max_prompt_chars
    body = {"prompt": huge} if path != "/v1/chat/completions" else {"messages": [{"role": "user", "content": huge}]}
    task = asyncio.create_task(client.post(path, json=body))
    while not entered.is_set():
        await asyncio.sleep(0.01)
    assert (await asyncio.wait_for(client.get("/health"), 5)).status == 200
    release.set()
    resp = await asyncio.wait_for(task, 60)
    assert released_by_test == [True]
    if path == "/tokenize":
        assert resp.status == 200 and (await resp.json())["count"] > 256
    else:  # longer than the context: a clear 400 once tokenised
        assert resp.status == 400
        assert assert_openai_error(await resp.json())["code"] == "context_length_exceeded"
    assert_idle(llm_engine)
    await client.close()


# -- 4. fault isolation ------------------------------------------------------------------------------------------

POISON = [9, 9, 9, 9]  # prompts starting with these token ids hit the injected fault


def is_poisoned(prompt_token_ids) -> bool:
    return list(prompt_token_ids[: len(POISON)]) == POISON


def inject_detokenizer_fault(monkeypatch, llm_engine):
    """The detokeniser raises on the 3rd output token of poisoned requests."""
    real_init, real_add = IncrementalDetokenizer.__init__, IncrementalDetokenizer.add_token

    def init(self, tokenizer, prompt_token_ids, *args, **kwargs):
        real_init(self, tokenizer, prompt_token_ids, *args, **kwargs)
        self.poisoned, self.seen = is_poisoned(prompt_token_ids), 0

    def add_token(self, token_id):
        self.seen += 1
        if self.poisoned and self.seen == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real_add(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    monkeypatch.setattr(IncrementalDetokenizer, "add_token", add_token)


def inject_step_fault(monkeypatch, llm_engine):
    """The model step raises whenever a poisoned request past its 2nd token is in the batch (as a NaN check or a
    kernel's bounds check would): the batch fails as a whole, and only the poisoned request is to blame."""
    real_launch = llm_engine.core.runner.launch

    def launch(sched, *args, **kwargs):
        if any(is_poisoned(s.request.prompt_token_ids) and s.request.num_output_tokens >= 2 for s in sched.scheduled):
            raise RuntimeError("injected: NaN in logits")
        return real_launch(sched, *args, **kwargs)

    monkeypatch.setattr(llm_engine.core.runner, "launch", launch)


def inject_bad_token(monkeypatch, llm_engine):
    """The model 'samples' a token id outside the vocabulary for poisoned requests (what NaN logits can produce);
    fed back as input it would fail every later step of the batch."""
    scheduler = llm_engine.core.scheduler
    real_update = scheduler.update_from_output

    def update_from_output(sched, result):
        for i, s in enumerate(result.sampled):
            if is_poisoned(s.request.prompt_token_ids) and s.request.num_output_tokens >= 2:
                result.sampler_output.token_ids[i] = [llm_engine.config.vocab_size + 5]
        return real_update(sched, result)

    monkeypatch.setattr(scheduler, "update_from_output", update_from_output)


def inject_nan_logits(monkeypatch, llm_engine):
    """The model's logits turn NaN for poisoned requests from their 3rd token on (only their rows: the others in the
    batch are untouched). A greedy argmax over NaNs still returns an in-vocabulary id: only the sampler's finiteness
    flag tells."""
    real_sampler = llm_engine.core.runner.sampler

    def poison(logits, requests):
        rows = [i for i, r in enumerate(requests) if is_poisoned(r.prompt_token_ids) and r.num_output_tokens >= 2]
        if rows:  # one logits row per request (no speculative drafts here)
            logits = logits.clone()
            logits[rows] = float("nan")
        return logits

    class NaNSampler:  # both entry points: a whole step (__call__) and async scheduling's launch
        def __call__(self, logits, requests, *args, **kwargs):
            return real_sampler(poison(logits, requests), requests, *args, **kwargs)

        def launch(self, logits, requests):
            return real_sampler.launch(poison(logits, requests), requests)

    monkeypatch.setattr(llm_engine.core.runner, "sampler", NaNSampler())


@pytest.mark.parametrize("inject", [inject_detokenizer_fault, inject_step_fault, inject_bad_token, inject_nan_logits])
async def test_fault_in_one_request_ends_only_that_request(client, llm_engine, monkeypatch, inject):
    good = [prompt_ids(i, 20) for i in range(4)]
    expected = await reference_texts(client, good, max_tokens=16)
    inject(monkeypatch, llm_engine)
    base = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def post(prompt, stream):
        resp = await client.post("/v1/completions", json={**base, "prompt": prompt, "stream": stream})
        return resp.status, await resp.text()

    results = await asyncio.wait_for(asyncio.gather(
        post(POISON + good[0], stream=True), post(POISON + good[1], stream=False),
        *(post(p, stream=i % 2 == 0) for i, p in enumerate(good)),
    ), 120)  # fmt: skip
    (s_status, s_text), (n_status, n_text), *good_results = results
    # The faulty stream ends with an error event, then [DONE]; the faulty non-streamed request gets a 500 error body.
    events = parse_sse(s_text)
    assert s_status == 200 and events[-1] == "[DONE]"
    error = assert_openai_error(events[-2])
    assert error["code"] == 500 and error["type"] == "server_error" and "injected" not in error["message"]
    assert n_status == 500 and assert_openai_error(json.loads(n_text))["type"] == "server_error"
    # Everyone else got exactly what they would have got alone.
    for i, (status, text) in enumerate(good_results):
        assert status == 200
        got = stream_text(parse_sse(text)) if i % 2 == 0 else json.loads(text)["choices"][0]["text"]
        assert got == expected[i]
    # The server keeps serving, and nothing leaked.
    again = await client.post("/v1/completions", json={**base, "prompt": good[2]})
    assert (await again.json())["choices"][0]["text"] == expected[2]
    assert_idle(llm_engine)


async def test_fault_while_writing_a_stream_ends_it_with_an_error_event(client, llm_engine, monkeypatch):
    real_chunk = streaming_module.completion_chunk
    calls = []

    def chunk(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("injected")
        return real_chunk(*args, **kwargs)

    monkeypatch.setattr(streaming_module, "completion_chunk", chunk)
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "ignore_eos": True,
                                                      "stream": True})  # fmt: skip
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]" and assert_openai_error(events[-2])["code"] == 500
    monkeypatch.undo()
    ok = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status == 200
    assert_idle(llm_engine)


# -- 5. /openapi.json and fuzzing --------------------------------------------------------------------------------


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


# -- 6. NaN logits -----------------------------------------------------------------------------------------------


def test_sampler_flags_non_finite_rows():
    """The flag comes with the sampled tokens (one host copy), per request, whatever the sampling mode."""
    from aserve.core.request import Request
    from aserve.sampling_params import SamplingParams
    from aserve.worker.sampler import Sampler

    sampler = Sampler(torch.device("cpu"), seed=0)
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=t, max_tokens=4), None)
                for i, t in enumerate([0.0, 0.0, 1.0, 0.0])]  # fmt: skip
    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[2] = float("nan")  # sampled, not greedy
    logits[3, 0] = float("inf")
    out = sampler(logits, requests)
    assert out.nonfinite == [False, True, True, True]
    assert all(0 <= t[0] < 50 for t in out.token_ids)  # the ids alone look valid: hence the flag
    clean = sampler(torch.randn(2, 50), requests[:2])
    assert clean.nonfinite == [False, False]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_nan_logits_end_only_that_request_with_a_clear_error(client, llm_engine, monkeypatch, temperature):
    good = [prompt_ids(i, 16) for i in range(3)]
    expected = await reference_texts(client, good, max_tokens=12)
    inject_nan_logits(monkeypatch, llm_engine)
    errors = 'aserve:request_success_total{finished_reason="error",model_name="tiny"}'
    before = metric(await (await client.get("/metrics")).text(), errors)
    base = {"max_tokens": 12, "ignore_eos": True}

    async def post(prompt, stream, temp=0.0):
        resp = await client.post("/v1/completions", json={**base, "prompt": prompt, "stream": stream,
                                                          "temperature": temp})  # fmt: skip
        return resp.status, await resp.text()

    (s_status, s_text), (n_status, n_text), *rest = await asyncio.wait_for(asyncio.gather(
        post(POISON + good[0], True, temperature), post(POISON + good[1], False, temperature),
        *(post(p, i % 2 == 0) for i, p in enumerate(good)),
    ), 120)  # fmt: skip
    events = parse_sse(s_text)
    assert s_status == 200 and events[-1] == "[DONE]"
    error = assert_openai_error(events[-2])
    assert error["code"] == 500 and "non-finite logits" in error["message"]
    assert len(events) <= 4  # at most the two tokens sampled before the NaNs (one event each), the error, [DONE]
    assert n_status == 500 and "non-finite logits" in assert_openai_error(json.loads(n_text))["message"]
    for i, (status, text) in enumerate(rest):
        got = stream_text(parse_sse(text)) if i % 2 == 0 else json.loads(text)["choices"][0]["text"]
        assert status == 200 and got == expected[i]
    assert metric(await (await client.get("/metrics")).text(), errors) - before == 2
    monkeypatch.undo()  # the fault is gone: the same prompt is served again (its KV was not reused from the cache)
    status, text = await post(POISON + good[0], False)
    assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "length"
    assert_idle(llm_engine)


# -- 7. disconnect storm -----------------------------------------------------------------------------------------


def load_bench(name: str):
    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_storm(tiny_model, tmp_path, num_requests: int) -> dict:
    """bench/reliability_storm.py against `aserve serve` (tiny model, 40 KV blocks, --debug-invariants)."""
    storm = load_bench("reliability_storm")
    log_path = tmp_path / "server.log"
    proc, url = start_server("--model", tiny_model, *storm.SERVER_FLAGS, timeout=120, log_path=str(log_path))
    try:
        result = asyncio.run(storm.storm(url, num_requests, disconnect=0.3, concurrency=64, seed=0))
    finally:
        stop_server(proc)
    log = log_path.read_text()
    assert "--debug-invariants" in " ".join(storm.SERVER_FLAGS) and "aserve: serving" in log
    assert result["problems"] == [], result["problems"][:20]
    assert storm.log_problems(log) == [], log[-5000:]  # no ERROR line, no traceback (invariant checks included)
    by_kind = result["by_kind"]
    assert sum(by_kind.values()) == num_requests and by_kind["complete"] == num_requests - round(0.3 * num_requests)
    finished = result["finished"]
    # Every request ended; most hang-ups were seen as aborts (a few finish before the server notices).
    assert finished["error"] == 0 and finished["length"] >= result["by_kind"]["complete"]
    assert finished["abort"] >= 0.15 * num_requests and finished["length"] + finished["abort"] <= num_requests
    return result


def test_disconnect_storm(tiny_model, tmp_path):
    """200 streams, 30 % of the clients hanging up before their first token or mid-stream: afterwards nothing is
    open, running or waiting, no KV block is held, the log is clean and answers are what they were before."""
    run_storm(tiny_model, tmp_path, 200)


@pytest.mark.slow
def test_disconnect_storm_2000(tiny_model, tmp_path):
    run_storm(tiny_model, tmp_path, 2000)


# -- 8. KV exhaustion --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
async def test_kv_exhaustion_preempts_and_every_request_completes_unchanged(client, tiny_model, prefix_caching):
    """16 KV blocks (256 tokens: the least max_model_len 256 allows) for 12 concurrent requests of up to 76 tokens
    each: requests are preempted (their blocks freed) and recomputed, every one completes, and greedy outputs equal
    those of the same concurrent load with ample KV (the module's engine)."""
    prompts = [prompt_ids(i, 12 + 3 * i) for i in range(12)]
    prompts[3] = prompts[2][:16] + prompts[3][16:]  # a shared full block: prefix hits on preempted requests' blocks
    max_tokens = [24 + 3 * i for i in range(12)]

    async def load(c) -> list[str]:
        async def one(i):
            body = {"prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0, "ignore_eos": True,
                    "stream": i % 2 == 0}  # fmt: skip
            resp = await c.post("/v1/completions", json=body)
            assert resp.status == 200
            if i % 2:
                return (await resp.json())["choices"][0]["text"]
            events = parse_sse(await resp.text())
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            return stream_text(events)

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(12))), 180)

    expected = await load(client)
    small = make_llm_engine(tiny_model, num_gpu_blocks_override=16, enable_prefix_caching=prefix_caching)
    assert small.core.num_kv_blocks == 16
    small_client = await make_client(small)
    try:
        got = await load(small_client)
        text = await (await small_client.get("/metrics")).text()
        assert metric(text, "aserve:num_preemptions_total") > 0
        assert metric(text, 'aserve:request_success_total{finished_reason="length",model_name="tiny"}') == 12
        assert metric(text, "aserve:num_requests_running") == 0 and metric(text, "aserve:kv_cache_usage_perc") == 0
        assert got == expected
        assert_idle(small)
    finally:
        await small_client.close()


# -- 9. the invariant checker ------------------------------------------------------------------------------------


def corrupt_leaked_ref(llm_engine, rid):
    block = llm_engine.core.kv_manager.req_to_blocks[rid][0]
    block.ref_cnt += 1
    return lambda: setattr(block, "ref_cnt", block.ref_cnt - 1)


def corrupt_free_and_held(llm_engine, rid):
    block, queue = llm_engine.core.kv_manager.req_to_blocks[rid][-1], llm_engine.core.kv_manager.pool.free_block_queue
    queue.append(block)
    return lambda: queue.remove(block)


def corrupt_lost_block(llm_engine, rid):
    """A block taken from the free list and referenced, but recorded for no request: it would never be freed."""
    queue = llm_engine.core.kv_manager.pool.free_block_queue
    block = queue.popleft()
    block.ref_cnt = 1
    return lambda: (setattr(block, "ref_cnt", 0), queue.append(block))


def corrupt_queue(llm_engine, rid):
    llm_engine.core.scheduler.waiting.append(llm_engine.core.scheduler.requests[rid])
    return llm_engine.core.scheduler.waiting.pop


def corrupt_lost_request(llm_engine, rid):
    request = llm_engine.core.scheduler.requests[rid]
    llm_engine.core.scheduler.running.remove(request)
    return lambda: llm_engine.core.scheduler.running.append(request)


def corrupt_request_table(llm_engine, rid):
    entry = llm_engine.output_processor.sequence_to_state.pop(rid)
    return lambda: llm_engine.output_processor.sequence_to_state.__setitem__(rid, entry)


@pytest.fixture(scope="module")
def small_engine(tiny_model):
    return make_llm_engine(tiny_model, num_gpu_blocks_override=32)


@pytest.mark.parametrize("corrupt,words", [
    (corrupt_leaked_ref, r"ref_cnt is 2 but 1 live request\(s\) hold it \(a leaked or lost reference\)"),
    (corrupt_free_and_held, r"is in the free list while 1 live request\(s\) hold it"),
    (corrupt_lost_block, r"ref_cnt is 1 but 0 live request\(s\) hold it"),
    (corrupt_queue, r"a request is queued twice"),
    (corrupt_lost_request, r"the queues \(\[\]\) and the live requests \(\['{rid}'\]\) differ"),
    (corrupt_request_table, r"queued sequence '{rid}' belongs to no live request"),
], ids=lambda v: v.__name__.removeprefix("corrupt_") if callable(v) else "")  # fmt: skip
def test_invariant_checker_catches_corrupted_state(small_engine, corrupt, words):
    """Each deliberately corrupted state (a leaked ref count, a block both free and held, a block held by nobody,
    inconsistent queues or request table) fails the check with a message that names the problem."""
    from aserve import SamplingParams
    from aserve.core.kv_cache_manager import InvariantError

    engine, rid = small_engine, corrupt.__name__
    engine.add_request(rid, {"prompt_token_ids": prompt_ids(0, 40)}, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt is computed: the request runs and holds 3 blocks
    engine.check_invariants()  # a sound state passes
    undo = corrupt(engine, rid)
    with pytest.raises(InvariantError, match=words.format(rid=rid)):
        engine.check_invariants()
    undo()
    engine.check_invariants()
    engine.abort_request(rid)
    assert_idle(engine)


def test_invariant_checker_runs_after_every_step_and_abort(small_engine):
    from aserve import SamplingParams
    from aserve.core.kv_cache_manager import InvariantError

    engine = small_engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompt_ids(1, 20)}, params)
    engine.add_request("b", {"prompt_token_ids": prompt_ids(2, 20)}, params)
    engine.step()
    undo = corrupt_leaked_ref(engine, "a")
    with pytest.raises(InvariantError, match="leaked or lost reference"):
        engine.step()
    undo()
    undo = corrupt_leaked_ref(engine, "b")
    with pytest.raises(InvariantError, match="leaked or lost reference"):
        engine.abort_request("a")
    undo()
    engine.abort_request("b")
    assert_idle(engine)
    engine.config.args.debug_invariants = (
        False  # off: not checked (it costs a pass over every block per step and abort)
    )
    try:
        engine.add_request("c", {"prompt_token_ids": prompt_ids(3, 20)}, params)
        engine.step()
        undo = corrupt_leaked_ref(engine, "c")
        engine.step()
        undo()
        engine.abort_request("c")
    finally:
        engine.config.args.debug_invariants = True
    assert_idle(engine)


# -- security -------------------------------------------------------------------------------------------------------


async def test_api_key_guards_every_v1_route(llm_engine):
    """With --api-key, every /v1 route (whatever it is, present or future) answers 401 without the right bearer
    token; /health and /metrics stay open for probes and scrapers."""
    client = await make_client(llm_engine, api_key="sekrit")
    try:
        routes = [
            (r.method, r.resource.canonical)
            for r in client.app.router.routes()
            if r.resource is not None and r.resource.canonical.startswith("/v1") and r.method != "HEAD"
        ]
        assert {path for _, path in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                resp = await client.request(method, path, json={}, headers=headers)
                assert resp.status == 401, (method, path, headers)
                assert (await resp.json())["error"]["code"] == "invalid_api_key"
        resp = await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert resp.status == 200
        assert (await client.get("/health")).status == 200 and (await client.get("/metrics")).status == 200
    finally:
        await client.close()


def test_serve_binds_localhost_by_default():
    ns = build_parser().parse_args(["serve"])
    assert ns.host == "127.0.0.1" and ns.api_key is None


def test_prefix_hash_seed_is_random_per_process():
    """The same tokens hash differently in two processes: block hashes cannot be predicted (or collided on purpose)
    from outside."""
    code = ("from aserve.core.block_pool import BlockHasher; h = []; BlockHasher(16).extend(h, list(range(32)));"
            "print(h[-1].hex())")  # fmt: skip
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)]  # fmt: skip
    assert len(runs[0]) == 32 and runs[0] != runs[1]


async def test_cache_salt_isolates_prefix_sharing(tiny_model):
    """Requests share prefix-cache blocks only with requests of the same cache_salt (tenant). A fresh engine: the
    shared one's hit counter also moves with other tests' leftover step statistics."""
    client = await make_client(make_llm_engine(tiny_model))
    prompt = list(range(10, 74))  # 4 full blocks

    async def hits_of(salt) -> float:
        before = metric(await (await client.get("/metrics")).text(), "aserve:prefix_cache_hits_total")
        body = {"prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        return metric(await (await client.get("/metrics")).text(), "aserve:prefix_cache_hits_total") - before

    try:
        assert await hits_of("tenant-a") == 0
        assert await hits_of("tenant-a") > 0  # same tenant: shared
        assert await hits_of("tenant-b") == 0  # another tenant: not shared
        assert await hits_of(None) == 0  # unsalted requests do not share with salted ones either
        assert await hits_of(None) > 0
    finally:
        await client.close()
