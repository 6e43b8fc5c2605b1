#!/usr/bin/env python
"""Experiment (session 9, not yet part of `aserve quantize`): end-to-end distillation of AWQ group scales after GPTQ.

    python bench/awq_e2e_tune_experiment.py GPTQ_CHECKPOINT_DIR OUT_DIR steps=80 lr=1e-3 [bs=2] [norm=1] [bf16=0]

GPTQ codes and zero points stay fixed; each group scale gets a trainable log-factor and the RMSNorm weights train
too, minimising KL(float model || quantised model) on windows of the shipped calibration text. Writes the same
AutoAWQ checkpoint with new scales / norms. Default SmolLM2 only (default rope, no biases, tied lm_head). Result in
docs/benchmarks.md (session 9): +8.67 % -> +6.81 % held-out perplexity after 80 steps.
"""
import os, sys, time, json, shutil
import torch, torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer
from aserve.model.loader import resolve_model, iterate_safetensors
from aserve.quantization.quantize import data_path
from kernels.awq_reference import unpack_int4

args = dict(a.split("=") for a in sys.argv[3:])
src_q, out = sys.argv[1], sys.argv[2]
steps = int(args.get("steps", 100)); lr = float(args.get("lr", 1e-3)); bs = int(args.get("bs", 2))
seq = int(args.get("seq", 512)); train_norm = int(args.get("norm", 1)); nwin = int(args.get("nwin", 1000))
calib = args.get("calib", data_path("calibration.txt"))
torch.manual_seed(0)
model_dir, _ = resolve_model(None)
cfg = AutoConfig.from_pretrained(model_dir)
tok = AutoTokenizer.from_pretrained(model_dir)
fs = {k: v.float() for k, v in iterate_safetensors(model_dir)}
qs = load_file(os.path.join(src_q, "model.safetensors"))
G = json.load(open(os.path.join(src_q, "config.json")))["quantization_config"]["group_size"]
H, NH, KV, D, L = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
LIN = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
eps = cfg.rms_norm_eps
inv = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2).float() / D))
ang = torch.arange(seq).float()[:, None] * inv[None]
cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

def rope(x):  # [B, h, L, D]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin

def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

offs, logs, norms = {}, {}, {}
for i in range(L):
    for n in LIN:
        p = f"model.layers.{i}.{n}."
        q = unpack_int4(qs[p + "qweight"]).float()  # [in, out]
        z = unpack_int4(qs[p + "qzeros"]).float()  # [in/g, out]
        offs[i, n] = q - z.repeat_interleave(G, 0)
        logs[i, n] = torch.zeros_like(z, requires_grad=True)
        logs[i, n + "s"] = qs[p + "scales"].float()
    for n in ("input_layernorm", "post_attention_layernorm"):
        norms[i, n] = qs[f"model.layers.{i}.{n}.weight"].float().clone().requires_grad_(bool(train_norm))
norms["final"] = fs["model.norm.weight"].clone().requires_grad_(bool(train_norm))
emb = fs["model.embed_tokens.weight"]

def weight(i, n, student):
    if not student:
        return fs[f"model.layers.{i}.{n}.weight"].t()
    s = logs[i, n + "s"] * torch.exp(logs[i, n])
    return offs[i, n] * s.repeat_interleave(G, 0)

def forward(ids, student):
    B, T = ids.shape
    x = emb[ids]
    for i in range(L):
        nw = (lambda n: norms[i, n]) if student else (lambda n: fs[f"model.layers.{i}.{n}.weight"])
        h = rms(x, nw("input_layernorm"))
        q = (h @ weight(i, LIN[0], student)).view(B, T, NH, D).transpose(1, 2)
        k = (h @ weight(i, LIN[1], student)).view(B, T, KV, D).transpose(1, 2)
        v = (h @ weight(i, LIN[2], student)).view(B, T, KV, D).transpose(1, 2)
        c = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        x = x + c.transpose(1, 2).reshape(B, T, H) @ weight(i, LIN[3], student)
        h = rms(x, nw("post_attention_layernorm"))
        x = x + (F.silu(h @ weight(i, LIN[4], student)) * (h @ weight(i, LIN[5], student))) @ weight(i, LIN[6], student)
    x = rms(x, norms["final"] if student else fs["model.norm.weight"])
    return x @ emb.t()

text = open(calib).read()
ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
nw_ = min(nwin, ids.numel() // seq)
wins = ids[: nw_ * seq].view(nw_, seq)
print("windows", nw_, flush=True)
params = [p for k, p in logs.items() if not (isinstance(k, tuple) and k[1].endswith("s"))]
params += [p for p in norms.values() if p.requires_grad]
opt = torch.optim.Adam(params, lr=lr)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
t0 = time.time()
for step in range(steps):
    sel = torch.randint(0, nw_, (bs,))
    x = wins[sel]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(int(args.get("bf16", 0)))):
        with torch.no_grad():
            tl = F.log_softmax(forward(x, False).float(), -1)
        sl = F.log_softmax(forward(x, True).float(), -1)
    loss = F.kl_div(sl, tl, log_target=True, reduction="batchmean") / seq
    opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    if step % 10 == 0 or step == steps - 1:
        print(f"step {step} kl {loss.item():.4f} t {time.time()-t0:.0f}s", flush=True)

# write checkpoint
os.makedirs(out, exist_ok=True)
new = dict(qs)
with torch.no_grad():
    for i in range(L):
        for n in LIN:
            p = f"model.layers.{i}.{n}."
            new[p + "scales"] = (logs[i, n + "s"] * torch.exp(logs[i, n])).half().contiguous()
        for n in ("input_layernorm", "post_attention_layernorm"):
            new[f"model.layers.{i}.{n}.weight"] = norms[i, n].detach().to(qs[f"model.layers.{i}.{n}.weight"].dtype).contiguous()
    new["model.norm.weight"] = norms["final"].detach().to(qs["model.norm.weight"].dtype).contiguous()
save_file(new, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
for f in os.listdir(src_q):
    if f != "model.safetensors":
        shutil.copy(os.path.join(src_q, f), out)
print("written", out)
