"""CPU bfloat16 GEMV (one input row: batch-1 decode) as a small C kernel (aserve/kernels/csrc/gemv.cpp, built by
aserve/kernels/cpu_build.py), called as the typed op torch.ops.aserve.gemv.

    y[n] = sum_k W[n, k] x[k]        W [N, K] bf16 row-major, float32 accumulation, y rounded to bf16

At batch 1 every linear streams its whole weight for one row, so the step is bound by how fast the weights come in
from memory. torch.mv reaches ~9-12 GB/s on the 2-core development VM over a model's cold weights; this kernel
~15-18 GB/s: rows in blocks of 16 spread over torch's threads (OpenMP, static), bf16 pair dot products
(vdpbf16ps) against x held in registers, the 16 row sums reduced with one transpose-and-add tree, and the rows 4
blocks ahead prefetched (the hardware prefetcher alone leaves bandwidth unused here).

Needs AVX512-BF16 (Sapphire Rapids and newer) and K % 32 == 0; `supports()` says whether it applies, callers keep
torch.mv otherwise. Reference: torch.mv (the same products, summed in another order).
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_build

# The extension's raw entry points (None where it cannot be built), for callers that own their buffers and pass
# data_ptr()s (aserve/models/cpu_one_token.py).
library = cpu_build.load_all


def supports(weight: torch.Tensor) -> bool:
    """Whether gemv takes this weight (CPU, bf16, contiguous [N, K] with K % 32 == 0, on a CPU with AVX512-BF16)."""
    lib = library()
    return (
        lib is not None
        and bool(lib.gemv_bf16_available())
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % 32 == 0
        and weight.shape[1] <= 8192
    )


def gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (`supports` holds), x [K] bf16 -> weight @ x [N] bf16."""
    return torch.ops.aserve.gemv(weight, x)
