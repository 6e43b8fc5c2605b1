"""Disconnect storm: many streaming completions against `aserve serve`, a share of whose clients hang up at random
points; afterwards the server must be idle, hold no KV block for any request, have logged no error, and still give
the same greedy answers as before the storm.

    python bench/reliability_storm.py [--requests 2000] [--disconnect 0.3] [--slow 0.1] [--concurrency 64] [--seed 0]
    python bench/reliability_storm.py --url http://127.0.0.1:8000   # a server you started (no log check)

The server it starts itself also has its RSS reported after the first 1,000 requests ended and after the drain.

Without --url it starts `aserve serve` on the tiny random model of tests/tiny_models.py with a small KV cache (so
that requests are also preempted and aborted while waiting) and `--debug-invariants` (every step and abort checks
the block ref counts and queues; a violation is logged as an error, which fails the run). Prints a JSON summary
and exits 1 if anything is wrong. tests/test_kv_integrity.py runs the same code (200 requests by default, 2,000 with
`-m slow`).

Clients that hang up do so in one of three ways, in equal shares: right after sending the request (a raw socket
closed within 0-20 ms: before the server parsed it, or while the request waits for its first step), after the
response headers but before reading any token, or after a random number of tokens (mid-stream). Another share
(--slow) reads slowly: a connection with a 2 KiB receive window asks for 20 logprobs per token (large events) and
reads nothing for 0.1-1 s, then reads it all; its text must be the same greedy answer. One whose answer is too long
for the connection's buffers, so that the server pauses its request (flow control, aserve:http_stream_pauses_total),
counts those seconds from when the server has paused a stream: a busy server may not have started it before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import tempfile
import time

import aiohttp

VOCAB = 384  # the tiny model's vocabulary (tests/tiny_models.py)
NUM_PROMPTS = 16
SERVER_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "16",
                "--num-gpu-blocks-override", "40", "--debug-invariants"]  # fmt: skip


HANG_UPS = ("at_once", "before_first_token", "mid_stream")  # how a client that hangs up does it
PAUSES = "aserve:http_stream_pauses_total"
# A slow reader's answer of this many tokens or more cannot fit in its connection's buffers (~19 events of 20
# logprobs each: aserve/entrypoints/openai/event_stream.py, SEND_BUFFER), so its request is paused while it reads
# nothing.
PAUSABLE_TOKENS = 30
# Gauges that must all be 0 once the storm has drained.
IDLE_GAUGES = ("aserve:num_requests_open", "aserve:num_requests_running", "aserve:num_requests_waiting",
               "aserve:kv_cache_usage_perc")  # fmt: skip


def prompt(i: int) -> dict:
    """Prompt i of the storm (token ids, so no tokeniser is involved): pairs share a 16-token prefix, so the prefix
    cache is exercised (and its blocks are shared between live and aborted requests)."""
    prefix = [(31 * (i // 2) + 7 * j) % (VOCAB - 2) + 2 for j in range(16)]
    suffix = [(13 * i + 5 * j) % (VOCAB - 2) + 2 for j in range(4 + i % 20)]
    return {"prompt": prefix + suffix, "max_tokens": 8 + (7 * i) % 41, "temperature": 0, "ignore_eos": True}


def parse_sse(text: str) -> list:
    events = [e for e in text.split("\n\n") if e]
    if not all(e.startswith("data: ") for e in events):
        raise ValueError(f"not an SSE body: {text[:300]!r}")
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


async def reference(session: aiohttp.ClientSession, url: str) -> list[str]:
    """Each storm prompt's greedy output, one request at a time."""
    texts = []
    for i in range(NUM_PROMPTS):
        async with session.post(f"{url}/v1/completions", json=prompt(i)) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"reference request {i}: HTTP {resp.status}: {body}")
            texts.append(body["choices"][0]["text"])
    return texts


def _completion_request(host: str, port: str, body: bytes, headers: str = "") -> bytes:
    """A POST /v1/completions of `body` as raw HTTP/1.1 (`headers`: more header lines, each ending in CRLF)."""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip


async def _hang_up_at_once(url: str, body: bytes, delay: float) -> None:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(_completion_request(host, port, body))
    await writer.drain()
    await asyncio.sleep(delay)
    writer.transport.abort()  # no FIN handshake: the connection is simply gone


def dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's data."""
    out, pos = [], 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2


async def _read_slowly(session, url: str, body: dict, delay: float) -> str:
    """A streaming request on a connection with a 2 KiB receive window that reads nothing for a while, then everything
    until the server closes the connection. -> the streamed text. An answer of PAUSABLE_TOKENS or more first waits
    until the server has paused a stream since the request was sent (its own, at the latest, once its events fill
    the buffers): a busy server may not have generated a token of it by the time a fixed delay has passed. Then it
    reads nothing for `delay` seconds more."""
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:  # a plain socket: nothing reads it before we do (asyncio's streams would)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        request = _completion_request(host, port, json.dumps(body).encode(), "Connection: close\r\n")
        pauses = metric(await metrics(session, url), PAUSES)
        await loop.sock_sendall(sock, request)
        if body["max_tokens"] >= PAUSABLE_TOKENS:
            await wait_for_pause(session, url, pauses)
        await asyncio.sleep(delay)
        parts = []
        while part := await loop.sock_recv(sock, 65536):
            parts.append(part)
    response = b"".join(parts)
    head, _, chunked = response.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise ValueError(f"not a 200 response: {response[:300]!r}")
    events = parse_sse(dechunk(chunked).decode())
    if events[-1] != "[DONE]" or any("error" in e for e in events[:-1]):
        raise ValueError(f"the stream did not end well: {events[-2:]!r}")
    return "".join(c["text"] for e in events[:-1] for c in e["choices"])


async def one(session, url: str, i: int, kind: str, rng: random.Random, expected: list[str]) -> tuple[str, str]:
    """One client. Returns (kind, problem or "")."""
    body = {**prompt(i % NUM_PROMPTS), "stream": True}
    if kind == "at_once":
        await _hang_up_at_once(url, json.dumps(body).encode(), rng.uniform(0, 0.02))
        return kind, ""
    if kind == "slow_reader":
        text = await _read_slowly(session, url, {**body, "logprobs": 20}, rng.uniform(0.1, 1.0))
        if text != expected[i % NUM_PROMPTS]:
            return kind, f"prompt {i % NUM_PROMPTS}: {text!r} != {expected[i % NUM_PROMPTS]!r} (served alone)"
        return kind, ""
    resp = await session.post(f"{url}/v1/completions", json=body)
    try:
        if resp.status != 200:
            return kind, f"HTTP {resp.status}: {(await resp.text())[:200]}"
        if kind == "before_first_token":
            return kind, ""
        if kind == "mid_stream":
            for _ in range(rng.randint(1, body["max_tokens"] - 1)):
                await resp.content.readuntil(b"\n\n")
            return kind, ""
        events = parse_sse(await resp.text())
        if events[-1] != "[DONE]":
            return kind, "the stream did not end with [DONE]"
        if any("error" in e for e in events[:-1]):
            return kind, f"error event: {events[-2]}"
        text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
        if text != expected[i % NUM_PROMPTS]:
            return kind, f"prompt {i % NUM_PROMPTS}: {text!r} != {expected[i % NUM_PROMPTS]!r} (served alone)"
        return kind, ""
    finally:
        resp.close()  # for the hang-ups: closes the connection, as a client that goes away does


async def metrics(session, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("aserve:")]
    return {name: float(value) for name, value in lines}  # name with its labels


def metric(values: dict[str, float], prefix: str) -> float:
    """The first series whose name (with labels) starts with `prefix`; 0 if none."""
    return next((v for k, v in values.items() if k.startswith(prefix)), 0.0)


async def wait_for_pause(session, url: str, pauses: float, timeout: float = 120.0) -> None:
    """Polls /metrics until the server has paused more streams than `pauses` (or `timeout` seconds have passed)."""
    deadline = time.monotonic() + timeout
    while metric(await metrics(session, url), PAUSES) <= pauses and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


async def wait_drained(session, url: str, timeout: float = 60.0) -> dict[str, float]:
    """Polls /metrics until no request is open, running or waiting and no KV block is held by a request
    (cached-evictable prefix blocks count as free in kv_cache_usage_perc)."""
    deadline = time.monotonic() + timeout
    while True:
        values = await metrics(session, url)
        if not any(metric(values, name) for name in IDLE_GAUGES) or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.05)


def rss_bytes(pid: int) -> int:
    """A process's resident set size (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def storm(url: str, num_requests: int = 2000, disconnect: float = 0.3, concurrency: int = 64, seed: int = 0,
                server_pid: int | None = None, rss_mark: int = 1000, slow: float = 0.1) -> dict:  # fmt: skip
    """Runs the storm against a live server; returns a summary with a "problems" list (empty: all good). With
    `server_pid`: the server's RSS once `rss_mark` requests have ended and after the drain."""
    rng = random.Random(seed)
    kinds = ["complete"] * num_requests
    num_hang_ups = round(disconnect * num_requests)
    for n, i in enumerate(rng.sample(range(num_requests), num_hang_ups + round(slow * num_requests))):
        kinds[i] = HANG_UPS[i % 3] if n < num_hang_ups else "slow_reader"
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        expected = await reference(session, url)
        before = await metrics(session, url)
        gate = asyncio.Semaphore(concurrency)
        ended, rss = [0], {}

        async def client(i):
            async with gate:
                try:
                    return await one(session, url, i, kinds[i], random.Random(seed * 100_003 + i), expected)
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
                    return kinds[i], f"{type(e).__name__}: {e}"
                finally:
                    ended[0] += 1
                    if server_pid is not None and ended[0] == min(rss_mark, num_requests):
                        rss["after_mark"] = rss_bytes(server_pid)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(client(i) for i in range(num_requests)))
        storm_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        after = await wait_drained(session, url)
        drain_s = time.perf_counter() - t1
        again = await reference(session, url)
        if server_pid is not None:
            rss["after_all"] = rss_bytes(server_pid)

    problems = [f"request {i} ({kind}): {p}" for i, (kind, p) in enumerate(results) if p]
    for name in IDLE_GAUGES:  # kv_cache_usage_perc > 0: KV blocks still held by requests
        if metric(after, name):
            problems.append(f"after the drain: {name} is {metric(after, name):g}, not 0")
    for i, (a, b) in enumerate(zip(expected, again)):
        if a != b:
            problems.append(f"prompt {i} after the storm: {b!r} != {a!r} before it")

    def delta(prefix):
        return metric(after, prefix) - metric(before, prefix)

    return {
        "requests": num_requests,
        "by_kind": {k: kinds.count(k) for k in ("complete", "slow_reader", *HANG_UPS)},
        "concurrency": concurrency,
        "storm_s": round(storm_s, 1),
        "drain_s": round(drain_s, 2),
        "finished": {
            r: delta(f'aserve:request_success_total{{finished_reason="{r}"')
            for r in ("stop", "length", "abort", "error")
        },  # fmt: skip
        "preemptions": delta("aserve:num_preemptions_total"),
        "stream_pauses": delta(PAUSES),
        "after_drain": {name: metric(after, name) for name in IDLE_GAUGES},
        **({"rss_mib": rss_summary(rss, min(rss_mark, num_requests), num_requests)} if rss else {}),
        "problems": problems,
    }


def rss_summary(rss: dict[str, int], mark: int, total: int) -> dict:
    mib = {f"after {mark}": round(rss["after_mark"] / 2**20, 1), f"after {total}": round(rss["after_all"] / 2**20, 1)}
    return {**mib, "growth": round(rss["after_all"] / rss["after_mark"] - 1, 4)}


def log_problems(log_text: str) -> list[str]:
    """Error-level log lines and tracebacks of the server."""
    return [line for line in log_text.splitlines() if " ERROR " in line or "Traceback" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--disconnect", type=float, default=0.3, help="share of clients that hang up")
    parser.add_argument("--slow", type=float, default=0.1, help="share of clients that pause their reading")
    parser.add_argument("--concurrency", type=int, default=64, help="clients in flight at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="an already running server (default: start the tiny model)")
    parser.add_argument("--log", default=None, help="keep the started server's log in this file")
    ns = parser.parse_args()
    if ns.url:
        result = asyncio.run(storm(ns.url, ns.requests, ns.disconnect, ns.concurrency, ns.seed, slow=ns.slow))
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from aserve_server import start_server, stop_server
        from tiny_models import make_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            model = make_tiny_model(os.path.join(tmp, "gqa"), "gqa")
            log_path = ns.log or os.path.join(tmp, "server.log")
            proc, url = start_server("--model", model, *SERVER_FLAGS, timeout=300, log_path=log_path)
            try:
                result = asyncio.run(
                    storm(url, ns.requests, ns.disconnect, ns.concurrency, ns.seed, proc.pid, slow=ns.slow)
                )
            finally:
                stop_server(proc)
            with open(log_path) as f:
                result["problems"] += [f"server log: {line}" for line in log_problems(f.read())]
    result["problems"] = result["problems"][:50]
    print(json.dumps(result, indent=2))
    sys.exit(1 if result["problems"] else 0)


if __name__ == "__main__":
    main()
