"""Building blocks of Llama-family models, written against flat [num_tokens, ...] batches."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

# CPU, one-row inputs of prepacked bf16 linears: a GEMV on the plain weight instead of oneDNN
# (aserve/kernels/cpu_gemv.py where it applies, else torch.mv; ASERVE_CPU_MV=0: off).
CPU_MV_FOR_ONE_ROW = os.environ.get("ASERVE_CPU_MV", "1") != "0"


class Linear(nn.Linear):
    """nn.Linear that, on CPU in bf16, runs on a weight copy prepacked once for oneDNN's blocked (AMX) layout:
    1.3-2x faster than F.linear, which reorders the weight on every call."""

    packed_weight: torch.Tensor | None = None
    cpu_gemv = False  # one-row inputs run aserve/kernels/cpu_gemv.py (set by prepack)
    gemv_config: dict | None = None  # GPU: one-row inputs (batch-1 decode) run aserve/kernels/gemv.py
    gemv_silu_config: dict | None = None  # ... and with SiLU·mul fused in (forward_silu_mul); None: gemv_config

    def use_gemv(self, config: dict | None = None) -> bool:
        """GPU, 16-bit weights: route one-row inputs to the Triton GEMV (aserve/kernels/gemv.py), which streams the
        weight faster than cuBLAS at M = 1. False when it does not apply (then F.linear as before)."""
        from aserve.kernels.gemv import gemv_config

        if not (self.weight.is_cuda and self.weight.dtype in (torch.bfloat16, torch.float16)):
            return False
        self.gemv_config = gemv_config(*self.weight.shape, config)
        self.gemv_silu_config = gemv_config(*self.weight.shape, config, silu_mul=True)
        return self.gemv_config is not None

    def prepack(self) -> bool:
        if not (self.weight.is_cpu and self.weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()):
            return False
        try:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
        except (RuntimeError, AttributeError):  # a torch build without it: plain F.linear
            return False
        from aserve.kernels import cpu_gemv

        self.cpu_gemv = cpu_gemv.supports(self.weight)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            if x.shape[0] == 1 and CPU_MV_FOR_ONE_ROW:  # batch-1 decode: a GEMV streams the weight faster
                if self.cpu_gemv:
                    from aserve.kernels.cpu_gemv import gemv

                    y = gemv(self.weight, x[0]).unsqueeze(0)
                else:
                    y = torch.mv(self.weight, x[0]).unsqueeze(0)
                return y if self.bias is None else y + self.bias
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        if self.takes_gemv(x):
            from aserve.kernels.gemv import gemv

            return gemv(x, self.weight, self.bias, config=self.gemv_config)
        return F.linear(x, self.weight, self.bias)

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Does this input (one row, GPU) run the Triton GEMV? Then forward_silu_mul fuses SiLU·mul into it too."""
        return self.gemv_config is not None and x.dim() == 2 and x.shape[0] == 1

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, then this linear, in the GEMV's prologue (takes_gemv must hold)."""
        from aserve.kernels.gemv import gemv

        return gemv(gate_up, self.weight, self.bias, config=self.gemv_silu_config or self.gemv_config, silu_mul=True)

    def load_output_slice(self, param: nn.Parameter, start: int, size: int, tensor: torch.Tensor) -> None:
        """Copies one part of a fused layer (output features [start, start + size)) into `param`."""
        param.data[start : start + size].copy_(tensor)


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


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: ElementwiseOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """-> (norm(x + residual), x + residual), or (norm(x), x) without a residual."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_parameters(hf_config) -> tuple[float, dict]:
    """(theta, scaling dict) from a transformers config of either generation (v5 `rope_parameters`, or v4
    `rope_theta` + `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    merged["rope_type"] = rope_type
    return float(theta), merged


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin of every position for neox-style rotary embedding, precomputed in float32 by `materialize` (models
    are built on the meta device); a step looks its positions up once, for all layers."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.cos_sin: torch.Tensor | None = None

    def materialize(self, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos_sin = torch.cat([emb.cos(), emb.sin()], dim=-1).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> cos, sin [T, 1, head_dim] in `dtype` (as HF, which rotates in the model's dtype)."""
        cos, sin = self.cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin
