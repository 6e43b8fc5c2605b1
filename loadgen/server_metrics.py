"""The server's own view of a run, from its Prometheus /metrics: counters and histogram means as deltas over the
run (scraped before and after), and gauges polled during it (peak KV usage, running and waiting requests).
Works with aserve's `aserve:` names and vLLM's `vllm:` names (including vLLM's older `gpu_` spellings)."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import msgspec

PREFIXES = ("aserve:", "vllm:")
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# Each quantity, by its candidate names without prefix (first found wins).
_PREEMPTIONS = ("num_preemptions_total",)
_PROMPT_TOKENS = ("prompt_tokens_total",)
_GENERATION_TOKENS = ("generation_tokens_total",)
_SUCCESS = ("request_success_total",)
_CACHE_QUERIES = ("prefix_cache_queries_total", "gpu_prefix_cache_queries_total")
_CACHE_HITS = ("prefix_cache_hits_total", "gpu_prefix_cache_hits_total")
_KV_USAGE = ("kv_cache_usage_perc", "gpu_cache_usage_perc")
_RUNNING = ("num_requests_running",)
_WAITING = ("num_requests_waiting",)
_TTFT = ("time_to_first_token_seconds",)
_ITL = ("inter_token_latency_seconds", "time_per_output_token_seconds")
_E2E = ("e2e_request_latency_seconds",)
_QUEUE = ("request_queue_time_seconds",)
_DRAFTS = ("spec_decode_num_drafts_total",)
_DRAFT_TOKENS = ("spec_decode_num_draft_tokens_total",)
_ACCEPTED = ("spec_decode_num_accepted_tokens_total",)


class MetricsSnapshot:
    """One scrape: samples as (name, labels, value), restricted to `model` when the server labels its series."""

    def __init__(self, samples: list[tuple[str, dict[str, str], float]], model: str | None = None) -> None:
        if model is not None and any(labels.get("model_name") == model for _, labels, _ in samples):
            samples = [s for s in samples if s[1].get("model_name", model) == model]
        self.samples = samples
        self.names = {name for name, _, _ in samples}

    def resolve(self, candidates: tuple[str, ...]) -> str | None:
        for base in candidates:
            for prefix in PREFIXES:
                if prefix + base in self.names:
                    return prefix + base
        return None

    def total(self, candidates: tuple[str, ...], suffix: str = "") -> float | None:
        """The sum over label sets of the first candidate present (`suffix`: _sum / _count of a histogram)."""
        name = self.resolve(tuple(c + suffix for c in candidates))
        if name is None:
            return None
        return sum(v for n, _, v in self.samples if n == name)

    def by_label(self, candidates: tuple[str, ...], label: str) -> dict[str, float]:
        name = self.resolve(candidates)
        out: dict[str, float] = {}
        for n, labels, v in self.samples:
            if n == name and label in labels:
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(2) or "")}
        samples.append((m.group(1), labels, value))
    return samples


class GaugeSample(msgspec.Struct, array_like=True):
    t: float  # seconds since the run started
    kv_usage: float | None  # 0-1
    running: float | None
    waiting: float | None


class ServerStats(msgspec.Struct, kw_only=True):
    """Deltas over the measured run (None: the server does not export it)."""

    preemptions: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    finished: dict[str, float] = msgspec.field(default_factory=dict)  # by finished_reason
    prefix_cache_queries: float | None = None  # tokens
    prefix_cache_hits: float | None = None
    prefix_cache_hit_rate: float | None = None
    ttft_mean_ms: float | None = None
    itl_mean_ms: float | None = None
    e2e_mean_ms: float | None = None
    queue_time_mean_ms: float | None = None
    peak_kv_usage: float | None = None
    peak_running: float | None = None
    peak_waiting: float | None = None
    spec_decode_drafts: float | None = None
    spec_decode_draft_tokens: float | None = None
    spec_decode_accepted_tokens: float | None = None
    spec_decode_acceptance_rate: float | None = None  # accepted / draft tokens
    spec_decode_mean_acceptance_length: float | None = None  # 1 + accepted / drafts: tokens per verify step
    samples: list[GaugeSample] = msgspec.field(default_factory=list)


def gauge_sample(snapshot: MetricsSnapshot, t: float) -> GaugeSample:
    return GaugeSample(t, snapshot.total(_KV_USAGE), snapshot.total(_RUNNING), snapshot.total(_WAITING))


def server_delta(before: MetricsSnapshot, after: MetricsSnapshot, samples: list[GaugeSample]) -> ServerStats:
    def delta(candidates, suffix=""):
        a, b = before.total(candidates, suffix), after.total(candidates, suffix)
        return None if a is None or b is None else b - a

    def hist_mean_ms(candidates):
        total, count = delta(candidates, "_sum"), delta(candidates, "_count")
        return None if not count or total is None else 1000.0 * total / count

    def peak(field):
        values = [getattr(s, field) for s in samples if getattr(s, field) is not None]
        return max(values) if values else None

    s = ServerStats(
        preemptions=delta(_PREEMPTIONS),
        prompt_tokens=delta(_PROMPT_TOKENS),
        generation_tokens=delta(_GENERATION_TOKENS),
        prefix_cache_queries=delta(_CACHE_QUERIES),
        prefix_cache_hits=delta(_CACHE_HITS),
        ttft_mean_ms=hist_mean_ms(_TTFT),
        itl_mean_ms=hist_mean_ms(_ITL),
        e2e_mean_ms=hist_mean_ms(_E2E),
        queue_time_mean_ms=hist_mean_ms(_QUEUE),
        peak_kv_usage=peak("kv_usage"),
        peak_running=peak("running"),
        peak_waiting=peak("waiting"),
        spec_decode_drafts=delta(_DRAFTS),
        spec_decode_draft_tokens=delta(_DRAFT_TOKENS),
        spec_decode_accepted_tokens=delta(_ACCEPTED),
        samples=samples,
    )
    start, end = before.by_label(_SUCCESS, "finished_reason"), after.by_label(_SUCCESS, "finished_reason")
    s.finished = {k: v - start.get(k, 0.0) for k, v in end.items() if v - start.get(k, 0.0)}
    if s.prefix_cache_queries:
        s.prefix_cache_hit_rate = (s.prefix_cache_hits or 0.0) / s.prefix_cache_queries
    if s.spec_decode_draft_tokens:
        s.spec_decode_acceptance_rate = (s.spec_decode_accepted_tokens or 0.0) / s.spec_decode_draft_tokens
    if s.spec_decode_drafts:
        s.spec_decode_mean_acceptance_length = 1.0 + (s.spec_decode_accepted_tokens or 0.0) / s.spec_decode_drafts
    return s


class MetricsScraper:
    """Scrapes <url>/metrics; a server without one (or a failing scrape) just yields None."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, headers: dict[str, str], model: str | None, timeout: float = 5.0
    ) -> None:
        self.http, self.url, self.headers, self.model = http, url + "/metrics", headers, model
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def scrape(self) -> MetricsSnapshot | None:
        try:
            async with self.http.get(self.url, headers=self.headers, timeout=self.timeout) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError):
            return None
        samples = parse_prometheus(text)
        if not any(name.startswith(PREFIXES) for name, _, _ in samples):
            return None
        return MetricsSnapshot(samples, self.model)

    async def poll(self, t0: float, interval: float, out: list[GaugeSample]) -> None:
        """Appends a gauge sample every `interval` seconds until cancelled (t0: the run's perf_counter start)."""
        while True:
            snapshot = await self.scrape()
            if snapshot is not None:
                out.append(gauge_sample(snapshot, time.perf_counter() - t0))
            await asyncio.sleep(interval)
