"""Pure-torch reference of the INT8 weight-only kernels (aserve/kernels/int8.py on GPUs, gemm_int8 of
aserve/kernels/cpu.py on CPUs): the slowest, most obvious implementation, which the kernel tests compare against.

A layer's weight is W = q * scale: q int8 [N, K] (nn.Linear's layout) and one float32 scale per output channel, so
y = x W^T = (x q^T) * scale: the scale applies once to each output, after the sum over K.
"""

from __future__ import annotations

import torch


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [N, K], scale float32 [N] -> W [N, K] in `dtype` (q * scale in float32, then rounded)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] -> (x q^T) * scale (+ bias) [M, N] in x's dtype, summed in float32."""
    y = (x.float() @ q.float().t()) * scale.float()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
