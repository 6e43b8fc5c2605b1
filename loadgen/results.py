"""The results file (--out FILE.json): the config, then for each load level its summary, the server-side deltas and
every request's record. `loadgen compare` and `loadgen report` read it back."""

from __future__ import annotations

import msgspec

from loadgen.config import Load
from loadgen.records import RequestRecord
from loadgen.server_metrics import ServerStats
from loadgen.stats import Summary

FORMAT_VERSION = 1


class RunResult(msgspec.Struct, kw_only=True):
    load: Load
    summary: Summary
    server: ServerStats | None  # None: the server has no /metrics (or scraping was turned off)
    records: list[RequestRecord]
    started_at: float  # unix time


class SweepResult(msgspec.Struct, kw_only=True):
    param: str  # rate or concurrency
    values: list[float | None]  # None: rate=inf
    meets_slo: list[bool]
    best: float | None  # the highest value that meets it; None when none does
    best_index: int | None
    criterion: str  # what "meets the SLO" meant


class Report(msgspec.Struct, kw_only=True):
    version: int = FORMAT_VERSION
    created: str  # ISO 8601, local time
    url: str
    model: str
    endpoint: str
    workload: str  # a description, e.g. "random (input 256, output 128)"
    tokens_per_word: float  # what text prompts assumed (measured against /tokenize when available)
    config: dict  # RunConfig, API key masked
    runs: list[RunResult]
    sweep: SweepResult | None = None
    warmup_requests: int = 0
    warmup_errors: int = 0
    notes: list[str] = msgspec.field(default_factory=list)


def save_report(report: Report, path: str) -> None:
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(report), indent=1))


def load_report(path: str) -> Report:
    with open(path, "rb") as f:
        data = f.read()
    try:
        report = msgspec.json.decode(data, type=Report)
    except msgspec.DecodeError as e:
        raise ValueError(f"{path} is not a loadgen results file: {e}") from e
    if report.version != FORMAT_VERSION:
        raise ValueError(f"{path} has format version {report.version}; this loadgen reads {FORMAT_VERSION}")
    return report
