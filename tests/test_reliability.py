"""Reliability: overload (429), graceful shutdown (SIGTERM), request limits, fault isolation.

In-process tests drive the aiohttp app over HTTP (aiohttp's test server) with a tiny model; the shutdown tests run
`aserve serve` as a subprocess and signal it, as an orchestrator would.
"""

import asyncio
import json
import signal
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
import reliability_common
import torch
from aserve_server import start_server, stop_server
from reliability_common import assert_openai_error, make_llm_engine, parse_sse, prompt_ids, stream_text
from test_server import assert_idle, make_client, metric

from aserve import EngineArgs
from aserve.cli import build_parser, engine_args_from
from aserve.engine.detokenizer import IncrementalDetokenizer
from aserve.engine.llm_engine import INLINE_CHARS
from aserve.entrypoints.openai import event_stream as streaming_module
from aserve.entrypoints.openai.server import MAX_BODY_BYTES

llm_engine, client = reliability_common.llm_engine, reliability_common.client  # fixtures, found by their names


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
            "max_completion_tokens",
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


async def test_many_short_prompts_are_tokenised_off_the_event_loop(tiny_model, monkeypatch):
    """A completions request of many prompts, each short enough to tokenise inline but long together: tokenised in
    the pool, not on the loop's thread."""
    llm_engine = make_llm_engine(tiny_model, max_model_len=512)
    client = await make_client(llm_engine)
    real_encode, threads = llm_engine.tokenizer.encode, []

    def encode(text, *args, **kwargs):
        threads.append(threading.current_thread() is threading.main_thread())
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(llm_engine.tokenizer, "encode", encode)
    prompt = "the quick brown fox " * 50  # 1,000 characters
    for prompts, on_loop in (([prompt] * 3, True), ([prompt] * 8, False)):  # 3,000 and 8,000 characters
        threads.clear()
        resp = await client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 1})
        assert resp.status == 200 and len((await resp.json())["choices"]) == len(prompts)
        assert threads == [on_loop] * len(prompts)
    await client.close()
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


# -- 5. NaN logits -----------------------------------------------------------------------------------------------


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
