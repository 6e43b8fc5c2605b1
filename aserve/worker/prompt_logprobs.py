"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability of each prompt token given the ones before it, and
the top-k alternatives, from the logits at every prompt position a step computes.

Position p of a prompt of P tokens predicts token p + 1; positions p < P - 1 score the prompt, position P - 1 predicts
the first generated token (the sampler's row). A chunk computing positions [a, b) therefore scores prompt tokens
a + 1 .. min(b, P - 1): chunked prefill yields the entries chunk by chunk. Only requests asking for them pay for the
extra logits, computed in slices of rows so that a long prompt never holds [P, vocab] float32 logits at once.
"""

from __future__ import annotations

import torch

from aserve.core.outputs import SampledLogprobs
from aserve.core.scheduler import ScheduledRequest

_ROWS_PER_SLICE = 512


def scored_positions(s: ScheduledRequest) -> range:
    """The positions of this step's chunk whose logits score a prompt token."""
    end = min(s.num_computed_tokens + s.num_new_tokens, s.request.num_prompt_tokens - 1)
    return range(s.num_computed_tokens, max(end, s.num_computed_tokens))


def _slices(order: list[ScheduledRequest], query_start: list[int]):
    """(index in `order`, positions scored, first row of the slice, rows) of each slice of logits, in order."""
    for i, s in enumerate(order):
        if s.request.sampling_params.prompt_logprobs is None:
            continue
        positions = scored_positions(s)
        for lo in range(0, len(positions), _ROWS_PER_SLICE):
            yield i, positions, query_start[i] + lo, len(positions[lo : lo + _ROWS_PER_SLICE])


def prompt_logits_rows(order: list[ScheduledRequest], query_start: list[int]) -> list[tuple[int, int]]:
    """(first row, rows) of each compute_logits call compute_prompt_logprobs makes for this step, in order (what a
    tensor-parallel worker runs alongside: the logits are gathered from every rank)."""
    return [(row, n) for _, _, row, n in _slices(order, query_start)]


def compute_prompt_logprobs(
    model, hidden: torch.Tensor, order: list[ScheduledRequest], query_start: list[int]
) -> list[tuple[ScheduledRequest, int, list[SampledLogprobs]]]:
    """-> (request, index of its first prompt token scored, one entry per token scored) for each request of the
    step asking for prompt logprobs whose chunk scores any. `order`/`query_start`: the step's flat batch layout."""
    entries: dict[int, list[SampledLogprobs]] = {}
    for i, positions, row, n in _slices(order, query_start):
        s = order[i]
        first = positions.start + (row - query_start[i])  # the slice's first position
        rows = torch.arange(row, row + n, device=hidden.device)
        targets = torch.tensor(s.request.prompt_token_ids[first + 1 : first + n + 1], device=hidden.device)
        k = s.request.sampling_params.prompt_logprobs
        entries.setdefault(i, []).extend(_score(model.compute_logits(hidden[rows]), targets, k))
    return [(order[i], scored_positions(order[i]).start + 1, scored) for i, scored in entries.items()]


def _score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[SampledLogprobs]:
    """logits [N, vocab] (float32), targets [N] -> per row the target's logprob and rank and the top-k."""
    logprobs = torch.log_softmax(logits, dim=-1)
    target_lp = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > target_lp).sum(dim=1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], targets[:, None][:, :0])
    target_lp, ranks = target_lp[:, 0].tolist(), ranks.tolist()
    top_ids, top_lp, ids = top_ids.tolist(), top_lp.tolist(), targets.tolist()
    return [SampledLogprobs.of(t, lp, r, ti, tl, k) for t, lp, r, ti, tl in zip(ids, target_lp, ranks, top_ids, top_lp)]
