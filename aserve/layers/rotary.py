"""The rotary position embedding's tables: the checkpoint's rotary parameters (either generation of transformers'
config fields) -> each frequency -> cos / sin of every position, precomputed once (RotaryEmbedding); the
element-wise ops of aserve/layers/elementwise.py apply them, neox style (rotate halves). Variants, as transformers'
modeling_rope_utils computes them: default, linear, llama3, LongRoPE (Phi-3: short factors here, long ones in
aserve/models/phi3.py) and YaRN (interpolated and extrapolated frequencies blended over a ramp of dimensions; cos and
sin scaled by its attention factor).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(hf_config) -> tuple[float, dict]:
    """(theta, scaling dict) from a transformers config of either generation (v5 `rope_parameters`, or v4
    `rope_theta` + `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    merged["rope_type"] = rope_type
    if rope_type == "yarn":  # as transformers fills them in: the context lengths' ratio (DeepSeek-V3's configs)
        if merged.get("original_max_position_embeddings") is None:
            merged["original_max_position_embeddings"] = hf_config.max_position_embeddings
        if merged.get("factor") is None:
            merged["factor"] = hf_config.max_position_embeddings / merged["original_max_position_embeddings"]
    return float(theta), merged


def context_length(hf_config) -> int:
    """The longest sequence the model takes: max_position_embeddings (2048 where unset); with YaRN, the original
    context times the factor where that is more (as vLLM derives it)."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    _, scaling = rope_parameters(hf_config)
    if scaling["rope_type"] == "yarn":
        limit = max(limit, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return limit


def rotary_dim(head_dim: int, scaling: dict) -> int:
    """The dimensions of a head the rotary turns: all, or the first partial_rotary_factor of them (Phi-4-mini)."""
    return int(head_dim * scaling.get("partial_rotary_factor", 1.0))


def padded(inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Frequencies of a partial rotary's dimensions, zeros after them up to head_dim / 2: the dimensions a
    zero frequency pairs are turned by angle 0 (cos 1, sin 0), so left as they are."""
    return torch.cat([inv_freq, inv_freq.new_zeros(head_dim // 2 - inv_freq.shape[0])])


def partial_rotary_order(head_dim: int, rotary: int) -> torch.Tensor:
    """The order a head's q / k dimensions are stored in (new position -> checkpoint dimension) so that the
    neox rotary over the whole head, with padded() frequencies, turns a partial rotary's pairs (i, i + rotary / 2)
    and leaves the other dimensions: those pairs go to (i, i + head_dim / 2), the rest fill the positions whose
    frequency is zero. q and k share the order, so q.k (and the cache) are those of the checkpoint's layout."""
    half, rest = rotary // 2, list(range(rotary, head_dim))
    split = (head_dim - rotary) // 2
    order = list(range(half)) + rest[:split] + list(range(half, rotary)) + rest[split:]
    return torch.tensor(order)


def longrope_switch_length(hf_config) -> int | None:
    """LongRoPE's original_max_position_embeddings (past it the long factors apply), where the config uses
    LongRoPE; else None."""
    _, scaling = rope_parameters(hf_config)
    if scaling["rope_type"] not in ("longrope", "su"):
        return None
    return scaling.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings


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
    if rope_type in ("longrope", "su"):  # the short factors (aserve/models/phi3.py adds the long ones)
        return longrope_inv_freq(head_dim, theta, scaling["short_factor"])
    if rope_type == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3, longrope, yarn)")


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's frequencies: below the ramp's low end (few rotations over the original context) interpolated (divided
    by the factor), above its high end kept (extrapolated), linearly blended between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    extrapolated = 1 - ramp
    return (1.0 / (factor * base)) * (1 - extrapolated) + (1.0 / base) * extrapolated


def longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE's frequencies: the default ones, each divided by its rescale factor."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)


def rope_attention_factor(scaling: dict, max_position_embeddings: int) -> float:
    """The factor cos and sin are multiplied by: LongRoPE's and YaRN's (from the context extension factor, unless
    the config gives it), else 1."""
    if scaling["rope_type"] == "yarn":
        if scaling.get("attention_factor") is not None:
            return scaling["attention_factor"]
        factor = scaling["factor"]
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    if scaling["rope_type"] not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor"):
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def cos_sin_table(inv_freq: torch.Tensor, num_positions: int, scale: float = 1.0) -> torch.Tensor:
    """[num_positions, 2 * head_dim] float32: cos | sin of each position's angles (neox layout), times `scale`
    where the dimension turns (a partial rotary's others, zero frequencies from padded(), keep cos 1 and sin 0:
    transformers scales only the rotated part)."""
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos_sin = torch.cat([emb.cos(), emb.sin()], dim=-1)
    if scale == 1.0:
        return cos_sin
    return torch.where(torch.cat([inv_freq != 0] * 4), cos_sin * scale, cos_sin)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position for neox-style rotary embedding, precomputed in float32 by `materialize` (models
    are built on the meta device); a step looks its positions up once, for all layers."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict, scale: float = 1.0) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.scale = scale  # cos and sin are multiplied by it (rope_attention_factor)
        self.cos_sin: torch.Tensor | None = None

    def materialize(self, device: torch.device) -> None:
        inv_freq = padded(rope_inv_freq(rotary_dim(self.head_dim, self.scaling), self.theta, self.scaling),
                          self.head_dim)  # fmt: skip
        self.cos_sin = cos_sin_table(inv_freq, self.max_position, self.scale).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype, meta=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> cos, sin [T, 1, head_dim] in `dtype` (as HF, which rotates in the model's dtype). `meta` (the step's
        AttentionMetadata) is for tables that depend on the sequence (aserve/models/phi3.py's LongRoPE)."""
        cos, sin = self.cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin
