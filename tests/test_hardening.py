"""What a hostile client's inputs do to `aserve serve`, over real sockets: JSON nested too deeply, prompts that no
tokenisation could fit in the context, headers or bodies that never end, idle kept-alive connections, more
connections than the server allows. Each attack gets a clear answer (400, 408, 503) or a closed connection, and the
server keeps serving, with nothing logged above WARNING. (Times and memory are measured in
bench/reliability_inputs.py and bench/reliability_slowloris.py, not here.)"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from aserve_server import start_server, stop_server

from aserve.cli import main as cli_main
from aserve.engine.errors import EngineOverloadedError
from aserve.engine.llm_engine import INLINE_CHARS, TokenizerPool
from aserve.entrypoints.openai.connections import LARGE_BODY_BYTES
from aserve.sampling_params import ParamError

TIMEOUT_HEADERS, TIMEOUT_BODY, TIMEOUT_KEEP_ALIVE, LIMIT = 2.0, 2.0, 1.0, 48
MAX_MODEL_LEN = 512  # the tiny model's own context length
NEST = "[" * 10_000 + "]" * 10_000


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("hardening") / "server.log")
    proc, url = start_server(
        "--model", tiny_model, "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
        "--timeout-headers", str(TIMEOUT_HEADERS), "--timeout-body", str(TIMEOUT_BODY),
        "--timeout-keep-alive", str(TIMEOUT_KEEP_ALIVE), "--limit-concurrency", str(LIMIT), log_path=log,
    )  # fmt: skip
    try:
        yield url, int(url.rsplit(":", 1)[1]), log
    finally:
        stop_server(proc)


def post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def assert_serves(url: str) -> None:
    out = openai_client(url).completions.create(
        model="gqa", prompt="The quick brown fox", max_tokens=4, extra_body={"ignore_eos": True}
    )  # sampled: without ignore_eos, one call in a few hundred draws EOS within 4 tokens
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4


def log_lines_above_warning(log: str) -> list[str]:
    with open(log, errors="replace") as f:
        return [line for line in f if any(word in line for word in (" ERROR ", " CRITICAL ", "Traceback"))]


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def recv_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when (seconds from now)."""
    t0, data = time.monotonic(), b""
    sock.settimeout(limit)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


# -- bodies -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", '{"prompt": ' + NEST + ', "max_tokens": 1}'),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "unknown": ' + NEST + "}"),
        ("/v1/completions", NEST),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": ' + NEST + "}]}"),
        ("/tokenize", '{"prompt": "hi", "x": ' + '{"a": ' * 10_000 + "1" + "}" * 10_001),
    ],
    ids=["prompt", "unknown-field", "whole-body", "chat-content", "objects"],
)
def test_deep_nesting_is_a_400_and_logs_nothing(server, path, body):
    url, _, log = server
    status, answer = post(url, path, body.encode())
    assert status == 400
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["type"] == "invalid_request_error"
    assert_serves(url)
    assert log_lines_above_warning(log) == []


def test_prompts_no_tokenisation_could_fit_are_refused_before_tokenising(server):
    url, _, log = server
    client = openai_client(url)
    huge = "The committee met on a grey Tuesday morning. " * (30 * 2**20 // 45)  # ~30 MiB
    for prompt in (huge, ["a short one", huge]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="gqa", prompt=prompt, max_tokens=1)
        assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
        assert "characters" in e.value.body["message"]
    messages = [{"role": ("user", "assistant")[i % 2], "content": huge[:6000]} for i in range(5000)]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gqa", messages=messages, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    status, answer = post(url, "/tokenize", json.dumps({"prompt": huge}).encode())
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert_serves(url)
    assert log_lines_above_warning(log) == []


def test_a_long_prompt_that_may_fit_is_tokenised_and_then_judged(server):
    """Longer than what is tokenised inline, within the character bound: tokenised (in the pool), then refused
    with the token count, like any prompt beyond the context."""
    url, _, _ = server
    prompt = "the quick brown fox jumps " * (INLINE_CHARS // 25 + 1)
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(url).completions.create(model="gqa", prompt=prompt, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and "tokens" in e.value.body["message"]
    assert "characters" not in e.value.body["message"]


# -- connections --------------------------------------------------------------------------------------------------


def test_headers_that_never_end_are_closed_at_the_header_timeout(server):
    url, port, log = server
    before = metric(url, 'aserve:http_connections_closed_total{model_name="gqa",reason="header_timeout"}')
    socks = []
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(sock)
    t0 = time.monotonic()
    closed_at = [None] * len(socks)
    while any(t is None for t in closed_at) and time.monotonic() - t0 < TIMEOUT_HEADERS + 3:
        for i, sock in enumerate(socks):  # a byte each, every 0.2 s, as a slow-loris client does
            if closed_at[i] is None:
                try:
                    sock.sendall(b"a")
                except OSError:
                    closed_at[i] = time.monotonic() - t0
        assert_serves(url)  # normal clients are served meanwhile
        time.sleep(0.2)
    answers = [recv_until_closed(sock, 5)[0] for sock in socks]
    for sock in socks:
        sock.close()
    assert all(t is not None and t <= TIMEOUT_HEADERS + 1.5 for t in closed_at), closed_at
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers if a), answers
    assert json.loads(answers[0].split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    after = metric(url, 'aserve:http_connections_closed_total{model_name="gqa",reason="header_timeout"}')
    assert after - before == len(socks)
    assert log_lines_above_warning(log) == []


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_that_stops_arriving_is_closed_at_the_body_timeout(server, framing):
    url, port, _ = server
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if framing == "chunked":
        head += b"Transfer-Encoding: chunked\r\n\r\n9\r\n" + b'{"prompt"' + b"\r\n"
    else:
        head += b"Content-Length: 1000\r\n\r\n" + b'{"prompt"'
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        answer, elapsed = recv_until_closed(sock, TIMEOUT_BODY + 5)
    assert answer.startswith(b"HTTP/1.1 408 ") and TIMEOUT_BODY - 0.5 <= elapsed <= TIMEOUT_BODY + 1.5
    assert_serves(url)


def test_a_large_body_that_trickles_is_closed_at_the_body_timeout(server):
    """A large body is received in one of a few slots, so it must arrive in full within the body timeout: one that
    keeps a byte coming now and then (never idle long enough for the inactivity timeout) is answered 408."""
    url, port, _ = server
    length = 2 * LARGE_BODY_BYTES
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + b"\r\n\r\n" + b'{"prompt": "' + b"a" * LARGE_BODY_BYTES)
        t0, answer = time.monotonic(), b""
        sock.settimeout(0.3)
        while time.monotonic() - t0 < TIMEOUT_BODY + 3 and not answer:
            try:
                sock.sendall(b"a")
                answer = sock.recv(65536)
            except TimeoutError:
                pass
            except OSError:
                break
    assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - t0 <= TIMEOUT_BODY + 1.5
    assert_serves(url)


def test_a_slow_body_that_keeps_arriving_is_read(server):
    """The body timeout is inactivity, not a deadline: a body that takes twice as long but never pauses that long
    is read and answered."""
    url, port, _ = server
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 2}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + b"\r\nConnection: close\r\n\r\n")
        pieces = [body[i : i + len(body) // 8 + 1] for i in range(0, len(body), len(body) // 8 + 1)]
        t0 = time.monotonic()
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(TIMEOUT_BODY * 2 / len(pieces))
        answer, _ = recv_until_closed(sock, 30)
    assert time.monotonic() - t0 > TIMEOUT_BODY
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["usage"]["completion_tokens"] == 2


def test_kept_alive_connections_serve_requests_then_close_when_idle(server):
    _, port, _ = server
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(5)
        for _ in range(3):  # the next request within the keep-alive time: the same connection serves it
            sock.sendall(request)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
            time.sleep(TIMEOUT_KEEP_ALIVE / 2)
        rest, elapsed = recv_until_closed(sock, TIMEOUT_KEEP_ALIVE + 5)
    assert rest == b"" and elapsed <= TIMEOUT_KEEP_ALIVE + 1.0


def test_connections_beyond_the_limit_get_503(server):
    url, port, log = server
    time.sleep(TIMEOUT_KEEP_ALIVE + 0.5)  # earlier tests' kept-alive connections have closed
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMIT)]
    try:
        with socket.create_connection(("127.0.0.1", port)) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer, _ = recv_until_closed(extra, 5)
        assert answer.startswith(b"HTTP/1.1 503 ")
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "too_many_connections" and "--limit-concurrency" in error["message"]
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # the held connections' closing reaches the server
        try:
            assert_serves(url)
            break
        except openai.APIError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert metric(url, 'aserve:http_connections_closed_total{model_name="gqa",reason="connection_limit"}') >= 1
    assert log_lines_above_warning(log) == []


@pytest.mark.parametrize("flag, value", [("--timeout-headers", "0"), ("--timeout-body", "-1"),
                                         ("--limit-concurrency", "0"), ("--tokenizer-pool-size", "0")])  # fmt: skip
def test_serve_refuses_bad_limits_before_loading(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


# -- the tokenizer pool -------------------------------------------------------------------------------------------


class SlowTokenizer:
    """encode() of a long text blocks until released; it records the thread it ran on."""

    chat_template = "{{ messages[0]['content'] }}"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads = []

    def encode(self, text, add_special_tokens=True):
        self.threads.append(threading.current_thread().name)
        if len(text) > INLINE_CHARS:
            self.release.wait(10)
        return [len(text)]

    def decode(self, ids):
        return "x" * len(ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return messages[0]["content"]


async def test_tokenizer_pool_caps_the_text_in_flight():
    tokenizer = SlowTokenizer()
    pool = TokenizerPool(tokenizer, pool_size=2, max_pending_chars=3 * INLINE_CHARS)
    long_text = "a" * (2 * INLINE_CHARS)
    first = asyncio.create_task(pool.encode(long_text))
    await asyncio.sleep(0.05)
    assert pool.pending_chars == len(long_text)
    with pytest.raises(EngineOverloadedError) as e:  # 4 x INLINE_CHARS would be in flight
        await pool.encode(long_text)
    assert e.value.code == "tokenizer_busy" and e.value.retry_after >= 1
    assert await pool.encode("short") == [5]  # short texts are encoded inline, outside the cap
    first.cancel()  # the caller gives up: the text stays counted until the thread is done with it
    await asyncio.sleep(0.05)
    assert pool.pending_chars == len(long_text)
    tokenizer.release.set()
    for _ in range(100):
        if pool.pending_chars == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.pending_chars == 0
    assert await pool.encode(long_text) == [len(long_text)]
    assert tokenizer.threads.count("MainThread") == 1  # the short text
    assert all(name.startswith("aserve-tokenize") for name in tokenizer.threads if name != "MainThread")
    with pytest.raises(ParamError) as e:  # the rendered text is checked before it is tokenised
        await pool.render_chat([{"role": "user", "content": long_text}], True, None, len(long_text), _refuse)
    assert e.value.param == "messages"
    pool.shutdown()


def _refuse(num_chars: int) -> None:
    raise ParamError("messages", f"{num_chars} characters")


@pytest.mark.skipif(sys.platform != "linux", reason="reads the listening socket's queue size from Linux's TCP_INFO")
async def test_the_listening_socket_queues_a_burst_of_connections():
    """The server's listening socket keeps its backlog once the event loop serves it (create_server listens again,
    with 100 unless told): a burst of a few hundred new clients waits in the kernel's queue instead of having its
    connections dropped and retried a second later."""
    import struct

    from aserve.entrypoints.openai.connections import LISTEN_BACKLOG, listen_socket, start_listening

    sock = listen_socket("127.0.0.1", 0)
    server = await start_listening(asyncio.Protocol, sock)
    try:
        # struct tcp_info: eight one-byte fields, then rto, ato, snd_mss, rcv_mss, unacked, sacked (u32 each); for a
        # listening socket `sacked` is the queue's size (sk_max_ack_backlog).
        max_backlog = struct.unpack_from("8B6I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104))[13]
        with open("/proc/sys/net/core/somaxconn") as f:
            assert max_backlog == min(LISTEN_BACKLOG, int(f.read())) > 100
    finally:
        server.close()
