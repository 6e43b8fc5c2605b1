"""What the engine did, and its exporters: the periodic log line, and Prometheus metrics with vLLM v1's names under
the `aserve:` prefix.

The engine fills a StepStats per step (latencies of the requests that advanced or finished, token counts) and keeps
running totals and gauges in EngineStats; exporters registered with `add_listener` see every StepStats.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import prometheus_client


@dataclass(slots=True)
class StepStats:
    iteration_tokens: int = 0  # tokens computed in the step (prompt chunks + decodes)
    prompt_tokens: int = 0  # prompts of requests that got their first token this step
    prompt_tokens_cached: int = 0  # of those, tokens served from the prefix cache
    prefill_computed_tokens: list[int] = field(default_factory=list)  # per such request, tokens computed
    generation_tokens: int = 0
    num_preemptions: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    e2e_latency: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)
    num_corrupted: int = 0  # requests ended because their logits were not finite
    # Per request whose last sample finished (vLLM's parent request): its n, and its longest sample's tokens
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)
    # Per finished sequence: (prompt tokens, generated tokens, max_tokens), and its times first scheduled -> finish,
    # first scheduled -> first token (prefill), first token -> finish (decode)
    finished_tokens: list[tuple[int, int, int | None]] = field(default_factory=list)
    inference_time: list[float] = field(default_factory=list)
    time_per_output_token: list[float] = field(default_factory=list)  # decode time / (generated - 1)
    prefill_time: list[float] = field(default_factory=list)
    decode_time: list[float] = field(default_factory=list)
    # Speculative decoding: draft runs verified, their tokens, accepted tokens by draft position.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_by_position: list[int] = field(default_factory=list)


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    steps_total: int = 0
    scheduled_tokens_total: int = 0
    finished_total: Counter = field(default_factory=Counter)  # finish reason -> count
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Gauges, refreshed after every step.
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_deferred: int = 0  # of the waiting: paused, or their grammar still compiling
    kv_cache_usage: float = 0.0
    listeners: list[Callable[[StepStats, EngineStats], None]] = field(default_factory=list)
    _pending: StepStats = field(default_factory=StepStats)

    def add_listener(self, listener: Callable[[StepStats, EngineStats], None]) -> None:
        self.listeners.append(listener)

    # -- events from the engine -------------------------------------------------------------------------------

    def on_token(self, request, now: float) -> None:
        step = self._pending
        step.generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
            step.prompt_tokens += request.num_prompt_tokens
            step.prompt_tokens_cached += max(0, request.num_cached_tokens)
            step.prefill_computed_tokens.append(request.num_prompt_tokens - max(0, request.num_cached_tokens))
            step.time_to_first_token.append(now - request.arrival_time)
            if request.scheduled_time is not None:
                step.queue_time.append(request.scheduled_time - request.arrival_time)
        else:
            step.inter_token_latency.append(now - request.last_token_time)
        request.last_token_time = now

    def on_drafts(self, num_drafted: int, num_accepted: int) -> None:
        step = self._pending
        step.spec_drafts += 1
        step.spec_draft_tokens += num_drafted
        step.spec_accepted_tokens += num_accepted
        if len(step.spec_accepted_by_position) < num_accepted:
            step.spec_accepted_by_position += [0] * (num_accepted - len(step.spec_accepted_by_position))
        for i in range(num_accepted):
            step.spec_accepted_by_position[i] += 1

    def on_corrupted(self) -> None:
        self._pending.num_corrupted += 1

    def on_request_finished(self, request, now: float) -> None:
        step = self._pending
        step.finished_reasons.append(request.status.finish_reason)
        group = request.sample_group
        if group is None:
            step.n_params.append(1)
            step.max_num_generation_tokens.append(request.num_output_tokens)
        else:
            group.num_unfinished -= 1
            group.max_num_generation_tokens = max(group.max_num_generation_tokens, request.num_output_tokens)
            if group.num_unfinished == 0:
                step.n_params.append(group.n)
                step.max_num_generation_tokens.append(group.max_num_generation_tokens)
        step.e2e_latency.append(now - request.arrival_time)
        step.finished_tokens.append((request.num_prompt_tokens, request.num_output_tokens,
                                     request.sampling_params.max_tokens))  # fmt: skip
        if request.scheduled_time is not None:
            step.inference_time.append(now - request.scheduled_time)
            if request.first_token_time is not None:
                step.prefill_time.append(request.first_token_time - request.scheduled_time)
                step.decode_time.append(now - request.first_token_time)
                if request.num_output_tokens > 1:
                    step.time_per_output_token.append((now - request.first_token_time) /
                                                      (request.num_output_tokens - 1))  # fmt: skip

    def on_step(self, num_scheduled_tokens: int, scheduler, kv_manager) -> None:
        self._pending.iteration_tokens = num_scheduled_tokens
        self.flush(scheduler, kv_manager)

    def flush(self, scheduler, kv_manager) -> None:
        """Folds the pending events into the totals, refreshes gauges and hands the step to the listeners."""
        step, self._pending = self._pending, StepStats()
        step.num_preemptions = scheduler.num_preemptions - self.num_preemptions_total
        if step.iteration_tokens:
            self.steps_total += 1
        self.scheduled_tokens_total += step.iteration_tokens
        self.prompt_tokens_total += step.prompt_tokens
        self.generation_tokens_total += step.generation_tokens
        self.finished_total.update(step.finished_reasons)
        self.spec_drafts_total += step.spec_drafts
        self.spec_draft_tokens_total += step.spec_draft_tokens
        self.spec_accepted_tokens_total += step.spec_accepted_tokens
        self.num_preemptions_total = scheduler.num_preemptions
        self.prefix_cache_queries_total = kv_manager.stats.queries
        self.prefix_cache_hits_total = kv_manager.stats.hits
        self.num_running = scheduler.num_running
        self.num_waiting = scheduler.num_waiting
        # (a pass over the queue only where a request can be deferred: thousands may wait in an offline run)
        self.num_waiting_deferred = sum(1 for r in scheduler.waiting if r.paused or (
            r.grammar is not None and not r.grammar.future.done())) if (
            scheduler.num_paused or scheduler.num_with_grammar) else 0  # fmt: skip
        self.kv_cache_usage = kv_manager.usage
        for listener in self.listeners:
            listener(step, self)


class PeriodicLogger:
    """A log line every `interval` seconds while there is work: throughput, queue, KV usage, prefix hit rate."""

    def __init__(self, log: Callable[[str], None], interval: float = 10.0) -> None:
        self.log = log
        self.interval = interval
        self._last_time = time.monotonic()
        self._last_prompt = self._last_gen = 0
        self._last_queries = self._last_hits = 0
        self._last_drafts = self._last_accepted = 0

    def __call__(self, step: StepStats, stats: EngineStats) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        prompt = stats.prompt_tokens_total - self._last_prompt
        gen = stats.generation_tokens_total - self._last_gen
        queries = stats.prefix_cache_queries_total - self._last_queries
        hits = stats.prefix_cache_hits_total - self._last_hits
        drafts = stats.spec_drafts_total - self._last_drafts
        accepted = stats.spec_accepted_tokens_total - self._last_accepted
        if prompt or gen or stats.num_running or stats.num_waiting:
            spec = f", Mean acceptance length: {1 + accepted / drafts:.2f}" if drafts else ""
            self.log(
                f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {gen / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%{spec}"
            )
        self._last_time = now
        self._last_prompt, self._last_gen = stats.prompt_tokens_total, stats.generation_tokens_total
        self._last_queries, self._last_hits = stats.prefix_cache_queries_total, stats.prefix_cache_hits_total
        self._last_drafts, self._last_accepted = stats.spec_drafts_total, stats.spec_accepted_tokens_total


# vLLM's buckets, so that histograms from both servers aggregate and `le` selectors carry over
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets of per-request token counts, to max_model_len)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class PrometheusMetrics:
    def __init__(self, model_name: str, registry: prometheus_client.CollectorRegistry | None = None,
                 cache_config: dict | None = None, max_model_len: int = 1_000_000) -> None:  # fmt: skip
        """`cache_config`: the KV cache's settings, exported as the labels of cache_config_info (vLLM's);
        `max_model_len`: where the buckets of the per-request token histograms end."""
        # no `*_created` series beside every counter and histogram (as vLLM does)
        prometheus_client.disable_created_metrics()
        self.registry = registry or prometheus_client.CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name, doc):
            return prometheus_client.Gauge(f"aserve:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return prometheus_client.Counter(f"aserve:{name}", doc, labels, registry=r).labels(model_name)

        def counter_by(name, doc, label, values=()):
            """A counter with a second label beside model_name; `values`' series exist (at 0) from the start."""
            family = prometheus_client.Counter(f"aserve:{name}", doc, [*labels, label], registry=r)
            for value in values:
                family.labels(model_name, value)
            return family

        def histogram(name, doc, buckets):
            return prometheus_client.Histogram(f"aserve:{name}", doc, labels, buckets=buckets, registry=r).labels(
                model_name
            )

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        waiting_by_reason = prometheus_client.Gauge(
            "aserve:num_requests_waiting_by_reason", "Waiting requests by reason: capacity (room in the batch), "
            "deferred (paused by flow control, or their grammar compiling); they sum to num_requests_waiting.",
            [*labels, "reason"], registry=r,
        )  # fmt: skip
        self.num_waiting_capacity = waiting_by_reason.labels(model_name, "capacity")
        self.num_waiting_deferred = waiting_by_reason.labels(model_name, "deferred")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.num_requests_open = gauge(
            "num_requests_open", "Engine requests the server holds for clients (admitted, not yet released by their "
            "handler): 0 when idle; above running + waiting, handlers that never let go of finished requests.",
        )  # fmt: skip
        self.num_preemptions = counter("num_preemptions", "Preemptions (requests recomputed later).")
        self.corrupted_requests = counter("corrupted_requests", "Requests ended because their logits were not "
                                          "finite (NaN or infinity).")  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Prompt tokens of requests that started "
                                            "generating, served from the prefix cache.")  # fmt: skip
        self._prompt_by_source = counter_by(
            "prompt_tokens_by_source", "Prompt tokens of requests that started generating, by where their KV came "
            "from.", "source", ("local_compute", "local_cache_hit"),
        )  # fmt: skip
        if cache_config:
            info = prometheus_client.Gauge("aserve:cache_config_info", "The KV cache's configuration.",
                                           sorted(cache_config), registry=r)  # fmt: skip
            info.labels(**{k: str(v) for k, v in cache_config.items()}).set(1)
        self.model_name = model_name
        self._success = counter_by(
            "request_success", "Finished requests by finish reason.", "finished_reason",
            ("stop", "length", "abort", "error"),
        )  # fmt: skip
        self._rejected = counter_by(
            "request_rejected", "Requests refused before reaching the engine, by reason (HTTP 429 / 503).", "reason",
            ("queue_full", "tokenizer_busy", "shutting_down"),
        )  # fmt: skip
        self.http_connections = gauge(
            "http_connections", "Open client connections (those refused for --limit-concurrency aside)."
        )
        self._connections_closed = counter_by(
            "http_connections_closed",
            "Client connections the server closed: before their request was read, a header or body read timeout "
            "(HTTP 408) or over --limit-concurrency (HTTP 503); mid-stream, a client that stopped reading "
            "(slow_client).",
            "reason", ("header_timeout", "body_timeout", "connection_limit", "slow_client"),
        )  # fmt: skip
        self.stream_pauses = counter(
            "http_stream_pauses", "Times a stream's requests were paused (left out of the batch) because its client "
            "had not read the events of the step before (flow control).",
        )  # fmt: skip
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                                             _REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                            _REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          _ITERATION_TOKEN_BUCKETS)  # fmt: skip
        # vLLM's per-request histograms (here per finished sequence: each of n samples counts)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished sequence.",
                                               token_buckets)  # fmt: skip
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens generated per finished "
                                                   "sequence.", token_buckets)  # fmt: skip
        self.request_params_max_tokens = histogram("request_params_max_tokens", "max_tokens per finished sequence.",
                                                   token_buckets)  # fmt: skip
        # ... and per request (once its last sample finished): its n, and the tokens of its longest sample
        self.request_params_n = histogram("request_params_n", "The n parameter per finished request.", _N_BUCKETS)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Per finished request: the tokens generated by its longest sample.",
            token_buckets,
        )  # fmt: skip
        self.request_inference_time = histogram("request_inference_time_seconds", "First scheduled to finish.",
                                                _REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.request_prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                              _REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.request_decode_time = histogram("request_decode_time_seconds", "First token to finish.",
                                             _REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Per finished sequence: first token to finish over the tokens "
            "after the first.", _ITL_BUCKETS,
        )  # fmt: skip
        self.request_prefill_kv_computed_tokens = histogram(
            "request_prefill_kv_computed_tokens", "Per sequence that started generating: prompt tokens computed (not "
            "served from the prefix cache).", token_buckets,
        )  # fmt: skip
        self.spec_drafts = counter("spec_decode_num_drafts", "Draft runs verified (requests x steps).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_by_position = counter_by(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position in the draft.", "position"
        )
        self._last_queries = self._last_hits = 0

    def __call__(self, step: StepStats, stats: EngineStats) -> None:
        """An EngineStats listener."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_waiting_capacity.set(stats.num_waiting - stats.num_waiting_deferred)
        self.num_waiting_deferred.set(stats.num_waiting_deferred)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_preemptions.inc(step.num_preemptions)
        self.corrupted_requests.inc(step.num_corrupted)
        self.prompt_tokens.inc(step.prompt_tokens)
        self.prompt_tokens_cached.inc(step.prompt_tokens_cached)
        self._prompt_by_source.labels(self.model_name, "local_cache_hit").inc(step.prompt_tokens_cached)
        self._prompt_by_source.labels(self.model_name, "local_compute").inc(
            step.prompt_tokens - step.prompt_tokens_cached
        )
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
        for value in step.prefill_computed_tokens:
            self.request_prefill_kv_computed_tokens.observe(value)
        for n, generated in zip(step.n_params, step.max_num_generation_tokens):
            self.request_params_n.observe(n)
            self.request_max_num_generation_tokens.observe(generated)
        for prompt, generated, max_tokens in step.finished_tokens:
            self.request_prompt_tokens.observe(prompt)
            self.request_generation_tokens.observe(generated)
            if max_tokens is not None:
                self.request_params_max_tokens.observe(max_tokens)
        for histogram, values in ((self.request_inference_time, step.inference_time),
                                  (self.request_prefill_time, step.prefill_time),
                                  (self.request_decode_time, step.decode_time),
                                  (self.request_time_per_output_token, step.time_per_output_token)):  # fmt: skip
            for value in values:
                histogram.observe(value)

    def on_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def on_stream_paused(self) -> None:
        self.stream_pauses.inc()

    def on_connection_closed(self, reason: str) -> None:
        self._connections_closed.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
