"""The AutoAWQ "gemm" checkpoint format: packing weights into its int4 tensors (the offline quantiser writes them; its
config entry is aserve/layers/quantization/awq.py's AWQConfig).

Layout of the tensors (and the nibble order inside an int32): aserve/kernels/awq_reference.py. Checkpoints name them
after the HF linear they replace: `model.layers.0.self_attn.q_proj.{qweight,qzeros,scales,bias}`.
"""

from __future__ import annotations

import torch

from aserve.kernels.awq_reference import AWQ_ORDER

PACK_FACTOR = 8  # 4-bit values per int32


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int [..., n] of values in [0, 15] -> int32 [..., n/8] in AWQ order (inverse of aserve.kernels.awq_reference.
    unpack_int4)."""
    assert values.shape[-1] % PACK_FACTOR == 0, "the packed dimension must be a multiple of 8"
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, PACK_FACTOR)
    packed = torch.zeros(v.shape[:-1], dtype=torch.int64, device=values.device)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= v[..., column] << (4 * nibble)
    # int64 -> int32 keeps the low 32 bits once values above 2**31 are moved into the signed range
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def group_grid(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """wg [..., g] float32 -> (scale, zero) [..., 1] float32 of each group's asymmetric 4-bit grid. Scales are
    rounded to float16 (what checkpoints store) before anything is computed with them, so the stored triple is the
    best rounding for the stored scales."""
    w_min, w_max = torch.aminmax(wg, dim=-1, keepdim=True)
    # The range always includes 0, so z lands in [0, 15] and no weight of a one-signed group is clipped (AutoAWQ's
    # own rounding clips those; for groups of both signs, which is nearly all, the two agree).
    w_max, w_min = w_max.clamp(min=0), w_min.clamp(max=0)
    s = ((w_max - w_min).clamp(min=1e-5) / 15).half().float()
    z = (-w_min / s).round_().clamp_(0, 15)
    return s, z


def _grid_values(wg: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """q = clamp(round(w / s) + z, 0, 15), as float32 (in place on a fresh tensor: these run a lot in the search)."""
    return (wg / s).round_().add_(z).clamp_(0, 15)


def quantize_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest of W [out, in] (HF layout) per group of `group_size` inputs.
    -> q int [out, in], z int [out, in/g], s float16 [out, in/g], with W ~= (q - z) * s."""
    out_features, in_features = w.shape
    wg = w.float().reshape(out_features, in_features // group_size, group_size)
    s, z = group_grid(wg)
    q = _grid_values(wg, s, z)
    return q.reshape(out_features, in_features).to(torch.int32), z[..., 0].to(torch.int32), s[..., 0].half()


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [..., in] -> its int4 round trip (q - z) * s in float32, groups along the last dimension: what the
    quantised layer computes with (bit for bit what the packed checkpoint dequantises to)."""
    wg = w.float().reshape(-1, group_size)
    s, z = group_grid(wg)
    return _grid_values(wg, s, z).sub_(z).mul_(s).reshape(w.shape)


def pack_linear(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """W [out, in] (HF layout) -> {"qweight", "qzeros", "scales"} in the AutoAWQ gemm layout."""
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"input size {in_features} is not a multiple of group_size {group_size}")
    if out_features % PACK_FACTOR:
        raise ValueError(f"output size {out_features} is not a multiple of 8")
    return pack_quantized(*quantize_groups(w, group_size))


def pack_quantized(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """An already chosen grid (q int [out, in], z int [out, in/g], s float16 [out, in/g], as quantize_groups
    returns; GPTQ picks its own) -> {"qweight", "qzeros", "scales"} in the AutoAWQ gemm layout."""
    assert q.shape[0] % PACK_FACTOR == 0 and z.shape == s.shape and q.shape[1] % z.shape[1] == 0
    return {
        "qweight": pack_int4(q.t().contiguous()),
        "qzeros": pack_int4(z.t().contiguous()),
        "scales": s.half().t().contiguous(),
    }
