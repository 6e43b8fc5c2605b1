"""Sweeps: which load levels meet the SLO, and the highest that does."""

from __future__ import annotations

from loadgen.config import Load
from loadgen.results import RunResult, SweepResult
from loadgen.stats import Summary


def meets_slo(summary: Summary, attainment: float) -> bool:
    """With an SLO: at least `attainment` of the requests met it. Without one: no request failed."""
    if summary.num_requests == 0:
        return False
    if summary.slo is None:
        return summary.num_errors == 0
    return summary.slo_attainment is not None and summary.slo_attainment >= attainment


def criterion(summary: Summary, attainment: float) -> str:
    if summary.slo is None:
        return "no failed requests (no --slo given)"
    return f">= {attainment:.0%} of requests meet {summary.slo.describe()} (ms)"


def _order(load: Load) -> float:
    return float("inf") if load.value is None else load.value


def sweep_result(param: str, runs: list[RunResult], attainment: float) -> SweepResult:
    met = [meets_slo(r.summary, attainment) for r in runs]
    best_index = None
    for i, run in enumerate(runs):
        if met[i] and (best_index is None or _order(run.load) > _order(runs[best_index].load)):
            best_index = i
    return SweepResult(
        param=param,
        values=[r.load.value for r in runs],
        meets_slo=met,
        best=None if best_index is None else runs[best_index].load.value,
        best_index=best_index,
        criterion=criterion(runs[0].summary, attainment) if runs else "",
    )
