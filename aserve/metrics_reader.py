"""`LLM.get_metrics()`'s answer, as vLLM's (vllm/v1/metrics/reader.py): the engine's Prometheus series read back from
its registry as plain objects, one per series (label set): Counter, Gauge, Histogram, and Vector for the one counter
with a position label (spec_decode_num_accepted_tokens_per_pos), whose per-position values become a list.

    for metric in llm.get_metrics():
        if isinstance(metric, Histogram):  # buckets: {"1": 0, "2": 1, ..., "+Inf": 3}
            print(metric.name, metric.labels, metric.count, metric.sum, metric.buckets)
        elif isinstance(metric, Vector):
            print(metric.name, metric.labels, metric.values)
        else:  # Counter, Gauge
            print(metric.name, metric.labels, metric.value)
"""

from __future__ import annotations

from dataclasses import dataclass

import prometheus_client
from prometheus_client.samples import Sample

PREFIX = "aserve:"
_BY_POSITION = "aserve:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Metric:
    """A series: its name (`aserve:...`, counters without the `_total` suffix) and labels (model_name, ...)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    """Counters indexed by a position label, as a list (position i at index i; positions never counted are 0)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """Cumulative bucket counts keyed by their upper bound as Prometheus writes it ("0.5", "+Inf"); `count` equals
    the "+Inf" bucket's, `sum` is the sum of the observed values."""

    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: prometheus_client.CollectorRegistry) -> list[Metric]:
    """Every `aserve:` series of `registry` now, in the registry's order."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, s.labels, s.value) for s in _samples(family)]
        elif family.type == "counter" and family.name == _BY_POSITION:
            counters = _samples(family, "_total")
            collected += [Vector(family.name, labels, values) for labels, values in _by_position(counters)]
        elif family.type == "counter":
            collected += [Counter(family.name, s.labels, int(s.value)) for s in _samples(family, "_total")]
        elif family.type == "histogram":
            collected += _histograms(family)
        else:
            raise AssertionError(f"{family.name}: a metric of type {family.type!r}")
    return collected


def _samples(family, suffix: str = "") -> list[Sample]:
    return [s for s in family.samples if s.name == family.name + suffix]


def _without(labels: dict[str, str], name: str) -> frozenset[tuple[str, str]]:
    return frozenset((k, v) for k, v in labels.items() if k != name)


def _histograms(family) -> list[Histogram]:
    """One Histogram per label set: its `_bucket` samples (by their `le`), `_count` and `_sum`."""
    buckets: dict[frozenset, dict[str, int]] = {}
    for s in _samples(family, "_bucket"):
        buckets.setdefault(_without(s.labels, "le"), {})[s.labels["le"]] = int(s.value)
    counts = {frozenset(s.labels.items()): int(s.value) for s in _samples(family, "_count")}
    sums = {frozenset(s.labels.items()): s.value for s in _samples(family, "_sum")}
    return [Histogram(family.name, dict(key), counts[key], sums[key], by_le) for key, by_le in buckets.items()]


def _by_position(samples: list[Sample]) -> list[tuple[dict[str, str], list[int]]]:
    """(labels other than position, the counts by position) per label set."""
    by_labels: dict[frozenset, dict[int, int]] = {}
    for s in samples:
        by_labels.setdefault(_without(s.labels, "position"), {})[int(s.labels["position"])] = int(s.value)
    out = []
    for key, counts in by_labels.items():
        values = [0] * (max(counts) + 1)
        for position, count in counts.items():
            values[position] = count
        out.append((dict(key), values))
    return out
