"""/health latency while `aserve serve` is overloaded: loadgen keeps far more requests in flight than --max-num-seqs
(so the queue fills and --max-queue-len turns the rest away with 429) while this script polls GET /health every
50 ms, each poll on a new connection as a load balancer's would be. Prints the poll latency percentiles, idle and
under load, and loadgen's time to first token of the admitted requests, as JSON.

    python bench/reliability_health.py [--duration 30] [--concurrency 64] [--max-num-seqs 8] [--max-queue-len 16]

The server runs the tiny random model of tests/tiny_models.py on the CPU (no GPU needed). Latencies include this
process's own scheduling delays, and loadgen and the server share the machine: they are upper bounds for /health
itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def pct(values: list[float], p: float) -> float | None:
    """The nearest-rank p-th percentile (None for no values); the reliability benches all report these."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    return {"count": len(values), "p50_ms": round(pct(values, 50) * 1e3, 2), "p99_ms": round(pct(values, 99) * 1e3, 2),
            "max_ms": round(max(values) * 1e3, 2), "mean_ms": round(statistics.fmean(values) * 1e3, 2)}  # fmt: skip


async def poll_health(url: str, stopped, interval: float = 0.05) -> tuple[list[float], dict[int, int]]:
    """GET /health every `interval` seconds until `stopped()`: (latencies, count by status; 0 = no answer)."""
    latencies, statuses = [], {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        while not stopped():
            t0 = time.perf_counter()
            try:
                async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                status = 0
            elapsed = time.perf_counter() - t0
            latencies.append(elapsed)
            statuses[status] = statuses.get(status, 0) + 1
            await asyncio.sleep(max(0.0, interval - elapsed))
    return latencies, statuses


def _until(deadline: float):
    return lambda: time.monotonic() >= deadline


async def measure(url: str, loadgen_cmd: list[str], idle_s: float, duration: float) -> dict:
    idle, idle_statuses = await poll_health(url, _until(time.monotonic() + idle_s))
    load = subprocess.Popen(loadgen_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    await asyncio.sleep(2.0)  # let the queue fill before measuring
    busy, busy_statuses = await poll_health(url, _until(time.monotonic() + duration))
    _, err = await asyncio.to_thread(load.communicate)
    if load.returncode != 0:
        raise RuntimeError(f"loadgen failed ({load.returncode}):\n{err[-2000:]}")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/metrics") as resp:
            metrics = await resp.text()

    def counter(prefix: str, label: str = "") -> float | None:
        return next((float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith(prefix) and label in line), None)  # fmt: skip

    return {
        "health_idle": {**percentiles(idle), "statuses": idle_statuses},
        "health_under_load": {**percentiles(busy), "statuses": busy_statuses},
        "rejected_429": counter("aserve:request_rejected_total{", 'reason="queue_full"'),
        "completed": counter("aserve:request_success_total{", 'finished_reason="length"'),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of /health polling under load")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of /health polling before the load")
    parser.add_argument("--concurrency", type=int, default=64, help="loadgen's closed-loop users")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queue-len", type=int, default=16)
    parser.add_argument("--out", default=None, help="also write loadgen's JSON here")
    ns = parser.parse_args()
    from aserve_server import start_server, stop_server
    from tiny_models import VOCAB_SIZE, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(os.path.join(tmp, "gqa"), "gqa")
        flags = ["--model", model, "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                 "--max-num-seqs", str(ns.max_num_seqs), "--max-queue-len", str(ns.max_queue_len),
                 "--no-debug-invariants"]  # fmt: skip
        proc, url = start_server(*flags, timeout=300, log_path=os.path.join(tmp, "server.log"))
        report = ns.out or os.path.join(tmp, "loadgen.json")
        loadgen_cmd = [sys.executable, "-m", "loadgen", "--url", url, "--workload", "random", "--prompt-format",
                       "ids", "--vocab-size", str(VOCAB_SIZE), "--input-len", "32:96", "--output-len", "16:64",
                       "--concurrency", str(ns.concurrency), "--duration", str(ns.duration + 2.0), "--no-progress",
                       "--out", report]  # fmt: skip
        try:
            result = asyncio.run(measure(url, loadgen_cmd, ns.idle, ns.duration))
        finally:
            stop_server(proc)
        with open(report) as f:
            summary = json.load(f)["runs"][0]["summary"]
        # The requests the server admitted (429s carry no first token): their time to first token stays bounded by
        # the queue limit, not by how many clients pile up behind it.
        result["admitted_ttft_ms"] = {k: round(v, 1) for k, v in summary["ttft_ms"].items() if k != "count"}
        result["admitted_ttft_ms"]["count"] = summary["ttft_ms"]["count"]
    result["server"] = {"max_num_seqs": ns.max_num_seqs, "max_queue_len": ns.max_queue_len,
                        "loadgen_concurrency": ns.concurrency}  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
