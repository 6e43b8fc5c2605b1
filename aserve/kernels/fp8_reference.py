"""Pure-torch reference of the FP8 weight-only kernels (aserve/kernels/fp8_gemv.py): the slowest, most obvious
implementation, which the kernel tests compare against.

A layer's weight is W = w * scale: w e4m3 [N, K] (nn.Linear's layout) and one float32 scale per output channel, so
y = x W^T = (x w^T) * scale: the scale applies once to each output, after the sum over K. Activations stay in their
16-bit (or float32) dtype: nothing but the weight is quantised.
"""

from __future__ import annotations

import torch


def dequantize(weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w e4m3 [..., N, K], scale float32 with one value per row ([..., N], or [1, N] / [N, 1] for one matrix) -> W
    [..., N, K] in `dtype` (w * scale in float32, then rounded). A stack: mixture-of-experts blocks' experts."""
    return (weight_fp8.float() * scale.float().reshape(weight_fp8.shape[:-1])[..., None]).to(dtype)


def fp8_weight_only_linear(
    x: torch.Tensor, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] -> (x w^T) * scale (+ bias) [M, N] in x's dtype, summed in float32."""
    y = (x.float() @ weight_fp8.float().t()) * scale.float().view(-1)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
