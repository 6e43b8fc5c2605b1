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


def compute_prompt_logprobs(
    model, hidden: torch.Tensor, order: list[ScheduledRequest], query_start: list[int]
) -> list[tuple[ScheduledRequest, int, list[SampledLogprobs]]]:
    """-> (request, index of its first prompt token scored, one entry per token scored) for each request of the
    step asking for prompt logprobs whose chunk scores any. `order`/`query_start`: the step's flat batch layout."""
    results = []
    for i, s in enumerate(order):
        k = s.request.sampling_params.prompt_logprobs
        if k is None:
            continue
        positions = scored_positions(s)
        if not positions:
            continue
        prompt = s.request.prompt_token_ids
        row0 = query_start[i]  # the chunk's first position is at this row of the flat batch
        entries: list[SampledLogprobs] = []
        for lo in range(0, len(positions), _ROWS_PER_SLICE):
            pos = positions[lo : lo + _ROWS_PER_SLICE]
            rows = torch.arange(row0 + lo, row0 + lo + len(pos), device=hidden.device)
            targets = torch.tensor(prompt[pos.start + 1 : pos.stop + 1], device=hidden.device)
            entries += _score(model.compute_logits(hidden[rows]), targets, k)
        results.append((s, positions.start + 1, entries))
    return results


def _score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[SampledLogprobs]:
    """logits [N, vocab] (float32), targets [N] -> per row the target's logprob and rank and the top-k."""
    logprobs = torch.log_softmax(logits, dim=-1)
    target_lp = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > target_lp).sum(dim=1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], targets[:, None][:, :0])
    target_lp, ranks = target_lp[:, 0].tolist(), ranks.tolist()
    top_ids, top_lp, ids = top_ids.tolist(), top_lp.tolist(), targets.tolist()
    return [SampledLogprobs.of(t, lp, r, ti, tl, k) for t, lp, r, ti, tl in zip(ids, target_lp, ranks, top_ids, top_lp)]
