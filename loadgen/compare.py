"""`loadgen compare A.json B.json`: metric by metric, what changed from run A to run B (the one-knob A/B)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from loadgen.results import Report, RunResult

# Below this relative change a metric is reported as unchanged ("~"): run-to-run noise.
NOISE = 0.01


class MetricDiff(msgspec.Struct, kw_only=True):
    name: str
    a: float | None
    b: float | None
    delta: float | None  # b - a
    relative: float | None  # (b - a) / |a|
    verdict: str  # "better", "worse", "~" (within NOISE), "" (no direction, or a value missing)


def _latency(field: str, stat: str) -> Callable[[RunResult], float | None]:
    def get(run: RunResult) -> float | None:
        d = getattr(run.summary, field)
        return None if d is None else getattr(d, stat)

    return get


def _server(field: str) -> Callable[[RunResult], float | None]:
    return lambda run: None if run.server is None else getattr(run.server, field)


# (name, getter, which direction is better: "higher", "lower" or None)
METRICS: list[tuple[str, Callable[[RunResult], float | None], str | None]] = [
    ("request throughput (req/s)", lambda r: r.summary.request_throughput, "higher"),
    ("output throughput (tok/s)", lambda r: r.summary.output_throughput, "higher"),
    ("total throughput (tok/s)", lambda r: r.summary.total_token_throughput, "higher"),
    ("goodput (req/s)", lambda r: r.summary.goodput, "higher"),
    ("SLO attainment", lambda r: r.summary.slo_attainment, "higher"),
    ("error rate", lambda r: r.summary.error_rate, "lower"),
    *[
        (f"{label} {stat} (ms)", _latency(field, stat), "lower")
        for label, field in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
        for stat in ("mean", "median", "p90", "p99")
    ],
    ("server TTFT mean (ms)", _server("ttft_mean_ms"), "lower"),
    ("server queue time mean (ms)", _server("queue_time_mean_ms"), "lower"),
    ("server preemptions", _server("preemptions"), "lower"),
    ("server prefix cache hit rate", _server("prefix_cache_hit_rate"), "higher"),
    ("server peak KV usage", _server("peak_kv_usage"), None),
    ("server spec-decode acceptance rate", _server("spec_decode_acceptance_rate"), "higher"),
    ("server mean acceptance length", _server("spec_decode_mean_acceptance_length"), "higher"),
]


def diff(name: str, a: float | None, b: float | None, better: str | None) -> MetricDiff:
    if a is None or b is None:
        return MetricDiff(name=name, a=a, b=b, delta=None, relative=None, verdict="")
    delta = b - a
    relative = delta / abs(a) if a != 0 else None
    if delta == 0 or (relative is not None and abs(relative) < NOISE):
        verdict = "~"
    elif better is None:
        verdict = ""
    else:
        verdict = "better" if (delta > 0) == (better == "higher") else "worse"
    return MetricDiff(name=name, a=a, b=b, delta=delta, relative=relative, verdict=verdict)


def compare_runs(a: RunResult, b: RunResult) -> list[MetricDiff]:
    """Every metric that either run has."""
    diffs = [diff(name, get(a), get(b), better) for name, get, better in METRICS]
    return [d for d in diffs if d.a is not None or d.b is not None]


def pair_runs(a: Report, b: Report) -> list[tuple[RunResult, RunResult]]:
    """Single runs pair with each other whatever their load; sweeps pair by equal load levels."""
    if len(a.runs) == 1 and len(b.runs) == 1:
        return [(a.runs[0], b.runs[0])]
    by_load = {run.load: run for run in b.runs}
    return [(run, by_load[run.load]) for run in a.runs if run.load in by_load]


def config_changes(a: Report, b: Report) -> list[tuple[str, object, object]]:
    """Settings that differ between the two runs (the knob that was turned, when it was a loadgen setting)."""
    left = {"url": a.url, "model": a.model, "endpoint": a.endpoint, "workload": a.workload, **a.config}
    right = {"url": b.url, "model": b.model, "endpoint": b.endpoint, "workload": b.workload, **b.config}
    return [(k, left.get(k), right.get(k)) for k in sorted(set(left) | set(right)) if left.get(k) != right.get(k)]


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.3e}"


def format_comparison(a: Report, b: Report, name_a: str = "A", name_b: str = "B") -> str:
    lines = [f"A = {name_a}", f"B = {name_b}", ""]
    changes = config_changes(a, b)
    if changes:
        lines.append("loadgen settings that differ:")
        lines += [f"  {k}: {va!r} -> {vb!r}" for k, va, vb in changes]
        lines.append("")
    pairs = pair_runs(a, b)
    if not pairs:
        return "\n".join(lines + ["the two files share no load level to compare"])
    for run_a, run_b in pairs:
        title = (
            run_a.load.describe() if run_a.load == run_b.load else f"{run_a.load.describe()} vs {run_b.load.describe()}"
        )
        lines.append(f"{' ' + title + ' ':=^86}")
        lines.append(f"{'metric':<36}{'A':>12}{'B':>12}{'B - A':>12}{'change':>9}  verdict")
        for d in compare_runs(run_a, run_b):
            rel = "-" if d.relative is None else f"{100 * d.relative:+.1f}%"
            delta = "-" if d.delta is None else f"{d.delta:+.4g}"
            lines.append(f"{d.name:<36}{_num(d.a):>12}{_num(d.b):>12}{delta:>12}{rel:>9}  {d.verdict}")
        lines.append("")
    if a.sweep is not None and b.sweep is not None:
        lines.append(f"highest load meeting the SLO: {_best(a)} -> {_best(b)}")
    return "\n".join(lines).rstrip()


def _best(report: Report) -> str:
    if report.sweep.best_index is None:
        return "none"
    return report.runs[report.sweep.best_index].load.describe()
