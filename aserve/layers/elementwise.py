"""The element-wise work of a decoder layer (add + RMSNorm, rotary, SiLU·mul): the eager torch references, which
follow HF's code op by op, and the faster implementations a model runs instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(norm(x + residual), x + residual) — or (norm(x), x) without a residual: the add-and-norm that opens each
    decoder sub-layer. Computed in float32, as in HF."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


def split_rotate_qkv(qkv, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int):
    """Fused q/k/v projection output [T, (H + 2 Hkv) D] -> q [T, H, D], k, v [T, Hkv, D], with neox-style rotary
    (rotate halves) applied to q and k; cos/sin [T, 1, D] come from RotaryEmbedding (once per step)."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    q = rotate(q.view(-1, num_heads, head_dim))
    k = rotate(k.view(-1, num_kv_heads, head_dim))
    return q, k, v.view(-1, num_kv_heads, head_dim)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _native_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """bf16: the C kernel (vectorised, 1.7-1.9x eager torch); float32 stays eager (the C loop does not vectorise
    there and is no faster)."""
    if gate_up.dtype == torch.bfloat16:
        from aserve.kernels import cpu_elementwise

        return cpu_elementwise.silu_mul(gate_up)
    return silu_and_mul(gate_up)


class ElementwiseOps:
    """The element-wise work of a layer (add + RMSNorm, rotary, SiLU·mul), shared by all layers of a model.

    Eager torch runs each as several passes over memory (and, on a GPU, several kernel launches). Faster
    implementations replace it: `use_triton()` (GPU) swaps in the fused Triton kernels of aserve/kernels/fused.py;
    `use_native()` (CPU) the C kernels of aserve/kernels/cpu_elementwise.py; where those cannot be compiled, `compile()`
    (CPU) swaps in torch.compile'd versions for steps of at least `min_tokens` tokens — smaller steps stay eager,
    since entering a compiled region costs more than fusion saves there."""

    def __init__(self) -> None:
        self._fast: dict | None = None
        self.min_tokens = 0
        self.kind = "eager"

    def compile(self, min_tokens: int = 32) -> None:
        self._fast = {
            fn.__name__: torch.compile(fn, dynamic=True) for fn in (add_rms_norm, split_rotate_qkv, silu_and_mul)
        }
        self.min_tokens = min_tokens
        self.kind = "compiled"

    def use_native(self) -> None:
        """CPU: the C kernels of aserve/kernels/cpu_elementwise.py for add + RMSNorm, rotary and (bf16) SiLU·mul, at
        every step size (one call each, microseconds of overhead; a torch.compile'd region costs ~50-100 us to enter,
        eager torch runs several ops)."""
        from aserve.kernels import cpu_elementwise

        self._fast = {
            "add_rms_norm": cpu_elementwise.add_rms_norm,
            "split_rotate_qkv": cpu_elementwise.rotary_split,
            "silu_and_mul": _native_silu_and_mul,
        }
        self.min_tokens = 0
        self.kind = "native"

    def use_triton(self) -> None:
        from aserve.kernels import fused

        self._fast = {
            "add_rms_norm": fused.add_rms_norm,
            "split_rotate_qkv": fused.rotary_split,
            "silu_and_mul": fused.silu_and_mul,
        }
        self.min_tokens = 0
        self.kind = "triton"

    @property
    def compiled(self) -> bool:
        return self.kind == "compiled"

    def _pick(self, fn, num_tokens: int):
        if self._fast is not None and num_tokens >= self.min_tokens:
            return self._fast[fn.__name__]
        return fn

    def add_rms_norm(self, x, residual, weight, eps):
        return self._pick(add_rms_norm, x.shape[0])(x, residual, weight, eps)

    def split_rotate_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        return self._pick(split_rotate_qkv, qkv.shape[0])(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    def silu_and_mul(self, gate_up):
        return self._pick(silu_and_mul, gate_up.shape[0])(gate_up)
