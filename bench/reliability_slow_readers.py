"""Clients that never read their streams must not cost the others: `aserve serve` with normal streaming clients,
measured alone and then beside clients that open streams with a tiny receive window and never read them.

    python bench/reliability_slow_readers.py [--clients 16] [--stuck 32] [--requests 96] [--stream-buffer 65536]
        [--stall-timeout 5] [--model M] [--load-format dummy] [--dtype D] [--kv-cache-memory-gb 1] [--again]
        [--profile]

Phase 1 (alone): --clients closed-loop clients run --requests streaming completions (128 token-id prompt tokens, 128
generated, greedy, EOS ignored) and their output tok/s is measured. Phase 2 (beside stuck clients): --stuck raw
sockets (SO_RCVBUF 2 KiB) each send one streaming completion whose events are large (20 logprobs per token, 1,024
tokens) and never read a byte; the same normal workload then runs again. The server pauses each stuck stream's request
once its client stops taking events, and cuts it off (its request ended, KV freed) once paused for --stall-timeout
seconds (ASERVE_STREAM_STALL_TIMEOUT) or with --stream-buffer bytes waiting (ASERVE_STREAM_BUFFER). Reports both
phases' throughput and their ratio (target >= 0.95), how many stuck clients were cut off
(aserve:http_connections_closed_total{reason="slow_client"}) and after how long, the tokens generated for them, the
streams paused (aserve:http_stream_pauses_total: none while the normal clients run alone), the server's gauges
afterwards (nothing running, no KV held), and the others' tok/s in half-second bins while the stuck clients are there.
--again runs phase 2 once more beside 32 new stuck clients; --profile samples the server with py-spy during the first
phase 2 (as bench/online_vs_offline.py --profile). Default model: the embedded SmolLM2 (--model for another)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from aserve_server import start_server, stop_server  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import online_vs_offline as ovo  # noqa: E402

from loadgen.server_metrics import MetricsSnapshot, parse_prometheus  # noqa: E402


async def metrics(session: aiohttp.ClientSession, url: str) -> MetricsSnapshot:
    async with session.get(f"{url}/metrics") as r:
        return MetricsSnapshot(parse_prometheus(await r.text()))


async def normal_load(url: str, clients: int, requests: int, seed: int, times: list | None = None) -> float:
    """Output tok/s of `requests` streaming completions over `clients` closed-loop clients (`times`: gets each
    token's arrival time). Each phase has its own `seed`: prompts of its own, none found in the prefix cache."""
    queue = list(range(requests))
    tokens = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            prompt = [(seed * 7919 + i * 131 + j * 17) % 40000 + 100 for j in range(128)]
            body = {"prompt": prompt, "max_tokens": 128, "temperature": 0, "ignore_eos": True, "stream": True}
            async with session.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        n = sum(1 for c in event["choices"] if c.get("text") is not None)
                        tokens += n
                        if times is not None:
                            times.extend([time.perf_counter()] * n)

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return tokens / (time.perf_counter() - t0)


def stuck_client(port: int, i: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": f"Stream {i} of tokens that nobody reads:", "max_tokens": 1024, "logprobs": 20,
                       "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
    return sock


async def run(args) -> dict:
    env = dict(os.environ, ASERVE_STREAM_BUFFER=str(args.stream_buffer),
               ASERVE_STREAM_STALL_TIMEOUT=str(args.stall_timeout))  # fmt: skip
    old = os.environ.copy()
    os.environ.update(env)
    model = ["--model", args.model] if args.model else []
    model += ["--load-format", args.load_format, "--dtype", args.dtype]
    proc, url = start_server(*model, "--no-debug-invariants", "--max-num-seqs", str(args.clients + args.stuck),
                             "--kv-cache-memory-gb", str(args.kv_cache_memory_gb), log_path=args.log)  # fmt: skip
    os.environ.clear()
    os.environ.update(old)
    port = int(url.rsplit(":", 1)[1])
    result = {}
    try:
        await normal_load(url, args.clients, args.requests, seed=99)  # warm-up: the same load, other prompts
        result["alone_tok_s"] = await normal_load(url, args.clients, args.requests, seed=1)
        profiler = ovo.start_profiler(proc.pid, tempfile.mkdtemp(), 120) if args.profile else None
        async with aiohttp.ClientSession() as session:
            values = await metrics(session, url)
            generated_alone = values.total(("generation_tokens_total",))
            result["stream_pauses_alone"] = values.total(("http_stream_pauses_total",))
        socks = [stuck_client(port, i) for i in range(args.stuck)]
        t0 = time.perf_counter()
        times: list[float] = []
        result["beside_stuck_tok_s"] = await normal_load(url, args.clients, args.requests, seed=2, times=times)
        if profiler is not None and (raw := ovo.stop_profiler(profiler)) is not None:
            ovo.print_profile({"pass_s": time.perf_counter() - t0, **ovo.aggregate_profile(raw)})
        # the others' tok/s in half-second bins from the stuck clients' arrival
        bins = [0] * (int((times[-1] - t0) / 0.5) + 1)
        for t in times:
            bins[int((t - t0) / 0.5)] += 1
        result["beside_stuck_tok_s_by_half_second"] = [2 * b for b in bins]
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 120
            while True:
                values = await metrics(session, url)
                cut = values.by_label(("http_connections_closed_total",), "reason")["slow_client"]
                if cut >= args.stuck or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            result["stuck_cut_off"] = int(cut)
            result["seconds_until_all_cut_off"] = round(time.perf_counter() - t0, 1)
            # everything generated since the first phase but the others' tokens: the stuck streams' share
            generated = values.total(("generation_tokens_total",)) - generated_alone
            result["tokens_generated_per_stuck_client"] = round((generated - len(times)) / args.stuck, 1)
            pauses = values.total(("http_stream_pauses_total",))
            result["stream_pauses_beside"] = pauses - result["stream_pauses_alone"]
            await asyncio.sleep(1.0)
            values = await metrics(session, url)
            result["running_after"] = values.total(("num_requests_running",))
            result["kv_usage_after"] = values.total(("kv_cache_usage_perc",))
        for s in socks:
            s.close()
        if args.again:  # the same again (the first time may pay for what the server had not yet run)
            socks = [stuck_client(port, args.stuck + i) for i in range(args.stuck)]
            result["again_beside_stuck_tok_s"] = round(await normal_load(url, args.clients, args.requests, seed=3), 1)
            result["again_ratio"] = round(result["again_beside_stuck_tok_s"] / result["alone_tok_s"], 3)
            for s in socks:
                s.close()
        result["ratio"] = round(result["beside_stuck_tok_s"] / result["alone_tok_s"], 3)
        result["alone_tok_s"] = round(result["alone_tok_s"], 1)
        result["beside_stuck_tok_s"] = round(result["beside_stuck_tok_s"], 1)
    finally:
        stop_server(proc)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--stuck", type=int, default=32)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--stream-buffer", type=int, default=65536)
    p.add_argument("--stall-timeout", type=float, default=5.0, help="seconds a stuck stream may stay paused")
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights at the model's shape)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--log", default=os.devnull, help="the server's output")
    p.add_argument("--again", action="store_true", help="a second round beside new stuck clients")
    p.add_argument("--profile", action="store_true", help="py-spy on the server during the first round beside them")
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=1))
    ok = result["ratio"] >= 0.95 and result["stuck_cut_off"] == args.stuck and not result["running_after"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
