"""Streaming over real sockets: the chunks' shape with several choices, and a client that stops reading its stream
(it is cut off at its buffer bound, its KV blocks are freed, and the other clients are served meanwhile)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from aserve_server import start_server, stop_server
from test_hardening import assert_serves, metric, openai_client

STREAM_BUFFER = 64 << 10  # bytes of events that may wait for a client that stopped reading


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("streaming") / "server.log")
    os.environ["ASERVE_STREAM_BUFFER"] = str(STREAM_BUFFER)
    try:
        proc, url = start_server(
            "--model", tiny_model, "--dtype", "float32", "--enforce-eager", "--max-model-len", "512", log_path=log
        )  # fmt: skip
    finally:
        del os.environ["ASERVE_STREAM_BUFFER"]
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
    # ~12 MB of events (32 sequences x 400 tokens x 20 logprobs)
    "many sequences": {"prompt": PROMPTS, "max_tokens": 400, "n": 8, "logprobs": 20},
    # ~0.4 MB: less than the kernel would take from the server (~2 MB on loopback) if the connection's send buffer
    # were left to autotuning rather than bounded by the stream buffer
    "one sequence": {"prompt": PROMPTS[0], "max_tokens": 400, "logprobs": 20},
}


@pytest.mark.parametrize("request_body", STUCK_REQUESTS.values(), ids=STUCK_REQUESTS.keys())
def test_a_client_that_stops_reading_is_cut_off_and_its_blocks_freed(server, request_body):
    url, port, log = server
    cut_before = metric(url, 'aserve:http_connections_closed_total{model_name="gqa",reason="slow_client"}')
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a small window: the server's writes back up soon
    sock.connect(("127.0.0.1", port))
    body = json.dumps({**request_body, "ignore_eos": True, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        deadline = time.monotonic() + 120
        while metric(url, 'aserve:http_connections_closed_total{model_name="gqa",reason="slow_client"}') <= cut_before:
            assert time.monotonic() < deadline, "the client that stopped reading was never cut off"
            assert_serves(url)  # the others are served meanwhile
            time.sleep(0.2)
        assert metric(url, "aserve:num_requests_running") == 0
        assert metric(url, "aserve:kv_cache_usage_perc") == 0
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
