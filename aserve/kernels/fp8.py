"""Per-token FP8 (e4m3) quantisation of activations in one launch: each row's largest magnitude / 448 is its scale,
the row divided by it is cast to e4m3 (round to nearest even, as torch's cast). One program per row.
Reference: aserve/layers/quantization/fp8.py quantize_per_token (five torch kernels).

Triton's interpreter does not round e4m3 casts as the GPU does, so the test that compares the two runs on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, n, stride_x, stride_q, FP8_MAX: tl.constexpr,
                               BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


def quantize_per_token(x: torch.Tensor, fp8_max: float = 448.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], float32 scales [T, 1])."""
    t, n = x.shape
    q = torch.empty(t, n, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _quantize_per_token_kernel[(t,)](x, q, scale, n, x.stride(0), q.stride(0), FP8_MAX=fp8_max, BLOCK=block,
                                     num_warps=8 if block >= 4096 else 4)  # fmt: skip
    return q, scale
