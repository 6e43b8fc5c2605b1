"""Pure-torch reference of the FP8 weight-only kernels (aserve/kernels/fp8_gemv.py): the slowest, most obvious
implementation, which the kernel tests compare against; and per-token quantisation of activations (aserve/kernels/
fp8.py's reference).

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


def quantize_per_token(x: torch.Tensor, fp8_max: float = 448.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1]): each row's largest magnitude / 448 its scale; the
    reference of aserve/kernels/fp8.py, and the FP8 experts' activation rounding where that kernel does not run."""
    x_scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / fp8_max
    return (x.float() / x_scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), x_scale


def fp8_weight_only_linear(
    x: torch.Tensor, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] -> (x w^T) * scale (+ bias) [M, N] in x's dtype, summed in float32."""
    y = (x.float() @ weight_fp8.float().t()) * scale.float().view(-1)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
