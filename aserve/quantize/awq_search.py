"""Activation-aware weight quantisation (AWQ, Lin et al. 2023) of one decoder layer, following AutoAWQ.

Int4 rounding error hurts most on the input channels that see large activations. AWQ multiplies each input
channel of a group of linears by a scale s (W' = W * s) and divides the op before them by s (the RMSNorm weight,
or the rows of the preceding linear), so the float model is unchanged while the salient channels get finer steps:

    y = W x = (W * s) (x / s)         s = x_mean^r / w_mean^(1-r), normalised; r on a grid in [0, 1)

For each group, r is the one minimising the error of the block's output (attention, MLP, or the linear itself)
on calibration activations; s = 1 (plain round-to-nearest) is a candidate too, so the search never does worse
than RTN on the calibration data. Then, per output channel and group, a clipping threshold is searched (clipping
the largest weights trades their error for finer steps everywhere else). The weights are then packed as usual.

Groups and where their scales fold (as AutoAWQ's Llama recipe):
    q/k/v_proj   <- input_layernorm                 gate/up_proj <- post_attention_layernorm
    o_proj       <- v_proj rows (only without GQA)  down_proj    <- up_proj rows
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from aserve.layers.quantization.awq_format import fake_quantize
from aserve.quantize.dense_layer import DenseDecoderLayer, LayerInputs, Weights

_ATTN = "self_attn."
_MLP = "mlp."
_NO_CLIP = ("q_proj", "k_proj")  # as AutoAWQ: clipping q/k hurts attention scores


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).float().pow(2).mean().item()


@torch.no_grad()
def search_scales(
    x: torch.Tensor,
    names: list[str],
    weights: Weights,
    block: Callable[[Weights], torch.Tensor],
    group_size: int,
    n_grid: int = 20,
) -> tuple[torch.Tensor, dict[str, float]]:
    """x [T, C]: the group's input; `names` its linears (weights[name] [out, C]); block(override) the output of
    the inspected block with the given weights. -> (scales [C], {"rtn": loss at s = 1, "awq": best loss})."""
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)
    w = torch.cat([weights[n] for n in names], dim=0)
    wg = w.abs().reshape(-1, group_size)
    w_mean = (wg / (wg.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)
    reference = block({})
    best_scales = torch.ones_like(x_mean)
    rtn = best = mse(block({n: fake_quantize(weights[n], group_size) for n in names}), reference)
    for i in range(n_grid):
        ratio = i / n_grid
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        candidate = {n: fake_quantize(weights[n] * s, group_size) / s for n in names}
        loss = mse(block(candidate), reference)
        if loss < best:
            best, best_scales = loss, s
    return best_scales, {"rtn": rtn, "awq": best}


@torch.no_grad()
def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int, n_grid: int = 20, max_shrink: float = 0.5):
    """-> (low, high) [out, in/g] each: the clipping range per (output, group) minimising, per group, the mean
    squared error of that group's share of each output over the rows of x [T, in].

    AutoAWQ clips symmetrically (|w| <= m); on aserve's asymmetric grids the two ends are searched independently
    (low = min * (1 - i / n_grid), high = max * (1 - j / n_grid)), a superset of the symmetric candidates that
    matter, which pays off most on weights that were 4-bit already (a Q4_1 GGUF: each group of 64 is two groups
    of 32 with their own grids). The error is (q - w) G (q - w)^T with G = x_g^T x_g / T the group's [g, g] Gram
    matrix, so every token counts at the cost of a [g, g] product per weight row (AutoAWQ samples 512 tokens)."""
    x = x.reshape(-1, x.shape[-1]).float()
    n_groups = w.shape[1] // group_size
    xg = x.reshape(x.shape[0], n_groups, group_size).transpose(0, 1)  # [G, T, g]
    gram = torch.bmm(xg.transpose(1, 2), xg) / x.shape[0]  # [G, g, g]
    return search_clip_gram(gram, w, group_size, n_grid, max_shrink)


@torch.no_grad()
def search_clip_gram(gram: torch.Tensor, w: torch.Tensor, group_size: int, n_grid: int = 20, max_shrink: float = 0.5):
    """search_clip given each group's Gram matrix gram [G, g, g] (x_g^T x_g / T) rather than the inputs; GPTQ
    calls it one group at a time with the group's block of its Hessian."""
    n_groups = w.shape[1] // group_size
    wg = w.float().reshape(w.shape[0], n_groups, group_size).transpose(0, 1)  # [G, out, g]
    org_min = wg.amin(-1, keepdim=True).clamp(max=0)  # [G, out, 1]; grids always include 0
    org_max = wg.amax(-1, keepdim=True).clamp(min=0)
    best_err = torch.full(org_max.shape[:2], float("inf"), device=org_max.device)
    best_lo, best_hi = org_min.clone(), org_max.clone()
    steps = int(max_shrink * n_grid)
    highs = torch.stack([org_max * (1 - j / n_grid) for j in range(steps)])  # [steps, G, out, 1]
    for i in range(steps):
        lo = org_min * (1 - i / n_grid)
        clipped = torch.maximum(torch.minimum(wg, highs), lo)  # all high ends at once: fewer, larger ops
        delta = fake_quantize(clipped.reshape(-1, group_size), group_size).reshape(clipped.shape) - wg
        errs = (torch.matmul(delta, gram) * delta).sum(-1)  # [steps, G, out]
        for hi, err in zip(highs, errs):
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo = torch.where(better[..., None], lo, best_lo)
            best_hi = torch.where(better[..., None], hi, best_hi)
    return best_lo.squeeze(-1).t().contiguous(), best_hi.squeeze(-1).t().contiguous()


def apply_clip(w: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor], group_size: int) -> torch.Tensor:
    low, high = bounds
    wg = w.reshape(w.shape[0], -1, group_size)
    return torch.maximum(torch.minimum(wg, high[..., None]), low[..., None]).reshape(w.shape)


@torch.no_grad()
def awq_layer(
    layer: DenseDecoderLayer, feats: LayerInputs, seq_len: int, group_size: int, n_grid: int = 20, clip: bool = True
) -> dict[str, dict[str, float]]:
    """Scales and clips layer.w in place (the float layer computes the same function afterwards, up to clipping).
    `feats` are the linears' inputs from layer.forward. -> losses per group ({"rtn", "awq"}) for the report."""
    w = layer.w
    qkv = [f"{_ATTN}{p}_proj.weight" for p in "qkv"]
    gate_up = [f"{_MLP}gate_proj.weight", f"{_MLP}up_proj.weight"]
    # (label, input, linears, inspected block, op that absorbs 1/s)
    groups = [
        ("qkv", feats.qkv, qkv, lambda o: layer.attention(feats.qkv, seq_len, o)[0], "input_layernorm"),
        ("gate_up", feats.gate_up, gate_up, lambda o: layer.mlp(feats.gate_up, o)[0], "post_attention_layernorm"),
        ("down_proj", feats.down_proj, [f"{_MLP}down_proj.weight"],
         lambda o: layer.linear(f"{_MLP}down_proj", feats.down_proj, o), f"{_MLP}up_proj"),
    ]  # fmt: skip
    if w[f"{_ATTN}v_proj.weight"].shape == w[f"{_ATTN}o_proj.weight"].shape:  # no GQA: o_proj folds into v_proj
        groups.insert(1, ("o_proj", feats.o_proj, [f"{_ATTN}o_proj.weight"],
                          lambda o: layer.linear(f"{_ATTN}o_proj", feats.o_proj, o), f"{_ATTN}v_proj"))  # fmt: skip
    # All scales are searched on the layer as it came (as AutoAWQ), then applied together.
    found = [(g, search_scales(x, names, w, block, group_size, n_grid)) for g, x, names, block, _ in groups]
    report = {}
    inputs = {"qkv": feats.qkv, "o_proj": feats.o_proj, "gate_up": feats.gate_up, "down_proj": feats.down_proj}
    for (label, _, names, _, prev), (_, (s, losses)) in zip(groups, found):
        report[label] = losses
        for name in names:
            w[name] = w[name] * s
        if prev.endswith("norm"):
            w[f"{prev}.weight"] = w[f"{prev}.weight"] / s
        else:  # a linear: its output rows (and bias) feed the scaled inputs
            w[f"{prev}.weight"] = w[f"{prev}.weight"] / s[:, None]
            if f"{prev}.bias" in w:
                w[f"{prev}.bias"] = w[f"{prev}.bias"] / s
        inputs[label] = inputs[label] / s
    if clip:
        for label, names in (("qkv", qkv), ("o_proj", [f"{_ATTN}o_proj.weight"]), ("gate_up", gate_up),
                             ("down_proj", [f"{_MLP}down_proj.weight"])):  # fmt: skip
            for name in names:
                if any(skip in name for skip in _NO_CLIP):
                    continue
                w[name] = apply_clip(w[name], search_clip(inputs[label], w[name], group_size, n_grid), group_size)
    return report
