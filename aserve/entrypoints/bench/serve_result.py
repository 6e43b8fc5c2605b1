"""`aserve bench serve`'s results, from loadgen's request records: vLLM's printed block ("Serving Benchmark Result")
and the keys of its result JSON. Counts and throughputs are loadgen's summary (tokens as the server's usage reports
them); each latency metric gets vLLM's mean, median, standard deviation and chosen percentiles, in milliseconds
(0 where there is no value, as vLLM reports it)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from loadgen.config import SLO
from loadgen.records import RequestRecord
from loadgen.stats import percentile, summarize

# metric -> (its name in the lines, its section's title)
_METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
}


def metric_values(records: list[RequestRecord], metric: str) -> list[float]:
    """A metric's values in seconds over the successful requests (ITL: every gap, pooled)."""
    ok = [r for r in records if r.ok]
    if metric == "ttft":
        return [r.ttft for r in ok if r.ttft is not None]
    if metric == "tpot":
        return [t for t in (r.tpot() for r in ok) if t is not None]
    if metric == "itl":
        return [gap for r in ok for gap in r.inter_token_latencies()]
    if metric == "e2el":
        return [r.e2e for r in ok]
    if metric == "client_queue_time":  # held back by --max-concurrency
        return [r.start - r.scheduled for r in ok]
    assert metric == "e2el_including_client_queue", metric
    return [r.e2e + r.start - r.scheduled for r in ok]


def peaks(records: list[RequestRecord]) -> tuple[float, int]:
    """vLLM's peak output token throughput (the most text chunks, ~tokens, arriving within one second, counted from
    the first send) and peak concurrency (the most successful requests in flight at once)."""
    ok = [r for r in records if r.ok]
    if not ok:
        return 0.0, 0
    t0 = min(r.start for r in ok)
    per_second = np.zeros(math.ceil(max(r.end for r in ok) - t0) + 1)
    for r in ok:
        for t in r.chunk_times:
            per_second[int(r.start + t - t0)] += 1
    # requests in flight: +1 at a send, -1 at an end; an end sorts before a send at the same time
    events = sorted([(r.start, 1) for r in ok] + [(r.end, -1) for r in ok])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    return float(per_second.max()), peak


@dataclasses.dataclass(slots=True)
class ServeSettings:
    """What the report needs to know of the run's settings."""

    request_rate: float  # inf: all at once
    max_concurrency: int | None
    goodput: dict[str, float]  # --goodput: ttft / tpot / e2el -> milliseconds
    metrics: list[str]  # --percentile-metrics
    percentiles: list[float]  # --metric-percentiles

    def slo(self) -> SLO | None:
        if not self.goodput:
            return None
        return SLO(ttft_ms=self.goodput.get("ttft"), tpot_ms=self.goodput.get("tpot"), e2e_ms=self.goodput.get("e2el"))

    def shown_metrics(self) -> list[str]:
        """The chosen metrics in vLLM's order; the client-queue ones only where --max-concurrency holds requests back
        (and, incl. the queue, under a finite rate)."""
        shown = [m for m in ("ttft", "tpot", "itl", "e2el") if m in self.metrics]
        if self.max_concurrency is not None and "client_queue_time" in self.metrics:
            shown.append("client_queue_time")
        finite = not math.isinf(self.request_rate)
        if self.max_concurrency is not None and finite and "e2el_including_client_queue" in self.metrics:
            shown.append("e2el_including_client_queue")
        return shown


def serve_result(records: list[RequestRecord], settings: ServeSettings) -> tuple[list[str], dict]:
    """(the printed block's lines, the result's fields)."""
    summary = summarize(records, settings.slo())
    peak_output, peak_concurrency = peaks(records)
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def line(label: str, value, fmt: str = "") -> None:
        lines.append("{:<40} {:<10{fmt}}".format(label, value, fmt=fmt))

    line("Successful requests:", summary.num_ok)
    line("Failed requests:", summary.num_errors)
    if settings.max_concurrency is not None:
        line("Maximum request concurrency:", settings.max_concurrency)
    if not math.isinf(settings.request_rate):
        line("Request rate configured (RPS):", settings.request_rate, ".2f")
    line("Benchmark duration (s):", summary.duration_s, ".2f")
    line("Total input tokens:", summary.prompt_tokens)
    line("Total generated tokens:", summary.output_tokens)
    line("Request throughput (req/s):", summary.request_throughput, ".2f")
    if summary.goodput is not None:
        line("Request goodput (req/s):", summary.goodput, ".2f")
    line("Output token throughput (tok/s):", summary.output_throughput, ".2f")
    line("Peak output token throughput (tok/s):", peak_output, ".2f")
    line("Peak concurrent requests:", peak_concurrency, ".2f")
    line("Total Token throughput (tok/s):", summary.total_token_throughput, ".2f")
    result = {
        "duration": summary.duration_s,
        "completed": summary.num_ok,
        "failed": summary.num_errors,
        "total_input_tokens": summary.prompt_tokens,
        "total_output_tokens": summary.output_tokens,
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.goodput,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "latencies": [r.e2e for r in records],
        "queue_times": [r.start - r.scheduled for r in records],
        "max_output_tokens_per_s": peak_output,
        "max_concurrent_requests": peak_concurrency,
    }
    for metric in settings.shown_metrics():
        name, title = _METRICS[metric]
        ms = np.asarray(metric_values(records, metric) or [0.0], dtype=np.float64) * 1000.0
        stats = {"mean": float(ms.mean()), "median": percentile(ms, 50), "std": float(ms.std())}
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        line(f"Mean {name} (ms):", stats["mean"], ".2f")
        line(f"Median {name} (ms):", stats["median"], ".2f")
        for key, value in stats.items():
            result[f"{key}_{metric}_ms"] = value
        for p in settings.percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            value = percentile(ms, p)
            line(f"P{word} {name} (ms):", value, ".2f")
            result[f"p{word}_{metric}_ms"] = value
    lines.append("=" * 50)
    return lines, result


def detailed_fields(records: list[RequestRecord]) -> dict:
    """--save-detailed's per-request lists, in send order (a failed request's output length is 0, its text what
    streamed before the failure)."""
    return {
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts": [r.ttft or 0.0 for r in records],
        "itls": [r.inter_token_latencies() for r in records],
        "generated_texts": [r.generated_text for r in records],
        "start_times": [r.start for r in records],
        "errors": [r.error for r in records],
    }
