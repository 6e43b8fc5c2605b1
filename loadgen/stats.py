"""Statistics of a run, from its per-request records alone: latency distributions, throughput, errors, goodput.

Definitions (every latency is measured by the client, from sending the request):
  TTFT  time to the first chunk that carries text
  E2E   time to the end of the stream
  TPOT  per request, (E2E - TTFT) / (n_out - 1), for requests with n_out >= 2 (n_out from the server's usage)
  ITL   every gap between consecutive text chunks, pooled over all requests
Percentiles are numpy's default "linear" method: the q-th percentile of n sorted values v is
v[floor(h)] + (h - floor(h)) * (v[floor(h) + 1] - v[floor(h)]) with h = (n - 1) * q / 100.
Only successful requests enter the latency and token statistics; the duration is from the first send to the last
end (failures included), and every throughput is per second of that duration."""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np

from loadgen.config import SLO
from loadgen.records import RequestRecord


class Distribution(msgspec.Struct, kw_only=True):
    """A latency distribution in milliseconds."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    max: float


class Summary(msgspec.Struct, kw_only=True):
    num_requests: int
    num_ok: int
    num_errors: int
    error_rate: float
    duration_s: float
    request_throughput: float  # successful requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    prompt_tokens: int
    output_tokens: int
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None
    slo: SLO | None = None
    slo_met: int | None = None  # requests meeting every SLO bound
    slo_attainment: float | None = None  # slo_met / num_requests
    goodput: float | None = None  # slo_met / duration_s
    errors: dict[str, int] = msgspec.field(default_factory=dict)  # the most common error messages


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="linear"))


def distribution(seconds: list[float]) -> Distribution | None:
    if not seconds:
        return None
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return Distribution(
        count=len(ms),
        mean=float(ms.mean()),
        median=percentile(ms, 50),
        p90=percentile(ms, 90),
        p99=percentile(ms, 99),
        max=float(ms.max()),
    )


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    if not record.ok:
        return False
    if slo.ttft_ms is not None and (record.ttft is None or record.ttft * 1000.0 > slo.ttft_ms):
        return False
    tpot = record.tpot()
    if slo.tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo.tpot_ms:
        return False
    return slo.e2e_ms is None or record.e2e * 1000.0 <= slo.e2e_ms


def run_duration(records: list[RequestRecord]) -> float:
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)


def summarize(records: list[RequestRecord], slo: SLO | None = None, max_error_kinds: int = 10) -> Summary:
    ok = [r for r in records if r.ok]
    duration = run_duration(records)

    def per_second(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    errors = Counter(r.error[:160] for r in records if not r.ok)
    summary = Summary(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        error_rate=(len(records) - len(ok)) / len(records) if records else 0.0,
        duration_s=duration,
        request_throughput=per_second(len(ok)),
        output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(prompt_tokens + output_tokens),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        ttft_ms=distribution([r.ttft for r in ok if r.ttft is not None]),
        tpot_ms=distribution([t for t in (r.tpot() for r in ok) if t is not None]),
        itl_ms=distribution([gap for r in ok for gap in r.inter_token_latencies()]),
        e2e_ms=distribution([r.e2e for r in ok]),
        errors=dict(errors.most_common(max_error_kinds)),
    )
    if slo is not None:
        met = sum(meets_slo(r, slo) for r in records)
        summary.slo, summary.slo_met = slo, met
        summary.slo_attainment = met / len(records) if records else 0.0
        summary.goodput = per_second(met)
    return summary
