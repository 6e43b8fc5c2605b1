"""RMSNorm with the residual add folded in."""

from __future__ import annotations

import torch
from torch import nn

from aserve.layers.elementwise import ElementwiseOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: ElementwiseOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """-> (norm(x + residual), x + residual), or (norm(x), x) without a residual."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
