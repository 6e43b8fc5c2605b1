"""How many tokens to draft, per request and step.

Fixed k: always `num_speculative_tokens`. Adaptive ("auto"): with a per-position acceptance estimate a for the
request, k drafts yield E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per step, while the step costs
R(B, k) = (T(B (k+1)) + k T_draft(B)) / T(B) times a plain decode step of batch B (T = measured step time by token
count). Pick k maximising E / R: k = 0 wherever speculation does not pay (large batches, low acceptance).
"""

from __future__ import annotations

import bisect
import math

from aserve.spec.config import SpeculativeConfig

_PRIOR_ACCEPTED, _PRIOR_TRIALS = 1.0, 2.0  # acceptance 0.5 until observed
_DECAY = 0.9  # older observations fade: acceptance drifts within a request


class StepCostModel:
    """Step time as a function of tokens in the step, from measurements at a few sizes (log-linear between)."""

    def __init__(self, samples: dict[int, float], draft_fraction: float = 0.0) -> None:
        assert samples
        self.sizes = sorted(samples)
        self.times = [samples[n] for n in self.sizes]
        self.draft_fraction = draft_fraction  # a draft step's cost relative to a target step of the same size

    def time(self, num_tokens: int) -> float:
        sizes, times = self.sizes, self.times
        if num_tokens <= sizes[0]:
            return times[0]
        if num_tokens >= sizes[-1]:
            return times[-1] * num_tokens / sizes[-1]  # beyond the largest measurement: linear in tokens
        i = bisect.bisect_left(sizes, num_tokens)
        lo, hi = sizes[i - 1], sizes[i]
        w = (math.log(num_tokens) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return times[i - 1] + w * (times[i] - times[i - 1])

    def relative_cost(self, batch: int, k: int) -> float:
        base = self.time(batch)
        return (self.time(batch * (k + 1)) + k * self.draft_fraction * base) / base


def expected_tokens(acceptance: float, k: int) -> float:
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig, cost: StepCostModel | None = None) -> None:
        self.config = config
        self.cost = cost
        assert not config.adaptive or cost is not None, "the adaptive policy needs a cost model"

    def num_drafts(self, request, batch_size: int) -> int:
        k_max = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return k_max
        a = acceptance(request)
        best_k, best = 0, 1.0  # k = 0: one token per step at relative cost 1
        for k in range(1, k_max + 1):
            value = expected_tokens(a, k) / self.cost.relative_cost(max(batch_size, 1), k)
            if value > best * 1.02:  # demand a margin: measurement noise should not buy speculation
                best_k, best = k, value
        return best_k

    @staticmethod
    def observe(request, num_drafted: int, num_accepted: int) -> None:
        """Acceptance is per position: `num_accepted` successes in a run ended by a rejection (if any)."""
        trials = num_accepted + (1 if num_accepted < num_drafted else 0)
        request.spec_accepted = request.spec_accepted * _DECAY + num_accepted
        request.spec_trials = request.spec_trials * _DECAY + trials


def acceptance(request) -> float:
    return (request.spec_accepted + _PRIOR_ACCEPTED) / (request.spec_trials + _PRIOR_TRIALS)
