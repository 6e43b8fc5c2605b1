"""loadgen end to end against the fake server: arrivals and bounds, concurrency caps, warmup, multi-turn chat,
/metrics deltas, sweeps, the results file, the HTML report and the command line. Nothing here asserts on time."""

import asyncio
import json
import sys

import pytest

from loadgen.bench import run_benchmark
from loadgen.cli import compare_main, report_main
from loadgen.config import SLO, Load, RunConfig
from loadgen.fake_server import FakeServer
from loadgen.html_report import render_plots, write_report
from loadgen.results import load_report, save_report


@pytest.fixture
async def fake():
    async with FakeServer(token_delay=0.001) as server:
        yield server


def config(fake, **kw):
    base = dict(
        url=fake.url,
        input_len="8",
        output_len="4",
        progress=False,
        metrics_interval=0.05,
        request_timeout=10.0,
        read_timeout=5.0,
    )
    return RunConfig(**{**base, **kw})


async def bench(cfg):
    return await asyncio.wait_for(run_benchmark(cfg, log=lambda m: None), 60)


def generation_bodies(fake):
    return [body for method, path, body in fake.requests if path.startswith("/v1/") and method == "POST"]


async def test_closed_loop_respects_concurrency(fake):
    report = await bench(config(fake, concurrency=3, num_requests=12))
    (run,) = report.runs
    assert run.load == Load("concurrency", 3) and fake.max_in_flight <= 3
    assert [r.index for r in run.records] == list(range(12)) and all(r.ok for r in run.records)
    assert run.summary.output_tokens == 48 and all(r.usage_reported and r.output_tokens == 4 for r in run.records)
    assert report.model == "fake-model" and report.tokens_per_word == 2.0  # from GET /v1/models and /tokenize
    # 8 tokens at 2 tokens per word: 4 words
    assert all(len(b["prompt"].split()) == 4 and b["ignore_eos"] for b in generation_bodies(fake))


async def test_open_loop_cap_and_only_the_target_is_contacted(fake):
    report = await bench(config(fake, num_requests=10, max_concurrency=2))  # rate=inf: all at once
    records = report.runs[0].records
    assert len(records) == 10 and fake.max_in_flight <= 2
    assert all(r.scheduled == 0.0 and r.start >= r.scheduled for r in records)
    assert {(m, p) for m, p, _ in fake.requests} == {
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("GET", "/metrics"),
        ("POST", "/v1/completions"),
    }


async def test_constant_rate_and_duration_bound(fake):
    report = await bench(config(fake, arrival="constant", rate=50, duration=0.2))
    records = report.runs[0].records
    assert [r.scheduled for r in records] == pytest.approx([i * 0.02 for i in range(10)])  # none at t >= 0.2


async def test_warmup_is_not_counted(fake):
    report = await bench(config(fake, warmup=3, num_requests=5, concurrency=2))
    assert (report.warmup_requests, report.warmup_errors) == (3, 0)
    assert len(generation_bodies(fake)) == 8 and len(report.runs[0].records) == 5
    assert report.runs[0].server.preemptions == 5  # /metrics was scraped after the warmup


async def test_same_seed_same_requests(fake):
    await bench(config(fake, num_requests=6, seed=3, input_len="4:12", output_len="2:5"))
    await bench(
        config(
            fake, num_requests=6, seed=3, input_len="4:12", output_len="2:5", arrival="gamma", rate=500, burstiness=0.5
        )
    )
    await bench(config(fake, num_requests=6, seed=4, input_len="4:12", output_len="2:5"))
    bodies = generation_bodies(fake)
    first, second, third = bodies[:6], bodies[6:12], bodies[12:]
    key = lambda b: (b["prompt"], b["max_tokens"])  # noqa: E731 (send order may differ under concurrency)
    assert sorted(map(key, first)) == sorted(map(key, second)) and sorted(map(key, first)) != sorted(map(key, third))


async def test_server_metric_deltas():
    async with FakeServer(first_token_delay=0.03) as fake:
        await bench(config(fake, num_requests=2))  # earlier traffic, so that the deltas start from non-zero
        before = (fake.prompt_tokens, fake.replies)
        report = await bench(config(fake, num_requests=6, concurrency=2))
    server, summary = report.runs[0].server, report.runs[0].summary
    prompt_tokens = fake.prompt_tokens - before[0]
    assert (server.preemptions, server.generation_tokens, server.prompt_tokens) == (6, 24, prompt_tokens)
    assert prompt_tokens == summary.prompt_tokens  # the usage the client saw
    assert server.prefix_cache_hits == fake.prompt_tokens // 2 - before[0] // 2
    assert server.prefix_cache_hit_rate == server.prefix_cache_hits / prompt_tokens
    assert server.finished == {"length": 6.0}
    assert server.ttft_mean_ms == pytest.approx(30.0)
    assert server.peak_kv_usage == 0.25  # the other model's series (250.0) is not ours
    assert server.itl_mean_ms is None and server.spec_decode_acceptance_rate is None  # not exported
    assert len(server.samples) >= 2


async def test_chat_sessions_resend_the_history(fake):
    report = await bench(config(fake, workload="chat", endpoint="chat", num_turns=3, num_requests=4, concurrency=1))
    records = report.runs[0].records
    assert [(r.session, r.turn) for r in records] == [(0, 0), (0, 1), (0, 2), (1, 0)]  # cut to 4 requests
    bodies = generation_bodies(fake)
    third = bodies[2]["messages"]
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[1]["content"] == third[3]["content"] == "tok0 tok1 tok2 tok3 "  # the model's actual replies
    assert third[0] == bodies[0]["messages"][0] and third[2] == bodies[1]["messages"][2]
    assert len(bodies[3]["messages"]) == 1  # a new conversation


async def test_chat_workload_on_the_completions_endpoint(fake):
    await bench(config(fake, workload="chat", num_turns=2, num_requests=2, concurrency=1))
    first, second = (b["prompt"] for b in generation_bodies(fake))
    assert first.startswith("User: ") and first.endswith("\nAssistant:")
    assert second.startswith(first + " tok0 tok1 tok2 tok3 \nUser: ") and second.endswith("\nAssistant:")


async def test_failures_are_counted(fake, tmp_path):
    dataset = tmp_path / "mixed.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": 3}) for p in ("a", "#http500", "b", "#error")))
    report = await bench(
        config(fake, workload="file", dataset=str(dataset), num_requests=8, concurrency=2, slo=SLO(ttft_ms=10_000))
    )
    s = report.runs[0].summary
    assert (s.num_requests, s.num_ok, s.num_errors, s.error_rate) == (8, 4, 4, 0.5)
    assert s.errors == {"HTTP 500: the engine fell over": 2, "error event: out of memory": 2}
    assert (s.slo_met, s.slo_attainment) == (4, 0.5)


async def test_sweep_report_roundtrip_and_html(fake, tmp_path):
    cfg = config(
        fake, num_requests=5, sweep_param="rate", sweep_values=[100.0, float("inf")], slo=SLO(ttft_ms=60_000), warmup=1
    )
    report = await bench(cfg)
    assert [r.load for r in report.runs] == [Load("rate", 100.0), Load("rate", None)]
    assert report.sweep.meets_slo == [True, True] and report.sweep.best_index == 1
    prompts = [b["prompt"] for b in generation_bodies(fake)[1:]]  # after the warmup request
    assert len(prompts) == 10 and not set(prompts[:5]) & set(prompts[5:])  # levels do not share prompts
    path = tmp_path / "run.json"
    save_report(report, str(path))
    loaded = load_report(str(path))
    assert loaded == report
    assert loaded.config["api_key"] is None and len(loaded.runs[1].records) == 5
    pytest.importorskip("matplotlib")
    images = render_plots(loaded)
    assert sorted(images) == ["latency_cdf.png", "sweep.png", "timeline_0.png", "timeline_1.png"]
    assert all(data.startswith(b"\x89PNG") for data in images.values())
    write_report(loaded, str(tmp_path / "run.html"), str(tmp_path / "plots"))
    page = (tmp_path / "run.html").read_text()
    assert page.count('src="data:image/png;base64,') == 4 and "http://" not in page.replace(fake.url, "")
    assert "Highest load meeting it: rate=inf" in page
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(images)


async def test_command_line(fake, tmp_path, capsys):
    """`python -m loadgen` in a subprocess (this test's event loop serves the fake), then compare and report."""
    outs = []
    for seed in (0, 1):
        out = tmp_path / f"run{seed}.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loadgen",
            "--url",
            fake.url + "/v1",
            "--num-requests",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--concurrency",
            "2",
            "--seed",
            str(seed),
            "--slo",
            "ttft_ms=60000",
            "--no-progress",
            "--out",
            str(out),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, stderr.decode()
        assert "concurrency=2 | 4 requests" in stdout.decode() and "TTFT" in stdout.decode()
        assert out.exists() and out.with_suffix(".html").exists()
        outs.append(str(out))
    compare_main(outs)
    text = capsys.readouterr().out
    assert "seed: 0 -> 1" in text and "request throughput (req/s)" in text and "TTFT p99 (ms)" in text
    report_main([outs[0]])
    assert "4 ok, 0 failed" in capsys.readouterr().out
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadgen", "--rate", "1", "--concurrency", "2", stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"not both" in stderr
