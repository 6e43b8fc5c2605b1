"""The packed layout of int4 mixture-of-experts experts (AWQ and GPTQ checkpoints, aserve/layers/quantization/
int4_moe.py) and its pure-torch reference: unpacking, dequantisation and the block's computation. The Triton kernels
of aserve/kernels/moe_int4.py are tested against it.

One projection stack (w13: N = 2 I gate then up rows, K = H; w2: N = H, K = I) of E experts, groups of g inputs:

    qweight  int32   [E, N, K/8]   8 4-bit weights per int32 along the input dimension: q[e, n, 8i + j] in bits
                                   4j..4j+3 of qweight[e, n, i] (GPTQ's packing, per expert and output row); read
                                   as uint8 [E, N, K/2] (little-endian), byte b holds input 2b in its low nibble and
                                   2b + 1 in its high one
    qzeros   uint8   [E, N, K/g]   the zero points, one per byte
    scales   fp16    [E, N, K/g]
    W[e, n, k] = (q[e, n, k] - z[e, n, k // g]) * s[e, n, k // g]      (W as the 16-bit stacks: y = x @ W[e]^T)

Each output row's weights lie contiguous along K, as the 16-bit stacks' do, so the grouped GEMMs read [K tile, N tile]
tiles and the few-token kernels stream rows as they do over 16-bit experts. About 4.2 bits per weight at g = 128
(the zero point and scale add 3 bytes per 64 bytes of weights).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from aserve.kernels import reference

PACK = 8  # int4 values per int32
_SHIFTS = tuple(4 * j for j in range(PACK))


class Int4Experts(NamedTuple):
    """One projection stack of E experts in the packed layout (module docstring)."""

    qweight: torch.Tensor  # int32 [E, N, K/8]
    qzeros: torch.Tensor  # uint8 [E, N, K/g]
    scales: torch.Tensor  # float16 [E, N, K/g]

    @property
    def group_size(self) -> int:
        return self.qweight.shape[-1] * PACK // self.qzeros.shape[-1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the weights."""
        e, n, k8 = self.qweight.shape
        return e, n, k8 * PACK


def pack(values: torch.Tensor) -> torch.Tensor:
    """int [..., K] in [0, 15] -> int32 [..., K/8] along the last dimension (inverse of unpack)."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, PACK)
    packed = torch.zeros(v.shape[:-1], dtype=torch.int64, device=values.device)
    for j, shift in enumerate(_SHIFTS):
        packed |= v[..., j] << shift
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> int32 [..., K] of values in [0, 15]."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(*packed.shape[:-1], packed.shape[-1] * PACK)


def dequantize(w: Int4Experts) -> torch.Tensor:
    """-> W float32 [E, N, K]. (q - z) * s is exact in float32 (a 5-bit integer times an fp16)."""
    g = w.group_size
    z = w.qzeros.to(torch.int32).repeat_interleave(g, dim=-1)
    return (unpack(w.qweight) - z).float() * w.scales.float().repeat_interleave(g, dim=-1)


def fused_moe(x, w13: Int4Experts, w2: Int4Experts, topk_weights, topk_ids) -> torch.Tensor:
    """reference.fused_moe on the dequantised experts, rounded to x's dtype as the 16-bit stacks a dequantising
    load makes."""
    return reference.fused_moe(x, dequantize(w13).to(x.dtype), dequantize(w2).to(x.dtype), topk_weights, topk_ids)
