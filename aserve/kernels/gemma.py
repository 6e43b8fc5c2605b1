"""Gemma's element-wise work in one launch each, on the GPU (Gemma 2 / 3: aserve/models/gemma2.py):

    gemma_norm         RMSNorm with (1 + w), the weight applied in float32 before the one rounding (GemmaRMSNorm);
                       optionally after adding a normed branch to the residual stream:
                           x' = x + norm(h; w_post)       y = norm(x'; w_pre)
                       (a post-norm, the residual add and the next pre-norm of a decoder layer: one pass)
    gemma_head_norm_   the same RMSNorm over each head of q and of k in a fused qkv row, in place (Gemma 3)
    gelu_tanh_and_mul  GeGLU: gelu_tanh(gate) * up

Each rounds to the model's dtype where transformers' eager code does (after each norm, after the residual add,
after the GELU and after the product), so 16-bit results follow its ops, not just its values. References:
aserve/models/gemma2.py's torch functions (GemmaTorchOps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.fused import qk_norm_, silu_and_mul


@triton.jit
def _normed(xf, w_ptr, offs, ok, n, eps):
    """float32 row (values of the model's dtype) -> x / rms(x) * (1 + w), float32 (not yet rounded)."""
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    return xf * rstd * (1.0 + w)


@triton.jit
def _gemma_norm_kernel(
    h_ptr, x_ptr, w_post_ptr, w_pre_ptr, y_ptr, x_out_ptr, n, eps, stride_h, stride_x, stride_y, stride_xo,
    ADD: tl.constexpr, NORM_AFTER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """ADD: x' = x + norm(h; w_post) (stored), then, NORM_AFTER, y = norm(x'; w_pre). Otherwise y = norm(x; w_pre)."""
    pdl.gdc_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    dtype = x.dtype
    if ADD:
        h = tl.load(h_ptr + row * stride_h + offs, mask=ok, other=0.0).to(tl.float32)
        branch = _normed(h, w_post_ptr, offs, ok, n, eps).to(dtype).to(tl.float32)
        x = (x.to(tl.float32) + branch).to(dtype)
        tl.store(x_out_ptr + row * stride_xo + offs, x, mask=ok)
    if NORM_AFTER:
        y = _normed(x.to(tl.float32), w_pre_ptr, offs, ok, n, eps)
        tl.store(y_ptr + row * stride_y + offs, y.to(dtype), mask=ok)


def _launch(h, x, w_post, w_pre, eps: float, add: bool, norm_after: bool):
    """One _gemma_norm_kernel pass over the rows of x [T, n] -> (y, x'): new tensors where written, else x."""
    rows, n = x.shape
    y = torch.empty_like(x) if norm_after else x
    x_out = torch.empty_like(x) if add else x
    block = triton.next_power_of_2(n)
    _gemma_norm_kernel[(rows,)](
        h, x, w_post, w_pre, y, x_out, n, eps, h.stride(0), x.stride(0), y.stride(0), x_out.stride(0), ADD=add,
        NORM_AFTER=norm_after, BLOCK=block, num_warps=4 if block <= 2048 else 8, USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(),
    )  # fmt: skip
    return y, x_out


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, n] -> norm(x) * (1 + weight) in x's dtype."""
    return _launch(x, x, weight, weight, eps, add=False, norm_after=True)[0]


def gemma_add_norm(h: torch.Tensor, x: torch.Tensor, w_post: torch.Tensor, eps: float,
                   w_pre: torch.Tensor | None = None):  # fmt: skip
    """h, x [T, n] -> x' = x + norm(h) * (1 + w_post); with w_pre, (norm(x') * (1 + w_pre), x'), else x'."""
    y, x_out = _launch(h, x, w_post, w_pre if w_pre is not None else w_post, eps, add=True,
                       norm_after=w_pre is not None)  # fmt: skip
    return x_out if w_pre is None else (y, x_out)


def gemma_head_norm_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, num_heads: int,
                     num_kv_heads: int, head_dim: int) -> torch.Tensor:  # fmt: skip
    """qkv [T, (H + 2 Hkv) D]: each head of q and of k normed with (1 + its weight) in place, v untouched -> qkv
    (fused.py's per-head norm kernel in Gemma's arithmetic)."""
    return qk_norm_(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim, one_plus_weight=True)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 I] -> gelu_tanh(gate) * up [T, I] (fused.py's activation kernel with Gemma's GELU)."""
    return silu_and_mul(gate_up, gelu_tanh=True)
