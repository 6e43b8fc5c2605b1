"""Block-output tuning of a quantised decoder layer: learned rounding and scales (after AutoRound, Cheng et al.
2023, "Optimize Weight Rounding via Signed Gradient Descent").

GPTQ picks each linear's integers to minimise that linear's output error on its own inputs; what the model needs is
the whole layer's output to stay close. This tunes, per linear, an offset V per weight and a log-factor per group's
scale so that the quantised layer reproduces the float layer's output on the calibration tokens:

    W_q = (clamp(round(W / s + V) + z, 0, 15) - z) * s,    s = s0 * exp(l)

starting from GPTQ's integers (V0 = q - z - W / s0, so round() gives them back) with zero points fixed. round()
passes gradients straight through; the parameters move by signed gradient descent, the step decaying linearly to
zero (AutoRound's optimiser: bounded total movement, insensitive to the gradients' scale). The loss is the mean
squared error of the layer's output against the float layer's, on random mini-batches of calibration sequences.
The tuned integers are kept only if the error over all calibration tokens went down.
"""

from __future__ import annotations

import torch

from aserve.quantization.dense_layer import DenseDecoderLayer
from aserve.quantization.gptq import dequantize

Grid = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q int32 [out, in], z int32 [out, in/g], s fp16 [out, in/g]


class _TunedLinear:
    def __init__(self, w: torch.Tensor, grid: Grid, init: str, bound: float) -> None:
        q, z, s = grid
        self.bound = bound
        self.group_size = q.shape[1] // z.shape[1]
        self.w = w.float()
        self.z = z.float().repeat_interleave(self.group_size, 1)
        self.s0 = s.float()
        self.log_s = torch.zeros_like(self.s0, requires_grad=True)
        if init == "gptq":  # round() gives GPTQ's integers back
            v0 = (q.float() - self.z) - self.w / self.s0.repeat_interleave(self.group_size, 1)
        else:  # "rtn": round to nearest on the same grids
            v0 = torch.zeros_like(self.w)
        self.v = v0.clamp(-bound, bound).requires_grad_(True)

    def scale(self) -> torch.Tensor:
        return (self.s0 * self.log_s.exp()).repeat_interleave(self.group_size, 1)

    def weight(self) -> torch.Tensor:
        s = self.scale()
        u = self.w / s + self.v
        u = u + (u.round() - u).detach()  # round, gradients straight through
        return (torch.clamp(u + self.z, 0, 15) - self.z) * s

    @torch.no_grad()
    def grid(self) -> Grid:
        s = (self.s0 * self.log_s.exp()).half()
        s_full = s.float().repeat_interleave(self.group_size, 1)
        q = torch.clamp((self.w / s_full + self.v).round() + self.z, 0, 15)
        return q.to(torch.int32), self.z[:, :: self.group_size].to(torch.int32), s


@torch.no_grad()
def _layer_error(layer: DenseDecoderLayer, x: torch.Tensor, target: torch.Tensor, seq_len: int) -> float:
    out, _ = layer.forward(x, seq_len)
    return (out - target).pow(2).mean().item()


def tune_layer(
    layer: DenseDecoderLayer, float_weights: dict[str, torch.Tensor], grids: dict[str, Grid], x: torch.Tensor,
    target: torch.Tensor, seq_len: int, steps: int = 100, batch: int = 4, lr: float | None = None,
    scale_lr: float | None = None, seed: int = 0, init: str = "gptq", bound: float = 1.0,
) -> tuple[dict[str, Grid], dict[str, float]]:  # fmt: skip
    """layer.w holds the GPTQ-dequantised linears; float_weights the float ones ("<linear>.weight"); x [N * seq_len,
    hidden] the calibration stream entering the layer, target the float layer's output on it. -> (the tuned grids,
    or `grids` unchanged when tuning did not lower the error, {"before", "after"}: mean squared output error over
    all calibration tokens). layer.w ends with the kept grids' dequantised weights."""
    lr = 2.0 / steps if lr is None else lr
    scale_lr = lr / 10 if scale_lr is None else scale_lr
    before = _layer_error(layer, x, target, seq_len)
    tuned = {name: _TunedLinear(float_weights[f"{name}.weight"], grid, init, bound) for name, grid in grids.items()}
    params = [p for t in tuned.values() for p in (t.v, t.log_s)]
    rates = [r for _ in tuned for r in (lr, scale_lr)]
    num_seqs = x.shape[0] // seq_len
    xs, ts = x.view(num_seqs, seq_len, -1), target.view(num_seqs, seq_len, -1)
    gen = torch.Generator().manual_seed(seed)
    saved = dict(layer.w)
    for step in range(steps):
        pick = torch.randperm(num_seqs, generator=gen)[: min(batch, num_seqs)]
        for name, t in tuned.items():
            layer.w[f"{name}.weight"] = t.weight()
        out, _ = layer.forward(xs[pick].reshape(-1, xs.shape[-1]), seq_len)
        loss = (out - ts[pick].reshape(-1, ts.shape[-1])).pow(2).mean()
        grads = torch.autograd.grad(loss, params)
        decay = 1.0 - step / steps
        with torch.no_grad():
            for p, g, rate in zip(params, grads, rates):
                p.sub_(rate * decay * g.sign())
            for t in tuned.values():
                t.v.clamp_(-t.bound, t.bound)
    new_grids = {name: t.grid() for name, t in tuned.items()}
    for name, grid in new_grids.items():
        layer.w[f"{name}.weight"] = dequantize(*grid)
    after = _layer_error(layer, x, target, seq_len)
    if after >= before:
        layer.w.update(saved)
        return grids, {"before": before, "after": before, "rejected": after}
    return new_grids, {"before": before, "after": after}
