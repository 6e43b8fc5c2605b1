"""Slow-header connections ("slowloris") against `aserve serve`: many raw TCP connections each send the start of a
request's headers and then one more byte every --byte-interval seconds, never finishing them, while a few normal
closed-loop clients stream completions. Reports when (and with what) the server closed the slow connections, the
normal clients' throughput and latency without and under the attack, and the server's open file descriptors.

    python bench/reliability_slowloris.py [--connections 200] [--byte-interval 1.0] [--duration 40] [--clients 4]
    python bench/reliability_slowloris.py --server-arg '--timeout-headers 10'   # extra `aserve serve` flags

The server runs the tiny random model of tests/tiny_models.py on the CPU (no GPU needed). Phases: (1) baseline: the
normal clients alone for --baseline-s seconds (default --duration / 2); (2) attack: the slow connections are opened,
then the normal clients run again for the same time; the attack phase ends when the server has closed every slow
connection or --duration seconds after it began. A slow connection still open at the end is "not closed".
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import resource
import shlex
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from reliability_health import pct  # noqa: E402  (bench/ is on the path of its scripts)

SLOW_START = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


async def stream_one(session: aiohttp.ClientSession, url: str, rng: random.Random, vocab: int) -> int:
    """One streaming completion of 64 random token ids: the number of output tokens (from the usage chunk)."""
    body = {"prompt": [rng.randrange(2, vocab) for _ in range(64)], "max_tokens": 32, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"completion answered {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def normal_clients(url: str, clients: int, seconds: float, vocab: int, seed: int) -> dict:
    """`clients` closed-loop streaming clients for `seconds`: output tokens/s and request latency percentiles."""
    deadline = time.monotonic() + seconds
    latencies, tokens, errors = [], [0], collections.Counter()
    timeout = aiohttp.ClientTimeout(total=120)

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    n = await stream_one(session, url, rng, vocab)
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
                    errors[type(e).__name__] += 1
                    await asyncio.sleep(0.1)
                    continue
                latencies.append(time.perf_counter() - t0)
                tokens[0] += n

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    return {"requests": len(latencies), "output_tokens": tokens[0], "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens[0] / wall, 1), "latency_p50_ms": round((pct(latencies, 50) or 0) * 1e3, 1),
            "latency_p99_ms": round((pct(latencies, 99) or 0) * 1e3, 1), "errors": dict(errors)}  # fmt: skip


class SlowConnection:
    """One connection that sends SLOW_START and then one header byte every `interval` seconds until the server
    closes it or `stop` is set."""

    def __init__(self):
        self.connected_at: float | None = None
        self.closed_after: float | None = None  # seconds from connect until the server closed the connection
        self.closed_by = ""  # "eof" (read returned b''), "reset" or "write" (a write failed)
        self.received = b""
        self.connect_error = ""

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while data := await reader.read(4096):
                self.received = (self.received + data)[:512]
            self._closed("eof")
        except (ConnectionError, OSError):
            self._closed("reset")

    def _closed(self, how: str) -> None:
        if self.closed_after is None:
            self.closed_after, self.closed_by = time.monotonic() - self.connected_at, how

    async def run(self, host: str, port: int, interval: float, stop: asyncio.Event) -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        except (OSError, asyncio.TimeoutError) as e:
            self.connect_error = f"{type(e).__name__}: {e}"[:120]
            return
        self.connected_at = time.monotonic()
        read_task = asyncio.create_task(self._read(reader))
        stop_task = asyncio.create_task(stop.wait())
        try:
            writer.write(SLOW_START)
            while True:
                await writer.drain()
                await asyncio.wait([read_task, stop_task], timeout=interval, return_when=asyncio.FIRST_COMPLETED)
                if read_task.done() or stop.is_set():
                    break
                writer.write(b"a")
        except (ConnectionError, OSError):
            self._closed("write")
        finally:
            read_task.cancel()
            stop_task.cancel()
            writer.close()

    def first_line(self) -> str:
        if self.connect_error:
            return f"connect failed ({self.connect_error})"
        if not self.received:
            return "(nothing)" if self.closed_after is not None else "(nothing; not closed)"
        return self.received.split(b"\r\n", 1)[0].decode("latin-1")[:80]


async def attack(url: str, pid: int, ns) -> dict:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    fds_before = open_fds(pid)
    stop = asyncio.Event()
    conns = [SlowConnection() for _ in range(ns.connections)]
    t0 = time.monotonic()
    tasks = [asyncio.create_task(c.run(host, int(port), ns.byte_interval, stop)) for c in conns]
    fd_peak = 0

    async def sample_fds() -> None:
        nonlocal fd_peak
        while not stop.is_set():
            fd_peak = max(fd_peak, open_fds(pid) or 0)
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample_fds())

    async def end_attack() -> None:
        """Sets `stop` once every slow connection has ended or --duration has passed; notes when, and the fds."""
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, ns.duration - (time.monotonic() - t0)))
        ended["attack_s"], ended["fds"] = round(time.monotonic() - t0, 2), open_fds(pid)
        stop.set()

    ended = {}
    ender = asyncio.create_task(end_attack())
    await asyncio.sleep(min(1.0, ns.duration / 4))  # let the slow connections open
    opened = sum(c.connected_at is not None for c in conns)
    under_attack = await normal_clients(url, ns.clients, ns.baseline_s, ns.vocab, ns.seed + 1)
    open_at_clients_end = sum(c.connected_at is not None and c.closed_after is None for c in conns)
    await ender
    await asyncio.gather(*tasks, sampler)
    await asyncio.sleep(1.0)  # the server notices the closed sockets
    closed = [c.closed_after for c in conns if c.closed_after is not None]
    return {
        "connections": ns.connections,
        "connected_when_clients_started": opened,
        "connect_errors": sum(bool(c.connect_error) for c in conns),
        "closed_by_server": len(closed),
        "not_closed": sum(c.connected_at is not None and c.closed_after is None for c in conns),
        "close_after_s": {k: round(pct(closed, p), 2) for k, p in (("min", 0), ("p50", 50), ("max", 100))}
        if closed
        else None,
        "closed_by": dict(collections.Counter(c.closed_by for c in conns if c.closed_by)),
        "sent_before_close": dict(collections.Counter(c.first_line() for c in conns)),
        "attack_s": ended["attack_s"],
        "slow_open_when_clients_ended": open_at_clients_end,
        "server_fds": {
            "before": fds_before,
            "peak": fd_peak,
            "end_of_attack": ended["fds"],
            "after_client_close": open_fds(pid),
        },
        "normal_under_attack": under_attack,
    }


async def measure(url: str, pid: int, ns) -> dict:
    async with aiohttp.ClientSession() as session:  # a warm-up request: the first steps are slower than the rest
        await stream_one(session, url, random.Random(ns.seed + 2), ns.vocab)
    baseline = await normal_clients(url, ns.clients, ns.baseline_s, ns.vocab, ns.seed)
    result = await attack(url, pid, ns)
    result["normal_baseline"] = baseline
    base, hit = baseline["tokens_per_s"], result["normal_under_attack"]["tokens_per_s"]
    result["throughput_ratio"] = round(hit / base, 3) if base else None
    return result


def table(r: dict) -> str:
    close = r["close_after_s"]
    close_s = f"{close['min']} / {close['p50']} / {close['max']} s" if close else "-"
    base, hit = r["normal_baseline"], r["normal_under_attack"]
    fds = r["server_fds"]
    rows = [
        ("slow connections closed by the server / total", f"{r['closed_by_server']} / {r['connections']}"
         + (f" ({r['not_closed']} not closed)" if r["not_closed"] else "")),
        ("close time after connect min / p50 / max", close_s),
        ("sent before close", ", ".join(f"{n}x {line!r}" for line, n in r["sent_before_close"].items())),
        ("attack phase", f"{r['attack_s']} s (slow connections still open when the clients ended: "
         f"{r['slow_open_when_clients_ended']})"),
        ("normal tokens/s baseline / under attack (ratio)",
         f"{base['tokens_per_s']} / {hit['tokens_per_s']} ({r['throughput_ratio']})"),
        ("normal latency p50 / p99 baseline", f"{base['latency_p50_ms']} / {base['latency_p99_ms']} ms"),
        ("normal latency p50 / p99 under attack", f"{hit['latency_p50_ms']} / {hit['latency_p99_ms']} ms"),
        ("normal requests (errors) baseline / under attack",
         f"{base['requests']} ({sum(base['errors'].values())}) / {hit['requests']} ({sum(hit['errors'].values())})"),
        ("server fds before / peak / end of attack / after close",
         f"{fds['before']} / {fds['peak']} / {fds['end_of_attack']} / {fds['after_client_close']}"),
    ]  # fmt: skip
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=200, help="slow-header connections")
    parser.add_argument("--byte-interval", type=float, default=1.0, help="seconds between a slow connection's bytes")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds the attack phase lasts at most")
    parser.add_argument("--baseline-s", type=float, default=None, help="seconds of normal load (--duration / 2)")
    parser.add_argument("--clients", type=int, default=4, help="normal closed-loop streaming clients")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `aserve serve` flags (repeatable, split like a shell: '--timeout-headers 30')",
    )
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    ns = parser.parse_args()
    if ns.baseline_s is None:
        ns.baseline_s = ns.duration / 2
    from aserve_server import start_server, stop_server
    from tiny_models import VOCAB_SIZE, make_tiny_model

    ns.vocab = VOCAB_SIZE
    # The server inherits this limit: file descriptors must not be what runs out first.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    extra = [arg for value in ns.server_arg for arg in shlex.split(value)]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(os.path.join(tmp, "gqa"), "gqa")
        flags = ["--model", model, "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                 "--max-num-seqs", str(ns.max_num_seqs), "--no-debug-invariants", *extra]  # fmt: skip
        proc, url = start_server(*flags, timeout=300, log_path=os.path.join(tmp, "server.log"))
        try:
            result = asyncio.run(measure(url, proc.pid, ns))
        finally:
            stop_server(proc)
    result["settings"] = {"connections": ns.connections, "byte_interval_s": ns.byte_interval,
                          "duration_s": ns.duration, "baseline_s": ns.baseline_s, "clients": ns.clients,
                          "max_num_seqs": ns.max_num_seqs, "server_args": extra}  # fmt: skip
    print(table(result))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
