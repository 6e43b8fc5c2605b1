"""Streaming over real sockets: the chunks' shape with several choices, and a client that stops reading its stream
(its requests are paused while the others are served, and resume when it reads again; paused past the stall timeout,
they are ended, their KV blocks freed, and the connection closed)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from aserve_server import start_server, stop_server
from test_hardening import assert_serves, metric, openai_client

STREAM_BUFFER = 64 << 10  # bytes of events that may wait for a client that stopped reading
STALL_TIMEOUT = 4.0  # seconds its requests may stay paused


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("streaming") / "server.log")
    os.environ["ASERVE_STREAM_BUFFER"] = str(STREAM_BUFFER)
    os.environ["ASERVE_STREAM_STALL_TIMEOUT"] = str(STALL_TIMEOUT)
    try:
        proc, url = start_server(
            "--model", tiny_model, "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", log_path=log
        )  # fmt: skip
    finally:
        del os.environ["ASERVE_STREAM_BUFFER"], os.environ["ASERVE_STREAM_STALL_TIMEOUT"]
    try:
        yield url, int(url.rsplit(":", 1)[1]), log
    finally:
        stop_server(proc)


def test_each_chunk_carries_one_choice_and_each_choice_finishes(server):
    url = server[0]
    stream = openai_client(url).completions.create(
        model="gqa",
        prompt="The quick brown fox",
        max_tokens=12,
        n=3,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finishes, usage = {0: "", 1: "", 2: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        assert choice.index not in finishes, "nothing follows a choice's finish"
        text[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == 36
    # the streamed text of each choice is what the same seeded request returns whole
    whole = openai_client(url).completions.create(model="gqa", prompt="The quick brown fox", max_tokens=12, n=3, seed=7)
    assert sorted(text.values()) == sorted(c.text for c in whole.choices)


PROMPTS = ["The quick brown fox", "A cache of blocks", "Streams of tokens", "One event loop"]
STUCK_REQUESTS = {
    # ~12 MB of events if nothing paused it (32 sequences x 400 tokens x 20 logprobs)
    "many sequences": {"prompt": PROMPTS, "max_tokens": 400, "n": 8, "logprobs": 20},
    "one sequence": {"prompt": PROMPTS[0], "max_tokens": 400, "logprobs": 20},
}
GENERATED = "aserve:generation_tokens_total"
PAUSES = "aserve:http_stream_pauses_total"
CUT_OFF = 'aserve:http_connections_closed_total{model_name="gqa",reason="slow_client"}'


def open_stream(port: int, body: dict, version: str = "1.1") -> socket.socket:
    """A raw streaming request on a connection with a small receive window (the server's writes back up soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", port))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(
        f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def wait_until_paused(url: str, pauses_before: float, limit: float = 60) -> float:
    """Waits until the stuck stream's requests are paused (the pause counter moved past `pauses_before`; quiet alone
    is no sign of it: a loaded machine may take longer than that to run the request's first step), then until
    nothing is generated for half a second (a step in flight when they paused has ended; no other client runs),
    within `limit` seconds of the pause. -> the tokens generated so far."""
    deadline = time.monotonic() + 60
    while metric(url, PAUSES) <= pauses_before:
        assert time.monotonic() < deadline, "the stream of a client that stopped reading was never paused"
        time.sleep(0.05)
    deadline = time.monotonic() + limit
    before = metric(url, GENERATED)
    while True:
        time.sleep(0.5)
        now = metric(url, GENERATED)
        if now == before:
            return now
        assert time.monotonic() < deadline, "the requests of a paused stream kept generating"
        before = now


@pytest.mark.parametrize("request_body", STUCK_REQUESTS.values(), ids=STUCK_REQUESTS.keys())
def test_a_client_that_stops_reading_is_paused_then_cut_off_and_its_blocks_freed(server, request_body):
    url, port, log = server
    cut_before, generated_before, pauses_before = metric(url, CUT_OFF), metric(url, GENERATED), metric(url, PAUSES)
    sock = open_stream(port, {**request_body, "ignore_eos": True})
    try:
        generated = wait_until_paused(url, pauses_before)
        assert metric(url, PAUSES) == pauses_before + 1
        prompts = request_body["prompt"]
        num_sequences = (len(prompts) if isinstance(prompts, list) else 1) * request_body.get("n", 1)
        assert generated - generated_before < num_sequences * request_body["max_tokens"] / 2  # paused early
        # paused: still running and holding its blocks (nothing else wants them), the others are served meanwhile
        assert metric(url, "aserve:num_requests_running") == num_sequences
        assert metric(url, "aserve:kv_cache_usage_perc") > 0
        assert_serves(url)
        deadline = time.monotonic() + STALL_TIMEOUT + 30
        while metric(url, CUT_OFF) <= cut_before:  # cut off once paused for the stall timeout
            assert time.monotonic() < deadline, "the client that stopped reading was never cut off"
            time.sleep(0.2)
        # its requests end on the handler's turn, just after the cut-off is counted
        while metric(url, "aserve:num_requests_running") or metric(url, "aserve:kv_cache_usage_perc"):
            assert time.monotonic() < deadline, "the requests of a client cut off kept running or holding blocks"
            time.sleep(0.05)
        assert_serves(url)
        sock.settimeout(30)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received  # cut off mid-stream
    finally:
        sock.close()
    with open(log, errors="replace") as f:
        assert "the client stopped reading its stream" in f.read()


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_client_that_pauses_its_reading_gets_its_whole_stream(server, version):
    """A client that stops reading for a while (shorter than the stall timeout) has its request paused, not ended:
    once it reads again the stream resumes, and what it receives is what the request gives unstreamed. HTTP/1.0
    streams the same (no chunked framing: the body ends when the server closes the connection)."""
    url, port, _ = server
    body = {"model": "gqa", "prompt": PROMPTS[1], "max_tokens": 300, "temperature": 0, "logprobs": 5,
            "ignore_eos": True}  # fmt: skip
    generated_before, pauses_before = metric(url, GENERATED), metric(url, PAUSES)
    sock = open_stream(port, body, version)
    try:
        assert wait_until_paused(url, pauses_before, limit=STALL_TIMEOUT - 1) - generated_before < 150
        assert metric(url, PAUSES) == pauses_before + 1
        sock.settimeout(30)
        received = b""
        while chunk := sock.recv(65536):  # until the end of the stream, or the connection's (HTTP/1.0)
            received += chunk
            if version == "1.1" and received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                break
    finally:
        sock.close()
    assert received.startswith(f"HTTP/{version} 200".encode()) and b"data: [DONE]" in received
    assert (b"Transfer-Encoding: chunked" in received) == (version == "1.1")
    events = [json.loads(line[6:]) for line in received.split(b"\n") if line.startswith(b"data: {")]
    text = "".join(e["choices"][0]["text"] for e in events)
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    ignore_eos = {"ignore_eos": body.pop("ignore_eos")}
    whole = openai_client(url).completions.create(**body, extra_body=ignore_eos)
    assert len(tokens) == 300 and text == whole.choices[0].text
