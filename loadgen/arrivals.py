"""Open-loop arrival processes: when each request is sent, as offsets in seconds from the start of the run."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def arrival_offsets(
    kind: str, rate: float | None, rng: np.random.Generator, burstiness: float = 1.0
) -> Iterator[float]:
    """0, then cumulative inter-arrival gaps, endlessly. rate=None sends everything at once.

    poisson:  exponential gaps of mean 1/rate.
    gamma:    gamma gaps of shape `burstiness` and mean 1/rate (burstiness 1 is Poisson; < 1 burstier; > 1 smoother).
    constant: gaps of exactly 1/rate.
    Sending on an absolute schedule (rather than sleeping a gap after each send) keeps the rate from drifting."""
    if kind not in ("poisson", "gamma", "constant"):
        raise ValueError(f"unknown arrival process {kind!r}: use poisson, gamma or constant")
    t, k = 0.0, 0
    while True:
        yield t
        k += 1
        if rate is None:
            continue
        if kind == "constant":
            t = k / rate  # not a running sum: 10 x 0.02 must be 0.2, not 0.19999999999999998
        elif kind == "poisson":
            t += float(rng.exponential(1.0 / rate))
        else:
            t += float(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))
