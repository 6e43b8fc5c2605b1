"""GPTQ (Frantar et al. 2022): int4 rounding with error feedback, in the same AutoAWQ grid layout.

Round-to-nearest rounds every weight on its own. GPTQ rounds the input channels of a linear one at a time, in
order, and moves each column's rounding error onto the columns not yet rounded, in the proportions that minimise
the linear's output error on calibration inputs X [T, in]:

    H = X^T X / T (+ 1 % of its mean diagonal)        U = upper Cholesky factor of H^-1
    for column j:  q_j = round(w_j)    e = (w_j - q_j) / U[j, j]    w_{j+1:} -= e U[j, j+1:]

Groups are static (input channels j..j+g-1 share a scale and zero point, as awq_format.pack_linear lays them
out); each group's grid comes from the clipping search of awq_search.search_clip_gram against the group's block of
H (or the identity: plain weight error; or its min/max). With act_order (the default) the columns are rounded in
order of decreasing H diagonal (the inputs with the most energy first, while the most columns are left to absorb
their errors) and every grid is fixed beforehand from the original weights, so the groups stay contiguous in the
checkpoint; without it, in input order, each group's grid chosen when the loop reaches its first column, from the
error-updated weights at that point. On SmolLM2 at group 64 act order cut GPTQ's perplexity increase from 12.6 %
to 8.4 % (docs/quantization.md). Columns go in blocks; the rest of the matrix is updated once per block (GPTQ's
lazy batch update).

gptq_layer runs it over a decoder layer true-sequentially: each group of linears (q/k/v, o, gate/up, down) is
calibrated on inputs computed with the linears before it already quantised. H keeps every token, the attention
sink (each sequence's first) too, though in a few layers it dominates H: leaving it out cost SmolLM2 47 % more
perplexity (docs/quantization.md).
"""

from __future__ import annotations

import torch

from aserve.layers.quantization.awq_format import fake_quantize, group_grid
from aserve.quantize.awq_search import apply_clip, search_clip_gram
from aserve.quantize.dense_layer import DenseDecoderLayer

SEARCHES = ("minmax", "plain", "weighted")  # a group's grid: its min/max, or the clip minimising that error
_GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
           "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}  # fmt: skip


def gram(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> X^T X / T [in, in] in float32 (the Hessian of the output error, up to a factor 2)."""
    x = x.reshape(-1, x.shape[-1]).float()
    return x.t() @ x / x.shape[0]


def output_error(w: torch.Tensor, w_q: torch.Tensor, h: torch.Tensor) -> float:
    """Mean squared error of the linear's output over the calibration tokens and outputs: tr(D H D^T) / out."""
    delta = (w_q - w).float()
    return ((delta @ h) * delta).sum().item() / w.shape[0]


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(q [out, in], z, s [out, in/g]) -> (q - z) * s in float32: what the packed checkpoint computes with."""
    group_size = q.shape[1] // z.shape[1]
    qg = q.float().reshape(q.shape[0], -1, group_size)
    return ((qg - z[..., None].float()) * s[..., None].float()).reshape(q.shape)


@torch.no_grad()
def gptq_quantize(
    w: torch.Tensor, h: torch.Tensor, group_size: int, search: str = "weighted", damp: float = 0.01, block: int = 128,
    n_grid: int = 20, act_order: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """W [out, in] (HF layout), h [in, in] = gram(inputs) -> (q int32 [out, in], z int32 [out, in/g], s float16
    [out, in/g]) with W ~= (q - z) * s, as awq_format.quantize_groups returns (and pack_quantized packs)."""
    if search not in SEARCHES:
        raise ValueError(f"GPTQ group search must be one of {', '.join(SEARCHES)}, got {search!r}")
    out_features, in_features = w.shape
    w = w.float().clone()
    h = h.double().clone()
    dead = h.diagonal() == 0  # inputs that are always 0: any weight will do
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    group_gram = h.float()
    if search == "plain":
        group_gram = torch.eye(in_features, device=w.device)
    h.diagonal().add_(damp * h.diagonal().mean())

    q = torch.empty(out_features, in_features, dtype=torch.int32, device=w.device)
    n_groups = in_features // group_size
    scales = torch.empty(out_features, n_groups, device=w.device)
    zeros = torch.empty(out_features, n_groups, device=w.device)

    def set_grid(wg: torch.Tensor, g0: int) -> None:  # the grid of the group starting at input channel g0
        if search != "minmax":
            g = group_gram[g0 : g0 + group_size, g0 : g0 + group_size]
            wg = apply_clip(wg, search_clip_gram(g[None], wg, group_size, n_grid), group_size)
        s, z = group_grid(wg)
        scales[:, g0 // group_size], zeros[:, g0 // group_size] = s[:, 0], z[:, 0]

    if act_order:  # static grids from the original weights, then columns by decreasing H diagonal
        for g0 in range(0, in_features, group_size):
            set_grid(w[:, g0 : g0 + group_size], g0)
        perm = torch.argsort(h.diagonal(), descending=True)
        h, w = h[perm][:, perm], w[:, perm]
    else:  # groups never straddle blocks: each grid sees all updates before its first column
        perm = torch.arange(in_features, device=w.device)
        block = group_size * max(1, block // group_size)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    order = perm.tolist()  # the input channel of each position in the rounding order
    for b0 in range(0, in_features, block):
        b1 = min(b0 + block, in_features)
        wb = w[:, b0:b1].clone()
        errors = torch.empty_like(wb)
        ub = hinv[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = order[b0 + j]
            if not act_order and col % group_size == 0:
                set_grid(wb[:, j : j + group_size], col)
            s, z = scales[:, col // group_size], zeros[:, col // group_size]
            qj = (wb[:, j] / s).round_().add_(z).clamp_(0, 15)
            q[:, col] = qj.to(torch.int32)
            err = (wb[:, j] - (qj - z) * s) / ub[j, j]
            wb[:, j + 1 :] -= err[:, None] * ub[j, j + 1 :][None, :]
            errors[:, j] = err
        w[:, b1:] -= errors @ hinv[b0:b1, b1:]
    return q, zeros.to(torch.int32), scales.half()


@torch.no_grad()
def gptq_layer(
    layer: DenseDecoderLayer,
    x: torch.Tensor,
    seq_len: int,
    group_size: int,
    search: str = "weighted",
    damp: float = 0.01,
    act_order: bool = True,
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[str, dict[str, float]]]:
    """GPTQ on every linear of the layer, true-sequentially, on the residual stream x [T, hidden] entering it.
    layer.w's linears are replaced by their dequantised weights. -> (the quantised layer's output, {linear: (q, z,
    s)}, {linear: {"rtn", "gptq"}}: the linear's output error on its calibration inputs, round-to-nearest against
    GPTQ)."""
    grids, report = {}, {}

    def quantize_group(group: str, inputs: torch.Tensor) -> None:  # its inputs come from the quantised linears
        h = gram(inputs)
        for name in _GROUPS[group]:
            w = layer.w[f"{name}.weight"]
            grids[name] = gptq_quantize(w, h, group_size, search, damp, act_order=act_order)
            w_q = dequantize(*grids[name])
            report[name] = {"rtn": output_error(w, fake_quantize(w, group_size), h), "gptq": output_error(w, w_q, h)}
            layer.w[f"{name}.weight"] = w_q

    out, _ = layer.forward(x, seq_len, before=quantize_group)
    return out, grids, report
