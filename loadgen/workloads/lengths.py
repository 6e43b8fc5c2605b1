"""Token-length distributions for --input-len / --output-len: a number, an inclusive range, or a lognormal."""

from __future__ import annotations

import math
from typing import Literal

import msgspec
import numpy as np


class LengthDist(msgspec.Struct, frozen=True):
    """fixed: always `a`; uniform: integers in [a, b]; lognormal: median `a`, log-space sigma `b`, rounded and
    clipped to [1, 10 * median] so that one huge draw cannot blow the server's context."""

    kind: Literal["fixed", "uniform", "lognormal"]
    a: float
    b: float = 0.0

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(int(self.a), int(self.b) + 1, size=n)]
        draws = rng.lognormal(mean=math.log(self.a), sigma=self.b, size=n)
        return [int(x) for x in np.clip(np.rint(draws), 1, 10 * self.a)]

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.a)}"
        if self.kind == "uniform":
            return f"{int(self.a)}:{int(self.b)}"
        return f"lognormal(median {self.a:g}, sigma {self.b:g})"


def parse_length(spec: str) -> LengthDist:
    """'128' -> fixed; '64:512' -> uniform in [64, 512]; 'lognormal:256:0.5' -> median 256, sigma 0.5."""
    text = spec.strip()
    try:
        if text.startswith("lognormal:"):
            median, sigma = text.removeprefix("lognormal:").split(":")
            dist = LengthDist("lognormal", float(median), float(sigma))
            ok = dist.a >= 1 and dist.b >= 0
        elif ":" in text:
            lo, hi = text.split(":")
            dist = LengthDist("uniform", int(lo), int(hi))
            ok = 1 <= dist.a <= dist.b
        else:
            dist = LengthDist("fixed", int(text))
            ok = dist.a >= 1
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"bad length {spec!r}: use a number (128), a range (64:512) or lognormal:MEDIAN:SIGMA")
    return dist
