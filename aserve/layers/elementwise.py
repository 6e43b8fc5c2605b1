"""The element-wise work of a decoder layer (add + RMSNorm, rotary, SiLU·mul): the eager torch references, which
follow HF's code op by op, and the faster implementations a model runs instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aserve.kernels import cpu_elementwise


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
    """CPU: the C kernels of aserve/kernels/cpu_elementwise.py, at every step size (one call each, microseconds of
    overhead; a torch.compile'd region costs ~50-100 us to enter, eager torch runs several ops). SiLU·mul in C for
    bf16 (1.7-1.9x eager torch); float32 stays eager (the C loop does not vectorise there and is no faster)."""

    kind = "native"

    def __init__(self, dtype: torch.dtype) -> None:
        self._silu_and_mul = cpu_elementwise.silu_mul if dtype == torch.bfloat16 else silu_and_mul

    def add_rms_norm(self, x, residual, weight, eps):
        return cpu_elementwise.add_rms_norm(x, residual, weight, eps)

    def split_rotate_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim):
        return cpu_elementwise.rotary_split(qkv, cos, sin, num_heads, num_kv_heads, head_dim)

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


def select_elementwise_ops(device: torch.device, dtype: torch.dtype, compile_model: bool) -> ElementwiseOps:
    """GPU: Triton. CPU: the C kernels where they build for `dtype`, else torch.compile'd (if `compile_model`), else
    eager."""
    if device.type == "cuda":
        return TritonElementwiseOps()
    if device.type == "cpu":
        if cpu_elementwise.supports(dtype):
            return NativeCpuElementwiseOps(dtype)
        if compile_model:
            return CompiledElementwiseOps()
    return ElementwiseOps()
