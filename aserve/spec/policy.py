"""How many tokens to draft, per request and step.

Fixed k: always `num_speculative_tokens`. Adaptive ("auto"): with a per-position acceptance estimate a for the
request, k drafts yield E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per step, while the step costs
R(B, k) = (T(B (k+1)) + k T_draft(B)) / T(B) times a plain decode step of batch B (T = step time by token count,
seeded at start-up and then measured on the engine's own decode/verify steps). Pick k maximising E / R: k = 0
wherever speculation does not pay (large batches, low acceptance).

With async scheduling a step is launched before the previous one's tokens reach the host, except after a step that
drafts or verifies: the drafts follow its sampled token. Drafting then also costs the host's time between steps
that the overlap would have hidden (`StepCostModel.sync_overhead`, measured by the engine), and a request for
drafts that comes back empty (no n-gram match) costs it too, so it counts as a rejected draft.

A request at k = 0 is never observed, so its estimate could never rise again: now and then all such requests draft
one token together (one step without overlap for the batch, not one per request). The first probe comes after
PROBE_EVERY steps; while no draft is accepted anywhere the interval doubles (up to MAX_PROBE_EVERY), so that at an
acceptance near 0 probing costs next to nothing, and an accepted draft brings it back to PROBE_EVERY.

R(B, k) is the same for every request of a step: it is computed once per batch size until the cost model
changes.
"""

from __future__ import annotations

import bisect
import math

from aserve.spec.config import SpeculativeConfig

_PRIOR_ACCEPTED, _PRIOR_TRIALS = 1.0, 2.0  # acceptance 0.5 until observed
_DECAY = 0.9  # older observations fade: acceptance drifts within a request
PROBE_EVERY = 32  # steps before a probe of the requests the adaptive policy holds at k = 0, at first
MAX_PROBE_EVERY = 512  # the most steps between probes (after probes that found nothing)


def _interpolate(sizes: list[int], times: list[float], num_tokens: int) -> float:
    """Time at `num_tokens` from points (sorted sizes): log-linear between them, the first below, linear in tokens
    beyond the last."""
    if num_tokens <= sizes[0]:
        return times[0]
    if num_tokens >= sizes[-1]:
        return times[-1] * num_tokens / sizes[-1]
    i = bisect.bisect_left(sizes, num_tokens)
    if sizes[i] == num_tokens:
        return times[i]
    lo, hi = sizes[i - 1], sizes[i]
    w = (math.log(num_tokens) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return times[i - 1] + w * (times[i] - times[i - 1])


class StepCostModel:
    """Step time as a function of tokens in the step (log-linear between known sizes, linear beyond the largest).

    Seeded with start-up measurements and corrected online: the engine reports every decode/verify step's time
    (`observe`), kept per exact token count as an exponential moving average. Start-up timings are rough (a cold
    CPU, compilation, other load), so what matters is that the sizes the policy actually uses get measured as it
    uses them: a wrong seed costs a few steps, not the whole run. Times are made non-decreasing in tokens (a step
    with more tokens never costs less), which also damps noise."""

    def __init__(self, samples: dict[int, float], draft_fraction: float = 0.0, alpha: float = 0.2) -> None:
        assert samples
        self.seed = dict(samples)
        self.seen: dict[int, float] = {}
        self.alpha = alpha
        self.draft_fraction = draft_fraction  # a draft step's cost relative to a target step of the same size
        # Seconds a step without overlap adds (async scheduling: host work the overlap hides otherwise); 0 when
        # steps never overlap.
        self.sync_overhead = 0.0
        self.version = 0  # counts changes: what a consumer computed from the model is stale when it moves
        self._rebuild()

    def _rebuild(self) -> None:
        """Measured sizes as measured; seed points only beyond the largest measured size, rescaled to meet it (the
        seed gives the curve's shape there, not its level: a start-up timing taken under load must not dominate)."""
        points = dict(self.seen)
        if points:
            top = max(points)
            scale = points[top] / self._seed_time(top)
            points.update({n: t * scale for n, t in self.seed.items() if n > top})
        else:
            points = dict(self.seed)
        self.version += 1
        self.sizes = sorted(points)
        times, running = [], 0.0
        for n in self.sizes:
            running = max(running, points[n])
            times.append(running)
        self.times = times

    def _seed_time(self, num_tokens: int) -> float:
        sizes = sorted(self.seed)
        return _interpolate(sizes, [self.seed[n] for n in sizes], num_tokens)

    def observe(self, num_tokens: int, seconds: float) -> None:
        old = self.seen.get(num_tokens)
        self.seen[num_tokens] = seconds if old is None else old + self.alpha * (seconds - old)
        self._rebuild()

    def observe_sync_overhead(self, seconds: float) -> None:
        self.sync_overhead += self.alpha * (seconds - self.sync_overhead)
        self.version += 1

    def time(self, num_tokens: int) -> float:
        return _interpolate(self.sizes, self.times, num_tokens)

    def relative_cost(self, batch: int, k: int) -> float:
        base = self.time(batch)
        return (self.time(batch * (k + 1)) + k * self.draft_fraction * base + self.sync_overhead) / base


def expected_tokens(acceptance: float, k: int) -> float:
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig, cost: StepCostModel | None = None, overlap: bool = False) -> None:
        self.config = config
        self.cost = cost
        self.overlap = overlap  # async scheduling: drafting costs the overlap of the step after it
        assert not config.adaptive or cost is not None, "the adaptive policy needs a cost model"
        self._steps = 0
        self._probe = False
        self._interval = PROBE_EVERY  # steps from the last probe (or the start) to the next
        self._next_probe = PROBE_EVERY
        # batch size -> R(B, k) for k = 1..k_max, for the cost model's version _costs_version
        self._costs: dict[int, list[float]] = {}
        self._costs_version = -1

    def begin_step(self) -> None:
        """The scheduler starts a step; it may probe the requests held at k = 0 (module docstring)."""
        self._steps += 1
        self._probe = self._steps >= self._next_probe
        if self._probe:
            self._interval = min(2 * self._interval, MAX_PROBE_EVERY)
            self._next_probe = self._steps + self._interval

    @property
    def empty_is_rejection(self) -> bool:
        """Does an empty proposal count as a rejected draft (it cost the overlap, and gave nothing)?"""
        return self.overlap

    def num_drafts(self, request, batch_size: int) -> int:
        k_max = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return k_max
        if self._costs_version != self.cost.version:  # the cost model learnt something
            self._costs.clear()
            self._costs_version = self.cost.version
        costs = self._costs.get(batch_size)
        if costs is None:
            b = max(batch_size, 1)
            costs = self._costs[batch_size] = [self.cost.relative_cost(b, k) for k in range(1, k_max + 1)]
        a = acceptance(request)
        best_k, best = 0, 1.0  # k = 0: one token per step at relative cost 1
        for k in range(1, k_max + 1):
            value = expected_tokens(a, k) / costs[k - 1]
            if value > best * 1.02:  # demand a margin: measurement noise should not buy speculation
                best_k, best = k, value
        return 1 if best_k == 0 and self._probe else best_k

    def observe(self, request, num_drafted: int, num_accepted: int) -> None:
        """Acceptance is per position: `num_accepted` successes in a run ended by a rejection (if any). An accepted
        draft also brings probing back to every PROBE_EVERY steps."""
        trials = num_accepted + (1 if num_accepted < num_drafted else 0)
        request.spec_accepted = request.spec_accepted * _DECAY + num_accepted
        request.spec_trials = request.spec_trials * _DECAY + trials
        if num_accepted and self._interval > PROBE_EVERY:
            self._interval = PROBE_EVERY
            self._next_probe = min(self._next_probe, self._steps + PROBE_EVERY)


def acceptance(request) -> float:
    return (request.spec_accepted + _PRIOR_ACCEPTED) / (request.spec_trials + _PRIOR_TRIALS)
