"""The element-wise layers of a decoder (RMSNorm with the residual add folded in) and
the element-wise work of a layer (add + RMSNorm, rotary, SiLU·mul): the eager torch references, which follow HF's code
op by op, and the faster implementations a model runs instead, one of which select_elementwise_ops picks once, when
the model is built:

    ElementwiseOps             eager torch, several passes over memory (the reference)
    CompiledElementwiseOps     CPU without the C kernels: torch.compile'd, for steps of at least min_tokens tokens
    NativeCpuElementwiseOps    CPU: the C kernels of aserve/kernels/cpu.py, at every step size
    TritonElementwiseOps       GPU: the fused Triton kernels of aserve/kernels/fused.py

Rotary is neox style (rotate halves): aserve/layers/rotary.py's RotaryEmbedding precomputes cos / sin of every
position (with the checkpoint's scaling variant) and a step looks its positions up once, for all layers; the ops
apply them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.kernels import cpu


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


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 and rounded to x's dtype before the weight, as
    transformers' Qwen3RMSNorm."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def qk_norm(qkv, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Fused qkv rows [T, (H + 2 Hkv) D] -> the same with each head of q and of k RMS-normalised (Qwen3)."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = head_rms_norm(q.reshape(-1, num_heads, head_dim), q_weight, eps).reshape(q.shape)
    k = head_rms_norm(k.reshape(-1, num_kv_heads, head_dim), k_weight, eps).reshape(k.shape)
    return torch.cat([q, k, v], dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class ElementwiseOps:
    """The element-wise work of a layer, shared by all layers of a model: eager torch, several passes over memory
    (on a GPU, several kernel launches each). The subclasses below replace it; select_elementwise_ops picks one
    once, when the model is built."""

    kind = "eager"
    min_tokens = 0  # steps of fewer tokens run eager torch (CompiledElementwiseOps); warm-up compiles at this size

    @property
    def compiled(self) -> bool:
        return self.kind == "compiled"

    def add_rms_norm(self, x, residual, weight, eps):
        return add_rms_norm(x, residual, weight, eps)

    def split_rotate_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        return split_rotate_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    def silu_and_mul(self, gate_up):
        return silu_and_mul(gate_up)

    def qk_norm(self, qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim):
        return qk_norm(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)


class CompiledElementwiseOps(ElementwiseOps):
    """CPU where the C kernels cannot be built: torch.compile'd versions for steps of at least `min_tokens` tokens;
    smaller steps stay eager, since entering a compiled region costs more than fusion saves there."""

    kind = "compiled"

    def __init__(self, min_tokens: int = 32) -> None:
        self.min_tokens = min_tokens
        self._add_rms_norm, self._split_rotate_qkv, self._silu_and_mul = (
            torch.compile(fn, dynamic=True) for fn in (add_rms_norm, split_rotate_qkv, silu_and_mul)
        )

    def add_rms_norm(self, x, residual, weight, eps):
        fn = self._add_rms_norm if x.shape[0] >= self.min_tokens else add_rms_norm
        return fn(x, residual, weight, eps)

    def split_rotate_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        fn = self._split_rotate_qkv if qkv.shape[0] >= self.min_tokens else split_rotate_qkv
        return fn(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    def silu_and_mul(self, gate_up):
        return (self._silu_and_mul if gate_up.shape[0] >= self.min_tokens else silu_and_mul)(gate_up)


class NativeCpuElementwiseOps(ElementwiseOps):
    """CPU: the C kernels of aserve/kernels/cpu.py, at every step size (one call each, microseconds of
    overhead; a torch.compile'd region costs ~50-100 us to enter, eager torch runs several ops). SiLU·mul in C for
    bf16 (1.7-1.9x eager torch); float32 stays eager (the C loop does not vectorise there and is no faster)."""

    kind = "native"

    def __init__(self, dtype: torch.dtype) -> None:
        self._silu_and_mul = cpu.silu_mul if dtype == torch.bfloat16 else silu_and_mul

    def add_rms_norm(self, x, residual, weight, eps):
        return cpu.add_rms_norm(x, residual, weight, eps)

    def split_rotate_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        return cpu.rotary_split(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    def silu_and_mul(self, gate_up):
        return self._silu_and_mul(gate_up)


class TritonElementwiseOps(ElementwiseOps):
    """GPU: the fused Triton kernels of aserve/kernels/fused.py (one launch each)."""

    kind = "triton"

    def __init__(self) -> None:
        from aserve.kernels import fused  # Triton: optional, imported once it is chosen

        self._fused = fused

    def add_rms_norm(self, x, residual, weight, eps):
        return self._fused.add_rms_norm(x, residual, weight, eps)

    def split_rotate_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        return self._fused.rotary_split(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

    def silu_and_mul(self, gate_up):
        return self._fused.silu_and_mul(gate_up)

    def qk_norm(self, qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim):
        return self._fused.qk_norm_(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads, head_dim)


def select_elementwise_ops(device: torch.device, dtype: torch.dtype, compile_model: bool) -> ElementwiseOps:
    """GPU: Triton. CPU: the C kernels where they build for `dtype`, else torch.compile'd (if `compile_model`), else
    eager."""
    if device.type == "cuda":
        return TritonElementwiseOps()
    if device.type == "cpu":
        if cpu.elementwise_supports(dtype):
            return NativeCpuElementwiseOps(dtype)
        if compile_model:
            return CompiledElementwiseOps()
    return ElementwiseOps()


class RMSNorm(nn.Module):
    """RMSNorm with the residual add folded in, run by the model's element-wise ops."""

    def __init__(self, hidden_size: int, eps: float, ops: ElementwiseOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """-> (norm(x + residual), x + residual), or (norm(x), x) without a residual."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class HeadRMSNorm(nn.Module):
    """The weight and epsilon of an RMSNorm over each head (Qwen3's q/k norms, checkpoint names q_norm / k_norm).
    The model's element-wise ops apply it, to q and k at once (ElementwiseOps.qk_norm)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps
