"""End-to-end tuning of a quantised model against the float model (`aserve quantize --tune-steps N`).

After GPTQ (or AWQ / RTN) has rounded every linear, its fp16 group scales and the RMSNorm weights are still free,
and each 4-bit code could still move to a neighbouring level. This stage trains them on the calibration text: each
group scale s becomes s * exp(a) with a trainable `a` (starting at 0, so step 0 is the checkpoint as rounded), the
norms train directly, and (`codes_lr` > 0) each code q gets a real-valued shift v, starting at 0, used as
clamp(q + round(v), 0, 15) with a straight-through gradient, so a code moves only after its gradient has pointed the
same way for many steps. The loss is KL(float model || quantised model) over every position of random calibration
windows (the float model is the teacher; no labels); Adam with a cosine schedule. The ideas are EfficientQAT's
(end-to-end training of the quantisation parameters; straight-through training of the rounded weights) with
distillation from the float model as the loss.

The output is the same AutoAWQ checkpoint (zero points unchanged; new fp16 scales, norm weights and, with codes_lr,
some codes), so it loads wherever the untuned one does. Float32, on the CPU or a GPU (TF32 matmuls there): both
models' forwards are DenseDecoderLayer's, so rope scaling, q/k/v biases and untied heads are handled as in
calibration. Memory: the codes as uint8 (one byte per weight; with codes_lr 12 more for the shifts and their Adam
state) plus the float model and the activations of a batch; meant for small models (SmolLM2-135M: ~7.5 s per step
of 2 x 512 tokens on 2 CPU cores, ~0.3 s per step of 16 x 512 on an H200, where 500 such steps with 2000
self-generated windows took the g64 checkpoint from +8.5 % to +3.8 % held-out perplexity; docs/quantization.md).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from aserve.kernels.awq_reference import unpack_int4
from aserve.layers.quantization.awq_format import pack_int4
from aserve.quantize.dense_layer import DenseDecoderLayer

NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


class _QuantizedLinear:
    """One packed linear as its codes and zero points (uint8 [out, in], [out, in / group]) and trainable scale
    factors [out, in / group]; with `train_codes`, also a trainable real-valued shift per code, rounded in the
    forward (straight-through gradient), so a code moves to a neighbouring level once its shift passes 0.5."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 train_codes: bool = False, device: torch.device | str = "cpu") -> None:  # fmt: skip
        self.codes = unpack_int4(qweight).t().to(device, torch.uint8).contiguous()  # [out, in]
        self.zeros = unpack_int4(qzeros).t().to(device, torch.uint8).contiguous()  # [out, in / group]
        self.scales = scales.to(device, torch.float32).t().contiguous()  # [out, in / group]
        self.log_factor = torch.zeros_like(self.scales, requires_grad=True)
        self.shift = torch.zeros(self.codes.shape, device=device, requires_grad=True) if train_codes else None
        self.group_size = group_size

    def tuned_scales(self) -> torch.Tensor:
        return self.scales * torch.exp(self.log_factor)

    def tuned_codes(self) -> torch.Tensor:
        codes = self.codes.float()
        if self.shift is not None:
            shift = self.shift + (self.shift.round() - self.shift).detach()
            codes = (codes + shift).clamp(0, 15)
        return codes

    def weight(self) -> torch.Tensor:
        out, inp = self.codes.shape
        w = self.tuned_codes().view(out, inp // self.group_size, self.group_size) - self.zeros.float().unsqueeze(-1)
        return (w * self.tuned_scales().unsqueeze(-1)).view(out, inp)


def _logits(layers: list[DenseDecoderLayer], embed: torch.Tensor, norm: torch.Tensor, head: torch.Tensor,
            ids: torch.Tensor, eps: float) -> torch.Tensor:  # fmt: skip
    seq_len = ids.shape[1]
    x = embed[ids.flatten()]
    for layer in layers:
        x, _ = layer.forward(x, seq_len)
    return F.linear(F.rms_norm(x, (x.shape[-1],), norm, eps), head)


@contextlib.contextmanager
def _tf32_matmuls(device: torch.device | str):
    """On a GPU, float32 matmuls in TF32 (10-bit mantissa) while tuning: the teacher's and the student's logits
    differ by the quantisation error, orders of magnitude above TF32's rounding, and the steps take a fraction of
    the time."""
    before = torch.get_float32_matmul_precision()
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def tune_end_to_end(
    float_state: dict[str, torch.Tensor],
    quantized: dict[str, torch.Tensor],
    hf_config,
    linears: tuple[str, ...],
    windows: torch.Tensor,
    group_size: int,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 2,
    seed: int = 0,
    progress: bool = True,
    codes_lr: float = 0.0,
    device: torch.device | str = "cpu",
) -> dict:
    """Trains the scales and norms (and, with codes_lr > 0, the codes) of `quantized` (a packed checkpoint's
    tensors, HF names) in place. `windows` [N, seq_len] calibration token ids; each step takes `batch_size` of them
    at random. Both models run on `device` in float32 (TF32 matmuls on a GPU); the results come back to the CPU.
    -> a report with the KL per token on a fixed batch of windows before and after, the number of codes that moved,
    and the seconds taken."""
    with _tf32_matmuls(device):
        t0 = time.perf_counter()
        train_codes = codes_lr > 0
        num_layers, eps = hf_config.num_hidden_layers, hf_config.rms_norm_eps
        seq_len = windows.shape[1]
        embed = float_state["model.embed_tokens.weight"].to(device, torch.float32)
        head = float_state.get("lm_head.weight", float_state["model.embed_tokens.weight"]).to(device, torch.float32)
        teacher, student, qlinears, norms = [], [], {}, {}
        for i in range(num_layers):
            prefix = f"model.layers.{i}."
            weights = {k.removeprefix(prefix): v.to(device, torch.float32) for k, v in float_state.items()
                       if k.startswith(prefix)}  # fmt: skip
            teacher.append(DenseDecoderLayer(weights, hf_config, seq_len))
            student_w = {k.removeprefix(prefix): v.to(device, torch.float32) for k, v in quantized.items()
                         if k.startswith(prefix) and k.endswith(".bias")}  # fmt: skip
            for name in linears:
                p = prefix + name
                qlinears[p] = _QuantizedLinear(quantized[p + ".qweight"], quantized[p + ".qzeros"],
                                               quantized[p + ".scales"], group_size, train_codes, device)  # fmt: skip
            for name in NORMS:
                norms[prefix + name] = quantized[prefix + name].to(device, torch.float32).clone().requires_grad_(True)
                student_w[name] = norms[prefix + name]
            student.append(DenseDecoderLayer(student_w, hf_config, seq_len))
        final_norm = quantized["model.norm.weight"].to(device, torch.float32)
        norms["model.norm.weight"] = final_norm.clone().requires_grad_(True)
        teacher_norm = float_state["model.norm.weight"].to(device, torch.float32)

        def student_logits(ids):
            for i, layer in enumerate(student):
                for name in linears:
                    layer.w[f"{name}.weight"] = qlinears[f"model.layers.{i}.{name}"].weight()
            return _logits(student, embed, norms["model.norm.weight"], head, ids, eps)

        def kl(ids) -> torch.Tensor:
            ids = ids.to(device)
            with torch.no_grad():
                target = F.log_softmax(_logits(teacher, embed, teacher_norm, head, ids, eps), -1)
            return F.kl_div(F.log_softmax(student_logits(ids), -1), target, log_target=True, reduction="batchmean")

        gen = torch.Generator().manual_seed(seed)
        probe = windows[torch.randperm(len(windows), generator=gen)[: min(batch_size, len(windows))]]
        with torch.no_grad():
            kl_before = kl(probe).item()
        params = [q.log_factor for q in qlinears.values()] + list(norms.values())
        groups = [{"params": params}]
        if train_codes:
            groups.append({"params": [q.shift for q in qlinears.values()], "lr": codes_lr})
        opt = torch.optim.Adam(groups, lr=lr)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
        bar = range(steps)
        if progress:
            bar = tqdm(bar, desc="end-to-end tuning", unit="step")
        for step in bar:
            batch = windows[torch.randint(0, len(windows), (batch_size,), generator=gen)]
            loss = kl(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            if progress and (step % 10 == 0 or step == steps - 1):  # .item() waits for the device
                bar.set_postfix(kl=f"{loss.item():.4f}")
        with torch.no_grad():
            kl_after = kl(probe).item()
            changed = 0
            for p, q in qlinears.items():
                quantized[p + ".scales"] = q.tuned_scales().t().to("cpu", quantized[p + ".scales"].dtype).contiguous()
                if train_codes:
                    codes = q.tuned_codes().to(torch.int32)
                    changed += int((codes != q.codes).sum())
                    quantized[p + ".qweight"] = pack_int4(codes.t().contiguous()).cpu()
            for name, w in norms.items():
                quantized[name] = w.detach().to("cpu", quantized[name].dtype).contiguous()
        seconds = round(time.perf_counter() - t0, 1)
        return {
            "kl_before": kl_before,
            "kl_after": kl_after,
            "steps": steps,
            "codes_changed": changed,
            "seconds": seconds,
        }
