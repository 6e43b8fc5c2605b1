"""The GPTQ checkpoint format (AutoGPTQ, GPTQModel, optimum: `quant_method: "gptq"`) for 4-bit weights: packing it
(the offline quantiser writes it), reading it, and repacking it at load into the AutoAWQ layout that aserve's int4
kernels read (aserve/kernels/awq_reference.py). Its config entry is aserve/layers/quantization/gptq.py's GPTQConfig.

A linear with K inputs, N outputs and G groups of g inputs (g = K where group_size is -1) is stored as

    qweight  int32 [K/8, N]   8 weights per int32 along the input dimension: q[8i + j, n] in bits 4j..4j+3 of
                              qweight[i, n]
    qzeros   int32 [G, N/8]   8 zero points per int32 along the output dimension: z[grp, 8i + c] in bits 4c..4c+3
                              of qzeros[grp, i] (plain order, unlike AWQ's interleaved one)
    scales   fp16  [G, N]
    g_idx    int32 [K]        each input's group: k // g, or with act order (desc_act) the groups formed in the
                              order GPTQ rounded the inputs, so a group's inputs are scattered over K
    W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

Zero points: format v1 (`checkpoint_format` "gptq", AutoGPTQ's and what GPTQModel saves by default) stores z - 1, v2
("gptq_v2") stores z; symmetric checkpoints (sym true) have z = 8 everywhere. A v1 zero point of 0 is stored as -1,
which 4 bits read back as 15, so it reads as 16: AutoGPTQ's own kernels compute with 16, which no 4-bit zero point
holds, and such a checkpoint is refused (v2 has no such case).

from_awq turns AutoAWQ tensors (groups in input order) into this format, for `aserve quantize --format gptq`.

Repacking (to_awq): q and z are unpacked, v1's offset added, and the AutoAWQ tensors packed from them; with act
order the inputs are first sorted by group (a stable sort of g_idx), which makes every group contiguous as AWQ
needs, and the layer gathers its input's columns in the same order on every call (`input_perm`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from aserve.kernels.awq_reference import unpack_int4
from aserve.layers.quantization.awq_format import PACK_FACTOR, pack_int4

_SHIFTS = tuple(4 * j for j in range(PACK_FACTOR))


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 with the same bits."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in [0, 15] -> int32 [R/8, C]: rows 8i..8i+7 in bits 0..31 of row i (qweight's packing)."""
    v = values.to(torch.int64).reshape(-1, PACK_FACTOR, values.shape[-1])
    packed = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int64, device=values.device)
    for j, shift in enumerate(_SHIFTS):
        packed |= v[:, j] << shift
    return _to_int32(packed)


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] in [0, 15] -> int32 [R, C/8]: columns 8i..8i+7 in bits 0..31 of column i (qzeros' packing)."""
    return pack_rows(values.t()).t().contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] -> int32 [R, C] of values in [0, 15] (inverse of pack_rows)."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts[None, :, None]) & 0xF).reshape(-1, packed.shape[-1])


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] -> int32 [R, C] of values in [0, 15] (inverse of pack_columns)."""
    return unpack_rows(packed.t().contiguous()).t()


def pack(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor | None = None,
         version: int = 1) -> dict[str, torch.Tensor]:  # fmt: skip
    """A chosen grid in aserve's layout (q int [out, in], z int [out, G], s [out, G], as awq_format.quantize_groups
    and the GPTQ quantiser return them) -> {"qweight", "qzeros", "scales", "g_idx"} in the GPTQ layout. g_idx: each
    input's group (default: contiguous groups of in / G inputs); version 1 stores z - 1 (a zero point of 0 cannot be
    stored there: ValueError)."""
    out_features, in_features = q.shape
    if in_features % PACK_FACTOR or out_features % PACK_FACTOR:
        raise ValueError(f"GPTQ packs 8 weights per int32: {out_features} x {in_features} is not a multiple of 8")
    if g_idx is None:
        g_idx = torch.arange(in_features, device=q.device) // (in_features // z.shape[1])
    stored = z.to(torch.int64) - (1 if version == 1 else 0)
    if version == 1 and (stored < 0).any():
        raise ValueError("a zero point of 0 has no GPTQ v1 encoding (v1 stores z - 1); write version 2")
    return {
        "qweight": pack_rows(q.t()),
        "qzeros": pack_columns(stored.t()),
        "scales": s.half().t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def zero_points(qzeros: torch.Tensor, version: int) -> torch.Tensor:
    """qzeros int32 [G, N/8] -> z int32 [G, N] (v1: the stored values + 1)."""
    return unpack_columns(qzeros) + (1 if version == 1 else 0)


def dequantize(qweight, qzeros, scales, g_idx, version: int) -> torch.Tensor:
    """GPTQ tensors -> W float32 [N, K] (nn.Linear's layout)."""
    g = g_idx.long()
    q = unpack_rows(qweight).float()  # [K, N]
    w = (q - zero_points(qzeros, version)[g].float()) * scales.float()[g]
    return w.t()


class RepackedGPTQ(NamedTuple):
    """to_awq's result: the AutoAWQ tensors (qweight [K, N/8], qzeros [G, N/8], scales [G, N]) of the weights with
    their inputs in the order `input_perm` (int64 [K]; None: K's own order)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    input_perm: torch.Tensor | None


def input_order(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The order of the inputs that makes every group contiguous (None: they are already); ValueError where the
    groups are not all of group_size inputs."""
    g = g_idx.long()
    k = g.numel()
    contiguous = torch.arange(k, device=g.device) // group_size
    if torch.equal(g, contiguous):
        return None
    perm = torch.sort(g, stable=True).indices
    if not torch.equal(g[perm], contiguous):
        raise ValueError(f"GPTQ g_idx does not split the {k} inputs into groups of {group_size}")
    return perm


def to_awq(qweight, qzeros, scales, g_idx, group_size: int, version: int) -> RepackedGPTQ:
    """GPTQ tensors -> the AutoAWQ tensors of the same weights (inputs sorted by group where g_idx is not in order).
    ValueError for what 4-bit AWQ zero points cannot hold (a v1 zero point of 0)."""
    z = zero_points(qzeros, version)
    if (z > 15).any():
        raise ValueError("GPTQ v1 checkpoint with a zero point of 0, stored as -1 (AutoGPTQ's asymmetric overflow): "
                         "not supported; write it in the v2 format (checkpoint_format gptq_v2)")  # fmt: skip
    q = unpack_rows(qweight)  # [K, N]
    perm = input_order(g_idx, group_size)
    if perm is not None:
        q = q[perm]
    return RepackedGPTQ(pack_int4(q), pack_int4(z), scales.half().contiguous(), perm)


def from_awq(qweight, qzeros, scales, version: int) -> dict[str, torch.Tensor]:
    """AutoAWQ tensors (contiguous groups) -> {"qweight", "qzeros", "scales", "g_idx"}: the GPTQ tensors of the same
    weights in format `version` (1 holds no zero point of 0: ValueError)."""
    return pack(unpack_int4(qweight).t(), unpack_int4(qzeros).t(), scales.t(), version=version)
