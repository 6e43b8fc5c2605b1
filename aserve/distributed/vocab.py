"""The vocabulary split across ranks: rank r holds rows [r * n, (r + 1) * n) of the embedding and of lm_head, with
n = ceil(vocab / ranks); rows past the vocabulary (the last rank's padding) are zero and never looked up, and their
logits are dropped.

    embedding   each rank looks up the ids in its rows (zeros for the others) and the ranks' results are summed
    lm_head     each rank computes its rows' logits; rank 0 gathers them (rank order) for sampling, the other ranks
                go on with an empty [N, 0] tensor
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.distributed.group import TensorParallelGroup


def rows_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.rows = rows_per_rank(vocab_size, group.size)
        self.start = group.rank * self.rows
        self.group = group
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce_(x)


class GatherLogits:
    """lm_head's forward hook: this rank's logits [N, rows] -> on rank 0 the whole vocabulary's [N, vocab_size]."""

    def __init__(self, vocab_size: int, group: TensorParallelGroup) -> None:
        self.vocab_size, self.group = vocab_size, group

    def __call__(self, module: nn.Module, args, logits: torch.Tensor) -> torch.Tensor:
        full = self.group.gather_last_dim(logits)
        if full is None:
            return logits[..., :0]
        if full.shape[-1] != self.vocab_size:
            full = full[..., : self.vocab_size].contiguous()
        return full
