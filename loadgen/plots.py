"""PNG plots (matplotlib, optional: `pip install aserve[loadgen]`): latency CDFs, latency and throughput against
load for sweeps, and a request timeline with the server's KV usage."""

from __future__ import annotations

import io
import math

from loadgen.results import RunResult

_DPI = 80
_LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


def _values_ms(run: RunResult, kind: str) -> list[float]:
    ok = [r for r in run.records if r.ok]
    if kind == "ttft":
        values = [r.ttft for r in ok if r.ttft is not None]
    elif kind == "tpot":
        values = [t for t in (r.tpot() for r in ok) if t is not None]
    elif kind == "itl":
        values = [g for r in ok for g in r.inter_token_latencies()]
    else:
        values = [r.e2e for r in ok]
    return sorted(1000.0 * v for v in values)


def latency_cdfs(runs: list[RunResult]) -> bytes:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E, one line per load level."""
    fig = _figure(9, 6)
    axes = fig.subplots(2, 2)
    for ax, (label, kind) in zip(axes.flat, _LATENCIES):
        for run in runs:
            values = _values_ms(run, kind)
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot(values, fractions, drawstyle="steps-post", label=run.load.describe())
        ax.set_title(f"{label} CDF")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    return _png(fig)


def _load_positions(runs: list[RunResult]) -> tuple[list[float], list[str]]:
    """x positions of load levels; rate=inf is drawn at twice the largest finite level."""
    finite = [r.load.value for r in runs if r.load.value is not None]
    top = 2 * max(finite) if finite else 1.0
    xs = [top if r.load.value is None else r.load.value for r in runs]
    labels = ["inf" if r.load.value is None else f"{r.load.value:g}" for r in runs]
    return xs, labels


def sweep_curves(runs: list[RunResult], param: str) -> bytes:
    """TTFT and TPOT (median, p90, p99) and throughput/goodput against the swept load."""
    fig = _figure(11, 3.8)
    axes = fig.subplots(1, 3)
    xs, labels = _load_positions(runs)
    for ax, (label, field) in zip(axes[:2], (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))):
        for stat, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [getattr(getattr(r.summary, field), stat) if getattr(r.summary, field) else math.nan for r in runs]
            ax.plot(xs, ys, style, label=stat)
        slo = runs[0].summary.slo
        bound = None if slo is None else (slo.ttft_ms if field == "ttft_ms" else slo.tpot_ms)
        if bound is not None:
            ax.axhline(bound, color="red", linewidth=1, label="SLO")
        ax.set_title(f"{label} vs {param}")
        ax.set_ylabel(f"{label} (ms)")
        ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(xs, [r.summary.request_throughput for r in runs], "o-", label="throughput")
    if runs[0].summary.goodput is not None:
        ax.plot(xs, [r.summary.goodput for r in runs], "s--", label="goodput")
    ax.set_title(f"requests/s vs {param}")
    ax.set_ylabel("req/s")
    ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel(param)
        ax.grid(alpha=0.3)
    return _png(fig)


def timeline(run: RunResult) -> bytes:
    """Top: one line per request, waiting for its first token then streaming (failures in red). Bottom: requests in
    flight as the client saw them, and the server's running/waiting requests and KV usage as /metrics reported."""
    from matplotlib.ticker import MaxNLocator

    fig = _figure(9, 6)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for r in run.records:
        if not r.ok:
            top.hlines(r.index, r.start, r.end, color="tab:red", linewidth=1.5)
            continue
        first = r.start + (r.ttft if r.ttft is not None else r.e2e)
        top.hlines(r.index, r.start, first, color="tab:orange", linewidth=1.5)
        top.hlines(r.index, first, r.end, color="tab:blue", linewidth=1.5)
    top.yaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_ylabel("request (send order)")
    top.set_title(f"request timeline ({run.load.describe()}): orange = to first token, blue = streaming, red = failed")
    top.invert_yaxis()
    edges = sorted([(r.start, 1) for r in run.records] + [(r.end, -1) for r in run.records])
    times, counts, level = [0.0], [0], 0
    for t, step in edges:
        level += step
        times.append(t)
        counts.append(level)
    bottom.plot(times, counts, drawstyle="steps-post", label="in flight (client)")
    samples = run.server.samples if run.server is not None else []
    if any(s.running is not None for s in samples):
        for field, color in (("running", "tab:purple"), ("waiting", "tab:brown")):  # a poll holds till the next
            bottom.plot(
                [s.t for s in samples],
                [getattr(s, field) for s in samples],
                ".-",
                drawstyle="steps-post",
                color=color,
                label=f"{field} (server)",
            )
    bottom.set_ylabel("requests")
    bottom.set_xlabel("seconds since the run started")
    handles, labels = bottom.get_legend_handles_labels()
    if any(s.kv_usage is not None for s in samples):
        kv = bottom.twinx()
        kv.plot(
            [s.t for s in samples],
            [100 * (s.kv_usage or 0) for s in samples],
            color="tab:green",
            drawstyle="steps-post",
            label="KV usage (server, right)",
        )
        kv.set_ylabel("KV cache usage (%)", color="tab:green")
        kv.set_ylim(0, max(5.0, 1.1 * max(100 * (s.kv_usage or 0) for s in samples)))
        more_handles, more_labels = kv.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    bottom.legend(handles, labels, fontsize=8, loc="upper left")
    bottom.grid(alpha=0.3)
    return _png(fig)
