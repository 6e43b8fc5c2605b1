"""Engine counters, updated on the engine's own thread; exporters (Prometheus, logs) read them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    steps_total: int = 0
    scheduled_tokens_total: int = 0
    finished_total: Counter = field(default_factory=Counter)  # finish reason -> count
    # Gauges, refreshed after every step.
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0

    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens_total += num_prompt_tokens

    def on_step(self, sched, num_generated: int, scheduler, kv_manager) -> None:
        self.steps_total += 1
        self.scheduled_tokens_total += sched.num_tokens
        self.generation_tokens_total += num_generated
        self.num_running = scheduler.num_running
        self.num_waiting = scheduler.num_waiting
        self.kv_cache_usage = kv_manager.usage
        self.num_preemptions_total = scheduler.num_preemptions
        self.prefix_cache_queries_total = kv_manager.stats.queries
        self.prefix_cache_hits_total = kv_manager.stats.hits

    def on_request_finished(self, state) -> None:
        for child in state.children:
            self.finished_total[child.status.finish_reason] += 1
