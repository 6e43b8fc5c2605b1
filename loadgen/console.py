"""The console tables: one block per load level, then a sweep table."""

from __future__ import annotations

from loadgen.results import Report, RunResult
from loadgen.server_metrics import ServerStats
from loadgen.stats import Distribution, Summary

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def format_report(report: Report) -> str:
    blocks = [format_run(run) for run in report.runs]
    if report.sweep is not None:
        blocks.append(format_sweep(report))
    if report.warmup_requests:
        blocks.append(f"warmup: {report.warmup_requests} requests, {report.warmup_errors} failed (not counted)")
    blocks += [f"note: {note}" for note in report.notes]
    return "\n\n".join(blocks)


def format_run(run: RunResult) -> str:
    s = run.summary
    title = f" {run.load.describe()} | {s.num_requests} requests | {s.duration_s:.2f} s "
    lines = [f"{title:=^78}"]
    lines.append(f"{'requests':<20}{s.num_ok} ok, {s.num_errors} failed (error rate {pct(s.error_rate)})")
    lines.append(
        f"{'throughput':<20}{s.request_throughput:.2f} req/s | {s.output_throughput:.1f} output tok/s | "
        f"{s.total_token_throughput:.1f} total tok/s"
    )
    lines.append(f"{'tokens':<20}{s.prompt_tokens} prompt, {s.output_tokens} output")
    if s.slo is not None:
        lines.append(
            f"{'SLO (ms)':<20}{s.slo.describe()}: {s.slo_met}/{s.num_requests} met "
            f"({pct(s.slo_attainment)}) | goodput {s.goodput:.2f} req/s"
        )
    lines.append("")
    lines.append(f"{'(ms)':<10}" + "".join(f"{h:>11}" for h in ("mean", "median", "p90", "p99", "max", "n")))
    for label, field in LATENCIES:
        lines.append(_distribution_row(label, getattr(s, field)))
    if run.server is not None:
        lines.append("")
        lines.append(format_server(run.server))
    if s.errors:
        lines.append("")
        lines.append("errors:")
        lines += [f"  {count:>5} x {message}" for message, count in s.errors.items()]
    return "\n".join(lines)


def _distribution_row(label: str, d: Distribution | None) -> str:
    if d is None:
        return f"{label:<10}" + f"{'-':>11}" * 6
    values = (d.mean, d.median, d.p90, d.p99, d.max)
    return f"{label:<10}" + "".join(f"{v:>11.2f}" for v in values) + f"{d.count:>11}"


def format_server(server: ServerStats) -> str:
    parts = [
        ("TTFT mean", fmt(server.ttft_mean_ms, ".1f", " ms")),
        ("ITL mean", fmt(server.itl_mean_ms, ".1f", " ms")),
        ("queue mean", fmt(server.queue_time_mean_ms, ".1f", " ms")),
        ("preemptions", fmt(server.preemptions, ".0f")),
        ("prefix cache hit rate", pct(server.prefix_cache_hit_rate)),
        ("peak KV usage", pct(server.peak_kv_usage)),
        ("peak running", fmt(server.peak_running, ".0f")),
        ("peak waiting", fmt(server.peak_waiting, ".0f")),
    ]
    if server.spec_decode_draft_tokens is not None:
        parts.append(("spec-decode acceptance", pct(server.spec_decode_acceptance_rate)))
        parts.append(("mean acceptance length", fmt(server.spec_decode_mean_acceptance_length, ".2f")))
    lines = ["server (/metrics, deltas over the run):"]
    for i in range(0, len(parts), 4):
        lines.append("  " + " | ".join(f"{k} {v}" for k, v in parts[i : i + 4]))
    return "\n".join(lines)


def _p90(summary: Summary, field: str) -> str:
    d = getattr(summary, field)
    return fmt(d.p90 if d is not None else None, ".1f")


def format_sweep(report: Report) -> str:
    sweep = report.sweep
    header = (
        f"{sweep.param:>11}{'req/s':>9}{'out tok/s':>11}{'TTFT p90':>10}{'TPOT p90':>10}{'E2E p90':>10}"
        f"{'goodput':>9}{'attain':>9}{'errors':>8}  meets"
    )
    lines = [f"sweep over {sweep.param}; a level meets the SLO when {sweep.criterion}", header]
    for run, met in zip(report.runs, sweep.meets_slo):
        s = run.summary
        value = "inf" if run.load.value is None else f"{run.load.value:g}"
        lines.append(
            f"{value:>11}{s.request_throughput:>9.2f}{s.output_throughput:>11.1f}{_p90(s, 'ttft_ms'):>10}"
            f"{_p90(s, 'tpot_ms'):>10}{_p90(s, 'e2e_ms'):>10}{fmt(s.goodput, '.2f'):>9}"
            f"{pct(s.slo_attainment):>9}{s.num_errors:>8}  {'yes' if met else 'no'}"
        )
    if sweep.best_index is None:
        lines.append("no load level meets the SLO")
    else:
        lines.append(f"highest load meeting the SLO: {report.runs[sweep.best_index].load.describe()}")
    return "\n".join(lines)
