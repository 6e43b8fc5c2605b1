"""The element-wise work of a Llama layer on the CPU as small C kernels (aserve/kernels/csrc/elementwise.cpp, built by
aserve/kernels/cpu_build.py), one typed op call each (torch.ops.aserve.*):

    add_rms_norm     x + residual -> (RMSNorm(x + residual) * weight, x + residual)
    rotary_split     fused qkv rows -> rotated q, rotated k, v (each contiguous)
    silu_mul         gate_up rows -> silu(gate) * up

Same contract and rounding as aserve/kernels/fused.py (HF's eager order: every product rounded to the model dtype where
HF rounds it), float32 and bfloat16. Each call costs microseconds of Python, where eager torch runs 3-10 ops (~10 us
each) and a torch.compile'd region pays ~100 us to enter: on a 2-core CPU that overhead, at batch 1 and in every
decode step, is a visible part of the step. Rows are spread over torch's threads (OpenMP) when there are many.
bfloat16 SiLU·mul on AVX512-BF16 CPUs runs 16 lanes with a polynomial exp (libm's expf does not vectorise): 1.7-1.9x
eager torch's two ops. References: aserve.layers.elementwise (add_rms_norm, split_rotate_qkv, silu_and_mul).
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_build

# The extension's raw entry points (None where it cannot be built), for callers that own their buffers and pass
# data_ptr()s (aserve/models/cpu_one_token.py).
library = cpu_build.load_all


def available() -> bool:
    return library() is not None


def supports(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16) and available()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x [T, n] -> (norm(x + residual) * weight, x + residual); without a residual, (norm(x) * weight, x)."""
    return torch.ops.aserve.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2n] -> silu(gate) * up [T, n]."""
    return torch.ops.aserve.silu_mul(gate_up)


def rotary_split(qkv, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int):
    """qkv [T, (H + 2 Hkv) D], cos / sin [T, 1, D] (model dtype) -> q [T, H, D], k, v [T, Hkv, D]."""
    return torch.ops.aserve.rotary_split(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
