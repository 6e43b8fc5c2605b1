"""The self-contained HTML report: tables of every load level, the sweep, and the plots inlined as base64 PNGs (no
scripts, no external files), so the one file can be mailed or committed."""

from __future__ import annotations

import base64
import html
import json
import os

from loadgen import plots
from loadgen.console import LATENCIES, fmt, pct
from loadgen.results import Report, RunResult

_MAX_TIMELINES = 4  # a sweep with more levels shows the timelines of its last four

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f4f4f4; } tr.best td { background: #e8f5e9; font-weight: bold; }
img { max-width: 100%; border: 1px solid #eee; } .note { color: #8a6d3b; }
pre { background: #f8f8f8; padding: 0.8em; font-size: 0.8em; overflow-x: auto; }
"""


def render_plots(report: Report) -> dict[str, bytes]:
    """PNG name -> bytes; empty when matplotlib is not installed."""
    if not plots.available() or not report.runs:
        return {}
    out = {"latency_cdf.png": plots.latency_cdfs(report.runs)}
    if report.sweep is not None and len(report.runs) > 1:
        out["sweep.png"] = plots.sweep_curves(report.runs, report.sweep.param)
    for i, run in list(enumerate(report.runs))[-_MAX_TIMELINES:]:
        out[f"timeline_{i}.png"] = plots.timeline(run)
    return out


def write_report(report: Report, html_path: str | None = None, plots_dir: str | None = None) -> dict[str, bytes]:
    """Writes the HTML report and/or the PNGs (into plots_dir); returns the PNGs."""
    images = render_plots(report)
    if plots_dir is not None:
        os.makedirs(plots_dir, exist_ok=True)
        for name, data in images.items():
            with open(os.path.join(plots_dir, name), "wb") as f:
                f.write(data)
    if html_path is not None:
        with open(html_path, "w", encoding="utf-8") as f:
            f.write(render_html(report, images))
    return images


def _table(header: list[str], rows: list[list[str]], row_classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _img(images: dict[str, bytes], name: str, alt: str) -> str:
    if name not in images:
        return ""
    data = base64.b64encode(images[name]).decode("ascii")
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>'


def _run_section(run: RunResult, index: int, images: dict[str, bytes]) -> str:
    s = run.summary
    overview = [
        ["requests", f"{s.num_requests} ({s.num_ok} ok, {s.num_errors} failed)"],
        ["error rate", pct(s.error_rate)],
        ["duration", f"{s.duration_s:.2f} s"],
        ["request throughput", f"{s.request_throughput:.2f} req/s"],
        ["output token throughput", f"{s.output_throughput:.1f} tok/s"],
        ["total token throughput", f"{s.total_token_throughput:.1f} tok/s"],
        ["tokens (prompt / output)", f"{s.prompt_tokens} / {s.output_tokens}"],
    ]
    if s.slo is not None:
        overview += [
            ["SLO (ms)", s.slo.describe()],
            ["SLO attainment", f"{s.slo_met}/{s.num_requests} ({pct(s.slo_attainment)})"],
            ["goodput", f"{s.goodput:.2f} req/s"],
        ]
    parts = [f"<h2>{html.escape(run.load.describe())}</h2>", _table(["", "value"], overview)]
    rows = []
    for label, field in LATENCIES:
        d = getattr(s, field)
        rows.append(
            [label]
            + (
                ["-"] * 6
                if d is None
                else [f"{v:.2f}" for v in (d.mean, d.median, d.p90, d.p99, d.max)] + [str(d.count)]
            )
        )
    parts.append(_table(["latency (ms)", "mean", "median", "p90", "p99", "max", "n"], rows))
    if run.server is not None:
        sv = run.server
        server_rows = [
            ["TTFT mean (server)", fmt(sv.ttft_mean_ms, ".2f", " ms")],
            ["ITL mean (server)", fmt(sv.itl_mean_ms, ".2f", " ms")],
            ["E2E mean (server)", fmt(sv.e2e_mean_ms, ".2f", " ms")],
            ["queue time mean", fmt(sv.queue_time_mean_ms, ".2f", " ms")],
            ["preemptions", fmt(sv.preemptions, ".0f")],
            ["prompt / generation tokens", f"{fmt(sv.prompt_tokens, '.0f')} / {fmt(sv.generation_tokens, '.0f')}"],
            ["prefix cache hit rate", pct(sv.prefix_cache_hit_rate)],
            ["peak KV cache usage", pct(sv.peak_kv_usage)],
            ["peak running / waiting", f"{fmt(sv.peak_running, '.0f')} / {fmt(sv.peak_waiting, '.0f')}"],
            ["finished (by reason)", ", ".join(f"{k} {v:.0f}" for k, v in sorted(sv.finished.items())) or "-"],
        ]
        if sv.spec_decode_draft_tokens is not None:
            server_rows += [
                ["spec-decode acceptance rate", pct(sv.spec_decode_acceptance_rate)],
                ["mean acceptance length", fmt(sv.spec_decode_mean_acceptance_length, ".2f")],
            ]
        parts.append(_table(["server (/metrics deltas)", "value"], server_rows))
    if s.errors:
        parts.append(_table(["error", "count"], [[m, str(c)] for m, c in s.errors.items()]))
    parts.append(_img(images, f"timeline_{index}.png", f"request timeline, {run.load.describe()}"))
    return "\n".join(parts)


def _sweep_section(report: Report, images: dict[str, bytes]) -> str:
    sweep = report.sweep
    rows, classes = [], []
    for i, (run, met) in enumerate(zip(report.runs, sweep.meets_slo)):
        s = run.summary
        p90 = {f: (getattr(s, f).p90 if getattr(s, f) else None) for f in ("ttft_ms", "tpot_ms", "e2e_ms")}
        rows.append(
            [
                run.load.describe(),
                f"{s.request_throughput:.2f}",
                f"{s.output_throughput:.1f}",
                fmt(p90["ttft_ms"], ".1f"),
                fmt(p90["tpot_ms"], ".1f"),
                fmt(p90["e2e_ms"], ".1f"),
                fmt(s.goodput, ".2f"),
                pct(s.slo_attainment),
                str(s.num_errors),
                "yes" if met else "no",
            ]
        )
        classes.append("best" if i == sweep.best_index else "")
    best = "none" if sweep.best_index is None else report.runs[sweep.best_index].load.describe()
    header = [
        "load",
        "req/s",
        "out tok/s",
        "TTFT p90",
        "TPOT p90",
        "E2E p90",
        "goodput",
        "attainment",
        "errors",
        "meets SLO",
    ]
    return "\n".join(
        [
            "<h2>Sweep</h2>",
            f"<p>A level meets the SLO when {html.escape(sweep.criterion)}. "
            f"<b>Highest load meeting it: {html.escape(best)}</b>.</p>",
            _table(header, rows, classes),
            _img(images, "sweep.png", "latency and throughput against load"),
        ]
    )


def render_html(report: Report, images: dict[str, bytes]) -> str:
    meta = [
        ["created", report.created],
        ["server", report.url],
        ["model", report.model],
        ["endpoint", report.endpoint],
        ["workload", report.workload],
        ["tokens per word (text prompts)", f"{report.tokens_per_word:.3f}"],
    ]
    if report.warmup_requests:
        meta.append(["warmup (not counted)", f"{report.warmup_requests} requests, {report.warmup_errors} failed"])
    body = [f"<h1>loadgen report: {html.escape(report.model)}</h1>", _table(["run", ""], meta)]
    body += [f'<p class="note">note: {html.escape(n)}</p>' for n in report.notes]
    if not images:
        body.append('<p class="note">no plots: install matplotlib (pip install "aserve[loadgen]")</p>')
    if report.sweep is not None:
        body.append(_sweep_section(report, images))
    body.append("<h2>Latency distributions</h2>")
    body.append(_img(images, "latency_cdf.png", "latency CDFs"))
    body += [_run_section(run, i, images) for i, run in enumerate(report.runs)]
    body.append("<h2>Configuration</h2>")
    body.append(f"<pre>{html.escape(json.dumps(report.config, indent=1, default=str))}</pre>")
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>loadgen: {html.escape(report.model)}'
        f"</title><style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
