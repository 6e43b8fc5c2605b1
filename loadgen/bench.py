"""A whole loadgen invocation: find the model, size text prompts, warm up, then for each load level scrape
/metrics, run, scrape again and summarize. Only `cfg.url` is ever contacted."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import sys
import time
from collections.abc import Callable

import aiohttp
import numpy as np

from loadgen.client import Target, auth_headers
from loadgen.config import Load, RunConfig
from loadgen.records import RequestRecord
from loadgen.results import Report, RunResult
from loadgen.runner import Bounds, Runner
from loadgen.server_metrics import MetricsScraper, gauge_sample, server_delta
from loadgen.stats import summarize
from loadgen.sweep import sweep_result
from loadgen.workloads import Workload, make_workload
from loadgen.workloads.corpus import VOCABULARY

# Independent random streams per purpose, so that e.g. changing --warmup or the arrival process leaves the measured
# requests' prompts unchanged. Each sweep level has its own prompts (the same in every invocation with this seed):
# reusing one level's prompts at the next would turn them into prefix-cache hits.
_WORKLOAD_STREAM, _ARRIVAL_STREAM, _WARMUP_STREAM = 0, 1, 2


class LoadgenError(Exception):
    """A problem the user can fix (unreachable server, unknown model, ...)."""


async def run_benchmark(cfg: RunConfig, log: Callable[[str], None] = print) -> Report:
    connector = aiohttp.TCPConnector(limit=0)  # --max-concurrency, not the pool, bounds in-flight requests
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        headers = auth_headers(cfg.api_key)
        model = cfg.model or await discover_model(http, cfg.url, headers)
        target = Target(
            url=cfg.url,
            model=model,
            endpoint=cfg.endpoint,
            api_key=cfg.api_key,
            temperature=cfg.temperature,
            ignore_eos=cfg.effective_ignore_eos,
            extra_body=cfg.extra_body,
        )
        notes = []
        tokens_per_word = 1.0
        if cfg.prompt_format == "text" and cfg.workload != "file":
            measured = await measure_tokens_per_word(http, cfg.url, headers, model)
            if measured is None:
                notes.append("the server has no /tokenize: text prompts assume one token per word")
            else:
                tokens_per_word = measured
        workload = make_workload(cfg, tokens_per_word)
        log(f"loadgen: {cfg.url} model {model}, {cfg.endpoint} endpoint, workload {workload.describe()}")
        report = Report(
            created=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            url=cfg.url,
            model=model,
            endpoint=cfg.endpoint,
            workload=workload.describe(),
            tokens_per_word=tokens_per_word,
            config=cfg.public(),
            runs=[],
            notes=notes,
        )
        if cfg.warmup:
            warm = await _warmup(http, target, cfg, workload)
            report.warmup_requests, report.warmup_errors = len(warm), sum(not r.ok for r in warm)
            if report.warmup_errors == len(warm):
                raise LoadgenError(f"every warmup request failed, e.g.: {warm[0].error}")
        scraper = MetricsScraper(http, cfg.url, headers, model) if cfg.scrape_metrics else None
        for level, load in enumerate(cfg.loads()):
            run = await _run_load(http, target, cfg, workload, load, level, scraper)
            report.runs.append(run)
        if scraper is not None and all(run.server is None for run in report.runs):
            report.notes.append("the server exports no Prometheus metrics at /metrics: server-side deltas omitted")
        if cfg.sweep_param is not None:
            report.sweep = sweep_result(cfg.sweep_param, report.runs, cfg.slo_attainment)
        return report


async def _run_load(
    http, target: Target, cfg: RunConfig, workload: Workload, load: Load, level: int, scraper: MetricsScraper | None
) -> RunResult:
    bounds = Bounds(cfg.num_requests, cfg.duration)
    with _progress(cfg, load) as on_done:
        runner = Runner(
            http,
            target,
            max_concurrency=cfg.max_concurrency,
            arrival=cfg.arrival,
            burstiness=cfg.burstiness,
            request_timeout=cfg.request_timeout,
            read_timeout=cfg.read_timeout,
            on_done=on_done,
        )
        before = await scraper.scrape() if scraper is not None else None
        samples = []
        started_at, t0 = time.time(), time.perf_counter()
        poller = None
        if before is not None:
            samples.append(gauge_sample(before, 0.0))
            poller = asyncio.create_task(scraper.poll(t0, cfg.metrics_interval, samples))
        try:
            records = await runner.run(
                load,
                workload.sessions(_rng(cfg.seed, _WORKLOAD_STREAM, level)),
                bounds,
                _rng(cfg.seed, _ARRIVAL_STREAM, level),
                t0,
            )
        finally:
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
    after = await scraper.scrape() if before is not None else None
    server = None
    if after is not None:
        server = server_delta(before, after, samples + [gauge_sample(after, time.perf_counter() - t0)])
    return RunResult(
        load=load, summary=summarize(records, cfg.slo), server=server, records=records, started_at=started_at
    )


async def _warmup(http, target: Target, cfg: RunConfig, workload: Workload) -> list[RequestRecord]:
    users = min(cfg.warmup, cfg.max_concurrency or cfg.warmup)
    runner = Runner(http, target, request_timeout=cfg.request_timeout, read_timeout=cfg.read_timeout)
    return await runner.run(
        Load("concurrency", users),
        workload.sessions(_rng(cfg.seed, _WARMUP_STREAM)),
        Bounds(cfg.warmup, None),
        _rng(cfg.seed, _ARRIVAL_STREAM),
    )


def _rng(seed: int, stream: int, level: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, stream, level])


@contextlib.contextmanager
def _progress(cfg: RunConfig, load: Load):
    """A progress bar on stderr (requests done) while a load level runs; yields the per-request callback."""
    if not cfg.progress:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(
        total=cfg.num_requests, desc=load.describe(), unit="req", file=sys.stderr, dynamic_ncols=True, leave=False
    )
    failed = 0

    def on_done(record: RequestRecord) -> None:
        nonlocal failed
        failed += not record.ok
        bar.update(1)
        if failed:
            bar.set_postfix(failed=failed, refresh=False)

    try:
        yield on_done
    finally:
        bar.close()


async def discover_model(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> str:
    try:
        async with http.get(url + "/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise LoadgenError(f"GET {url}/v1/models answered HTTP {resp.status}; pass --model NAME")
            data = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise LoadgenError(f"cannot reach {url}/v1/models ({e.__class__.__name__}: {e}); is the server up?") from e
    if not data:
        raise LoadgenError(f"{url}/v1/models lists no model; pass --model NAME")
    return data[0]["id"]


async def measure_tokens_per_word(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str], model: str
) -> float | None:
    """Tokens per vocabulary word, from the server's /tokenize (vLLM's and aserve's): the difference between the
    vocabulary once and twice, so that special tokens (BOS) cancel out. None when there is no /tokenize."""
    text = " ".join(VOCABULARY)
    counts = []
    for prompt in (text, f"{text} {text}"):
        try:
            async with http.post(
                url + "/tokenize",
                json={"model": model, "prompt": prompt},
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=30),
            ) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return None
        count = body.get("count") if isinstance(body, dict) else None
        if count is None and isinstance(body, dict) and isinstance(body.get("tokens"), list):
            count = len(body["tokens"])
        if not isinstance(count, int):
            return None
        counts.append(count)
    per_word = (counts[1] - counts[0]) / len(VOCABULARY)
    return per_word if per_word > 0 else None
