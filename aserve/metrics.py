"""Prometheus metrics with vLLM v1's names under the `aserve:` prefix, fed by the engine's per-step stats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from aserve.core.stats import EngineStats, StepStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class PrometheusMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # no `*_created` series beside every counter and histogram (as vLLM does)
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name, doc):
            return Gauge(f"aserve:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"aserve:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"aserve:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.num_requests_open = gauge(
            "num_requests_open", "Engine requests the server holds for clients (admitted, not yet released by their "
            "handler): 0 when idle; above running + waiting, handlers that never let go of finished requests.",
        )  # fmt: skip
        self.num_preemptions = counter("num_preemptions", "Preemptions (requests recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self._success = Counter(
            "aserve:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)
        self._rejected = Counter(
            "aserve:request_rejected",
            "Requests refused before reaching the engine, by reason (HTTP 429 / 503).",
            ["model_name", "reason"],
            registry=r,
        )
        for reason in ("queue_full", "tokenizer_busy", "shutting_down"):
            self._rejected.labels(model_name, reason)
        self.http_connections = gauge(
            "http_connections", "Open client connections (those refused for --limit-concurrency aside)."
        )
        self._connections_closed = Counter(
            "aserve:http_connections_closed",
            "Client connections the server closed: before their request was read, a header or body read timeout "
            "(HTTP 408) or over --limit-concurrency (HTTP 503); mid-stream, a client that stopped reading "
            "(slow_client).",
            ["model_name", "reason"],
            registry=r,
        )
        for reason in ("header_timeout", "body_timeout", "connection_limit", "slow_client"):
            self._connections_closed.labels(model_name, reason)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.", _TOKEN_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft runs verified (requests x steps).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_by_position = Counter(
            "aserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft.",
            ["model_name", "position"],
            registry=r,
        )
        self._last_queries = self._last_hits = 0

    def __call__(self, step: StepStats, stats: EngineStats) -> None:
        """An EngineStats listener."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_preemptions.inc(step.num_preemptions)
        self.prompt_tokens.inc(step.prompt_tokens)
        self.generation_tokens.inc(step.generation_tokens)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries_total - self._last_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits_total - self._last_hits)
        self._last_queries, self._last_hits = stats.prefix_cache_queries_total, stats.prefix_cache_hits_total
        self.spec_drafts.inc(step.spec_drafts)
        self.spec_draft_tokens.inc(step.spec_draft_tokens)
        self.spec_accepted_tokens.inc(step.spec_accepted_tokens)
        for position, count in enumerate(step.spec_accepted_by_position):
            self._spec_by_position.labels(self.model_name, str(position)).inc(count)
        for reason in step.finished_reasons:
            self._success.labels(self.model_name, reason).inc()
        for value in step.time_to_first_token:
            self.time_to_first_token.observe(value)
        for value in step.inter_token_latency:
            self.inter_token_latency.observe(value)
        for value in step.e2e_latency:
            self.e2e_request_latency.observe(value)
        for value in step.queue_time:
            self.request_queue_time.observe(value)
        if step.iteration_tokens:
            self.iteration_tokens.observe(step.iteration_tokens)

    def on_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def on_connection_closed(self, reason: str) -> None:
        self._connections_closed.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
