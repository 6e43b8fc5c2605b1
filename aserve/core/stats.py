"""What the engine did, for exporters (Prometheus, the periodic log line).

The engine fills a StepStats per step (latencies of the requests that advanced or finished, token counts) and keeps
running totals and gauges in EngineStats; exporters registered with `add_listener` see every StepStats.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class StepStats:
    iteration_tokens: int = 0  # tokens computed in the step (prompt chunks + decodes)
    prompt_tokens: int = 0  # prompts of requests that got their first token this step
    generation_tokens: int = 0
    num_preemptions: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    queue_time: list[float] = field(default_factory=list)
    e2e_latency: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)
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

    def on_request_finished(self, request, now: float) -> None:
        reason = request.status.finish_reason
        self._pending.finished_reasons.append(reason)
        self._pending.e2e_latency.append(now - request.arrival_time)

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
