"""Pure-torch reference of the AWQ int4 kernels (aserve/kernels/awq/): unpacking, dequantisation and the matmul.

The slowest, most obvious implementation. The Triton kernels are tested against it, and AWQ layers use it on CPU.

AutoAWQ "gemm" layout of a linear layer with `in` inputs, `out` outputs and groups of `g` inputs:

    qweight  int32 [in,     out/8]   8 4-bit weights per int32, along the output dimension
    qzeros   int32 [in/g,   out/8]   8 4-bit zero points per int32, same packing
    scales   fp16  [in/g,   out]
    W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]            (W is [in, out]: y = x @ W)

Inside one int32, output column 8j + c sits in nibble AWQ_REVERSE_ORDER[c] (AutoAWQ interleaves even and odd
columns; nibble i holds column AWQ_ORDER[i]):

    bits    31..28  27..24  23..20  19..16  15..12  11..8   7..4    3..0
    nibble    7       6       5       4       3       2       1       0
    column  8j+7    8j+5    8j+3    8j+1    8j+6    8j+4    8j+2    8j+0
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c sits in nibble AWQ_REVERSE_ORDER[c]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n/8] in AWQ order -> int32 [..., n] of values in [0, 15]."""
    shifts = torch.tensor(AWQ_REVERSE_ORDER, dtype=torch.int32, device=packed.device) * 4
    values = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift is harmless: the mask keeps 4 bits
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """-> W float32 [in, out] (y = x @ W). (q - z) * s is exact in float32 (a 5-bit integer times an fp16)."""
    q = unpack_int4(qweight)
    z = unpack_int4(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return (q - z).float() * s


def awq_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, in] -> [M, out] in x's dtype: the weight is dequantised, rounded to x's dtype, then multiplied."""
    w = dequantize(qweight, qzeros, scales, group_size).to(x.dtype)
    out = x @ w
    return out + bias.to(x.dtype) if bias is not None else out
