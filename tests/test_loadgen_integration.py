"""loadgen against a real `aserve serve` (the embedded default model, as a subprocess): the command line at a fixed
rate, then shared prefixes and multi-turn chat over the chat endpoint. Short requests keep this to seconds."""

import asyncio
import json
import re
import subprocess
import sys
import urllib.request

import pytest
from aserve_server import running_server

from loadgen.bench import run_benchmark
from loadgen.config import RunConfig

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server_url():
    with running_server() as url:
        yield url


def server_ttft_histogram(url: str) -> tuple[float, float]:
    """(sum, count) of aserve:time_to_first_token_seconds, read straight from /metrics (not via loadgen)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for suffix in ("sum", "count"):
        m = re.search(rf'^aserve:time_to_first_token_seconds_{suffix}\{{model_name="{MODEL}"\}} (\S+)$', text, re.M)
        values[suffix] = float(m.group(1))
    return values["sum"], values["count"]


def test_cli_fixed_rate_run(server_url, tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadgen",
            "--url",
            server_url,
            "--num-requests",
            "20",
            "--rate",
            "5",
            "--arrival",
            "constant",
            "--input-len",
            "32",
            "--output-len",
            "12",
            "--slo",
            "ttft_ms=5000,tpot_ms=1000",
            "--seed",
            "0",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["model"] == MODEL and 0.9 < report["tokens_per_word"] < 1.5
    (run,) = report["runs"]
    s = run["summary"]
    assert (s["num_requests"], s["num_ok"], s["num_errors"], s["error_rate"]) == (20, 20, 0, 0.0)
    assert s["output_tokens"] == 240  # ignore_eos: exactly 12 tokens each
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput", "goodput"):
        assert s[key] > 0, key
    assert s["slo_attainment"] is not None and s["slo_met"] is not None
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[name]
        assert d["count"] > 0 and 0 < d["median"] <= d["p90"] <= d["p99"] <= d["max"], name
        assert d["mean"] > 0
    assert s["ttft_ms"]["count"] == s["tpot_ms"]["count"] == s["e2e_ms"]["count"] == 20
    records = run["records"]
    assert len(records) == 20 and all(r["ok"] and r["usage_reported"] and r["output_tokens"] == 12 for r in records)
    assert sum(r["prompt_tokens"] for r in records) == s["prompt_tokens"]
    server = run["server"]
    assert server["generation_tokens"] == 240 and server["prompt_tokens"] == s["prompt_tokens"]
    assert server["finished"] == {"length": 20.0}
    for key in (
        "preemptions",
        "prefix_cache_hit_rate",
        "ttft_mean_ms",
        "itl_mean_ms",
        "e2e_mean_ms",
        "queue_time_mean_ms",
        "peak_kv_usage",
        "peak_running",
        "peak_waiting",
    ):
        assert server[key] is not None, key
    assert 0 < server["peak_kv_usage"] <= 1 and server["samples"]
    # loadgen's client-side mean TTFT against the server's own histogram (only this run's requests so far)
    total, count = server_ttft_histogram(server_url)
    assert count == 20
    assert abs(s["ttft_ms"]["mean"] - 1000 * total / count) <= 0.25 * 1000 * total / count
    assert server["ttft_mean_ms"] == pytest.approx(1000 * total / count)
    page = out.with_suffix(".html").read_text()
    assert "<html>" in page and MODEL in page
    if "no plots: install matplotlib" not in page:
        assert page.count("data:image/png;base64,") == 2  # latency CDFs and the timeline


async def test_shared_prefix_over_chat_hits_the_prefix_cache(server_url):
    cfg = RunConfig(
        url=server_url,
        endpoint="chat",
        workload="shared-prefix",
        num_prefixes=2,
        prefix_len=64,
        input_len="16",
        output_len="8",
        num_requests=8,
        concurrency=4,
        progress=False,
        seed=1,
    )
    report = await asyncio.wait_for(run_benchmark(cfg, log=lambda m: None), 300)
    run = report.runs[0]
    assert run.summary.num_ok == 8 and run.summary.output_tokens == 64
    assert run.server.prefix_cache_hit_rate > 0.3  # ideally ~0.6: 2 of 8 requests compute their 64-token prefix


async def test_multi_turn_chat_resends_history(server_url):
    cfg = RunConfig(
        url=server_url,
        endpoint="chat",
        workload="chat",
        num_turns=2,
        input_len="16",
        output_len="8",
        num_requests=4,
        concurrency=2,
        progress=False,
    )
    report = await asyncio.wait_for(run_benchmark(cfg, log=lambda m: None), 300)
    records = report.runs[0].records
    assert all(r.ok and r.usage_reported for r in records)
    first = {r.session: r.prompt_tokens for r in records if r.turn == 0}
    second = {r.session: r.prompt_tokens for r in records if r.turn == 1}
    assert sorted(first) == sorted(second) == [0, 1]
    # turn 2 = turn 1's prompt + its reply + a new user message of ~16 tokens, as the server counted them
    assert all(second[k] > first[k] + 16 for k in first)
