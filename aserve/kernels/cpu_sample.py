"""Greedy pick on the CPU: per logits row, the index of the first maximum and whether the row holds a NaN or an
infinity, in one C kernel (aserve/kernels/csrc/sample.cpp, built by aserve/kernels/cpu_build.py) reading the logits
in the model's dtype, called as the typed op torch.ops.aserve.greedy_pick.

For a batch of greedy requests the sampler needs nothing else from the logits, and torch's way to get the same
([64, 49152] rows: widen bf16 to float32, a sum for the finite check, max(dim).indices) took ~4-5 ms per decode step
on the 2-core development VM, a few percent of the step (docs/benchmarks.md). Same result as
`logits.float().max(dim=-1).indices` (first maximum; -0.0 == 0.0) and `~isfinite(logits.float().sum(-1))` for rows
of finite values and for rows holding NaN or an infinity (flagged; the index of such a row means nothing).
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_build

library = cpu_build.load_all  # the extension's raw entry points (None where it cannot be built)


def supports(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(-1) == 1
        and logits.shape[1] > 0
        and library() is not None
    )


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] -> (index of each row's first maximum int64 [rows], row holds NaN/inf bool [rows]).
    `supports` must hold."""
    return torch.ops.aserve.greedy_pick(logits)
