"""Hostile request bodies against `aserve serve` on the default model: JSON nested 10,000 levels deep, one 30 MiB
prompt, ten 30 MiB prompts at once, and a 30 MB chat of 5,000 messages. For each it reports the status codes, the
request time, GET /health latency meanwhile (polled every 10 ms, each poll on a new connection as a load
balancer's would be), the server's memory (VmRSS / VmHWM of its process, the machine's MemAvailable) and how many
error lines the server logged.

    python bench/reliability_inputs.py [--only a,b,c,d,e] [--json out.json] [--server-arg '--timeout-body 60']

Scenarios: a = nesting (as the prompt, in an unknown field, as the whole body, as a chat message's content; then a
normal completion must still answer 200), b = one 30 MiB prompt, c = ten 30 MiB prompts at once, d = 30 MB chat,
e = idle /health baseline. Every request gives up after --timeout seconds (reported as "timeout"), so the script
ends even when the server does not answer. The peak RSS (VmHWM) is reset through /proc/PID/clear_refs before each
scenario where the kernel allows it, so its delta is that scenario's own. /health latencies include this process's
scheduling delays (it runs in a process of its own, apart from the one sending the large bodies, but on the same
machine): upper bounds for /health itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import shlex
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from reliability_health import percentiles, poll_health  # noqa: E402  (bench/ is on the path of its scripts)

MIB = 2**20
PARAGRAPH = (
    "The committee met on a grey Tuesday morning to review the proposals for the new library. Several members "
    "argued that the reading rooms should face the river, where the light is softer in the afternoon, while others "
    "preferred the quieter side of the building near the old orchard. After a long discussion about budgets, "
    "heating and the number of shelves each floor could carry, they agreed to ask the architect for two drawings "
    "and to decide at the next meeting. "
)
NEST = "[" * 10000 + "]" * 10000
ERROR_MARKERS = ("ERROR", "CRITICAL", "Traceback")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def english(n_chars: int) -> str:
    return (PARAGRAPH * (n_chars // len(PARAGRAPH) + 1))[:n_chars]


def proc_status(pid: int) -> dict:
    """VmRSS and VmHWM of process `pid` in MiB (empty once it has exited)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = round(int(value.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


def reset_hwm(pid: int) -> bool:
    """Resets the peak RSS (VmHWM) of `pid` to its current RSS (Linux: `echo 5 > /proc/PID/clear_refs`)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / MIB
    return float("nan")


class ErrorLog:
    """Reads the server log from where the previous read stopped."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0

    def fields(self) -> dict:
        """log_errors: the number of error lines since the last call; log_sample: the first of those lines and of
        the exception lines that end tracebacks."""
        with open(self.path, errors="replace") as f:
            f.seek(self.offset)
            lines = f.read().splitlines()
            self.offset = f.tell()
        errors = [line for line in lines if any(m in line for m in ERROR_MARKERS)]
        exceptions = [line for line in lines if EXCEPTION_LINE.match(line)]
        return {"log_errors": len(errors), "log_sample": (errors + exceptions)[:6]}


def _poller_main(url: str, interval: float, stop, results) -> None:
    async def main():
        results.put("ready")
        return await poll_health(url, stop.is_set, interval)

    results.put(asyncio.run(main()))


class HealthPoller:
    """Polls /health from a process of its own, so that this process's work (sending large bodies, reading their
    answers) does not delay the polls: the latencies are the server's, plus the loopback."""

    def __init__(self, url: str, interval: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop, self.results = ctx.Event(), ctx.Queue()
        self.process = ctx.Process(target=_poller_main, args=(url, interval, self.stop, self.results), daemon=True)

    async def start(self) -> None:
        self.process.start()
        await asyncio.to_thread(self.results.get, timeout=60)  # "ready"

    async def finish(self) -> tuple[list[float], dict[int, int]]:
        self.stop.set()
        result = await asyncio.to_thread(self.results.get, timeout=60)
        await asyncio.to_thread(self.process.join, 10)
        return result


async def sample_memory(pid: int, done: asyncio.Event, interval: float = 0.05) -> dict:
    """Minimum MemAvailable and maximum server VmRSS seen every `interval` seconds until `done` is set."""
    min_avail, max_rss = float("inf"), 0.0
    while not done.is_set():
        min_avail = min(min_avail, mem_available_gib())
        max_rss = max(max_rss, proc_status(pid).get("VmRSS", 0.0))
        await asyncio.sleep(interval)
    return {"min_mem_available_gib": round(min_avail, 2), "max_sampled_rss_mib": max_rss}


async def post(session: aiohttp.ClientSession, url: str, body: bytes, timeout: float) -> dict:
    """POSTs a JSON body: {status, code, message, time_s}; status is "timeout" or "error" when no answer came."""
    t0 = time.perf_counter()
    out: dict = {}
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:  # fmt: skip
            text = await resp.text(errors="replace")
            out["status"] = resp.status
            try:
                err = json.loads(text).get("error") or {}
                out["code"], out["message"] = err.get("code"), (err.get("message") or "")[:160]
            except (ValueError, AttributeError):
                out["body"] = text[:160]
    except asyncio.TimeoutError:
        out["status"] = "timeout"
    except aiohttp.ClientError as e:
        out["status"], out["message"] = "error", f"{type(e).__name__}: {e}"[:160]
    out["time_s"] = round(time.perf_counter() - t0, 3)
    return out


async def under_watch(url: str, pid: int, requests, interval: float) -> dict:
    """Runs the coroutine list `requests` at once while /health is polled and memory sampled (from 0.2 s before
    until 0.5 s after all answered)."""
    done = asyncio.Event()
    poller = HealthPoller(url, interval)
    await poller.start()
    hwm_reset = reset_hwm(pid)
    before = proc_status(pid)
    sampler = asyncio.create_task(sample_memory(pid, done))
    await asyncio.sleep(0.2)
    t0 = time.perf_counter()
    results = await asyncio.gather(*requests)
    wall = time.perf_counter() - t0
    await asyncio.sleep(0.5)
    done.set()
    (latencies, statuses), memory = await poller.finish(), await sampler
    after = proc_status(pid)
    peak_before = before.get("VmRSS", 0) if hwm_reset else before.get("VmHWM", 0)
    return {
        "results": results,
        "wall_s": round(wall, 3),
        "health": {**percentiles(latencies), "statuses": statuses},
        "rss_before_mib": before.get("VmRSS"),
        "rss_after_mib": after.get("VmRSS"),
        "hwm_delta_mib": round(after.get("VmHWM", 0) - peak_before, 1),
        "hwm_reset": hwm_reset,
        **memory,
    }  # fmt: skip


async def run(url: str, pid: int, log: ErrorLog, only: set[str], ns) -> list[dict]:
    rows = []
    comp, chat = f"{url}/v1/completions", f"{url}/v1/chat/completions"
    normal = json.dumps({"prompt": "The capital of France is", "max_tokens": 4}).encode()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        if "e" in only:
            poller = HealthPoller(url, ns.interval)
            await poller.start()
            await asyncio.sleep(2.0)
            latencies, statuses = await poller.finish()
            rows.append({"scenario": "e: idle /health", "health": {**percentiles(latencies), "statuses": statuses},
                         **log.fields()})  # fmt: skip
        if "a" in only:
            bodies = {
                "a(i): nested prompt": (comp, '{"prompt": ' + NEST + ', "max_tokens": 1}'),
                "a(ii): nested unknown field": (comp, '{"prompt": "hello", "max_tokens": 1, "junk": ' + NEST + "}"),
                "a(iii): nested whole body": (comp, NEST),
                "a(iv): nested chat content": (
                    chat, '{"messages": [{"role": "user", "content": ' + NEST + '}], "max_tokens": 1}'),
            }  # fmt: skip
            for name, (endpoint, body) in bodies.items():
                result = await post(session, endpoint, body.encode(), ns.timeout)
                rows.append({"scenario": name, **result, **log.fields()})
            result = await post(session, comp, normal, ns.timeout)
            rows.append({"scenario": "a: normal completion after", **result, **log.fields()})
        big = None
        if only & {"b", "c"}:
            big = json.dumps({"prompt": english(30 * MIB), "max_tokens": 1}).encode()
        if "b" in only:
            watched = await under_watch(url, pid, [post(session, comp, big, ns.timeout)], ns.interval)
            rows.append({"scenario": "b: one 30 MiB prompt", **watched.pop("results")[0], **watched,
                         **log.fields()})  # fmt: skip
        if "c" in only:
            watched = await under_watch(url, pid, [post(session, comp, big, ns.timeout) for _ in range(10)],
                                        ns.interval)  # fmt: skip
            results = watched.pop("results")
            rows.append({"scenario": "c: ten 30 MiB prompts", "status": [r["status"] for r in results],
                         "code": sorted({str(r.get("code")) for r in results}),
                         "time_s": max(r["time_s"] for r in results), **watched,
                         **log.fields()})  # fmt: skip
        big = None
        if "d" in only:
            text = english(6000 + len(PARAGRAPH))
            messages = [{"role": ("user", "assistant")[i % 2], "content": text[i % len(PARAGRAPH) :][:6000]}
                        for i in range(5000)]  # fmt: skip
            body = json.dumps({"messages": messages, "max_tokens": 1}).encode()
            watched = await under_watch(url, pid, [post(session, chat, body, ns.timeout)], ns.interval)
            rows.append({"scenario": f"d: chat, 5000 messages, {len(body) / 1e6:.1f} MB", **watched.pop("results")[0],
                         **watched, **log.fields()})  # fmt: skip
        if only & {"b", "c", "d"}:
            result = await post(session, comp, normal, ns.timeout)
            rows.append({"scenario": "normal completion at the end", **result, **log.fields()})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| scenario | status(es) | time | /health p99 / max | RSS / MemAvailable | log errors |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        status = r.get("status", "")
        if isinstance(status, list):
            counts = {str(s): status.count(s) for s in status}
            status = ", ".join(f"{n}x {s}" for s, n in counts.items())
        codes = r.get("code")
        if codes and codes != ["None"]:
            status = f"{status} ({', '.join(codes) if isinstance(codes, list) else codes})"
        when = f"{r['time_s']:.2f} s" if "time_s" in r else ""
        h = r.get("health", {})
        health = f"{h['p99_ms']:.1f} / {h['max_ms']:.1f} ms (p50 {h['p50_ms']:.1f})" if h.get("count") else ""
        memory = ""
        if "rss_before_mib" in r:
            memory = (
                f"RSS {r['rss_before_mib']:.0f} -> {r['rss_after_mib'] or 0:.0f} MiB, "
                f"peak +{r['hwm_delta_mib']:.0f} MiB; MemAvail min {r['min_mem_available_gib']:.2f} GiB"
            )
        lines.append(f"| {r['scenario']} | {status} | {when} | {health} | {memory} | {r.get('log_errors', '')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="a,b,c,d,e", help="comma-separated scenarios to run (of a,b,c,d,e)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds each request may take")
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between /health polls")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `aserve serve` flags (repeatable, split like a shell: '--timeout-body 60')",
    )
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    ns = parser.parse_args()
    only = {s.strip() for s in ns.only.split(",") if s.strip()}
    if not only <= set("abcde"):
        parser.error(f"--only takes a,b,c,d,e, not {ns.only!r}")
    from aserve_server import start_server, stop_server

    extra = [arg for value in ns.server_arg for arg in shlex.split(value)]
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "server.log")
        proc, url = start_server("--no-debug-invariants", *extra, timeout=300, log_path=log_path)
        log = ErrorLog(log_path)
        log.fields()  # start-up lines are not counted
        try:
            rows = asyncio.run(run(url, proc.pid, log, only, ns))
        finally:
            exit_code = proc.poll()
            stop_server(proc)
        if exit_code is not None:
            rows.append({"scenario": f"server exited with {exit_code} during the run"})
    print(table(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"server_args": extra, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
