"""Deterministic mode's sampler: a seeded request's token at each output position is a function of its seed, that
position and the logits there, whatever the batch, the number of steps it took to get there, and speculation.

Two differences from Sampler (aserve/worker/sampler.py), which it otherwise is (greedy, logprobs, penalties and the
logits processing run per row there already):

- Uniforms by position. Sampler draws a seeded request's uniforms from its own generator in the order it samples, so
  a draw depends on how many were drawn before: speculative verification draws two per row and discards the rows
  after a rejection. Here the uniform of output position i is a hash of (seed, i) (splitmix64, 24 bits: as fine as
  torch.rand's float32), whatever was drawn before. Unseeded requests draw from the engine's generator as before.
- Verification by exact match. Every row of a request being verified draws its token from the target distribution p
  with its position's uniform, as plain decoding would, and a draft is accepted where it equals that token. The
  emitted tokens are then those of decoding without speculation, for any draft distribution q. With one-hot drafts
  (n-gram, greedy drafts) this is exactly the rejection rule (accept d with probability p(d); a rejection emits p
  without d, renormalised); with a draft model's q it accepts less often than min(1, p / q) would.
"""

from __future__ import annotations

import torch

from aserve.worker.sampler import Sampler, SampleRow

_MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) from (seed, output position): splitmix64 of the pair, its top 24 bits."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 40) / float(1 << 24)


class BatchInvariantSampler(Sampler):
    def uniforms(self, rows: list[SampleRow], per_row: int = 1) -> torch.Tensor:
        """[len(rows), per_row]: a seeded row's uniforms from its output position (per_row > 1: the next positions'
        hashes under seed + j), an unseeded row's from the engine's generator."""
        u = torch.rand(len(rows), per_row, generator=self.generator, device=self.device)
        seeded = [(i, row.params.seed, row.num_output_tokens) for i, row in enumerate(rows)
                  if row.params.seed is not None]  # fmt: skip
        if seeded:
            values = [[position_uniform(seed + j, pos) for j in range(per_row)] for _, seed, pos in seeded]
            u[self._tensor([i for i, _, _ in seeded])] = self._tensor(values, u.dtype)
        return u

    def _candidates(self, logits, rows, drafts, draft_probs, argmax: torch.Tensor | None = None):
        """As Sampler's, with drafts accepted where they equal the token each row draws (greedy: the argmax)."""
        candidates, _ = super()._candidates(logits, rows, [[] for _ in rows], None, argmax)
        if not any(drafts):
            return candidates, None
        draft_ids = self._draft_ids(drafts, logits.device)
        return candidates, (candidates == draft_ids) & (draft_ids >= 0)
