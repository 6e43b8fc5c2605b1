"""End-to-end tuning settings compared on one GPTQ checkpoint of the embedded SmolLM2 (group 64), on a GPU:

    python bench/awq_tune_sweep.py --out DIR [--settings STEPS:BATCH:GENERATED:LR:CODES_LR:SEED,...]
                                   [--device auto] [--budget-s S] [--max-windows N] [--parallel N]

GPTQ rounds the model once (aserve.quantization.quantize_model, as `aserve quantize` does), the float model writes
the largest GENERATED number of windows once (self_generated_windows, as `--tune-generated`), and each setting then
tunes a copy of the rounded checkpoint on the calibration windows plus the first GENERATED of those
(tune_end_to_end, as `--tune-steps STEPS --tune-batch BATCH --tune-lr LR --tune-codes-lr CODES_LR`) and is measured:
held-out perplexity (aserve/quantization/data/heldout.txt, on the CPU, as bench/awq_quality.py) against the bf16
model's, the KL to the float model before / after, and the greedy chat answer. `--budget-s`: no setting starts
after that many seconds. Writes DIR/sweep.json; prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from aserve.config import resolve_device
from aserve.model.loader import iterate_safetensors, resolve_model
from aserve.quantization.awq_format import AWQConfig
from aserve.quantization.perplexity import perplexity
from aserve.quantization.quantize import (LINEARS, calibration_ids, data_path, quantize_model, self_generated_windows,
                                          write_checkpoint)  # fmt: skip
from aserve.quantization.tune import tune_end_to_end
from awq_quality import chat_answer

GROUP = 64


def parse_settings(text: str) -> list[dict]:
    settings = []
    for item in text.split(","):
        steps, batch, generated, lr, codes_lr, seed = item.split(":")
        settings.append({"steps": int(steps), "batch": int(batch), "generated": int(generated), "lr": float(lr),
                         "codes_lr": float(codes_lr), "seed": int(seed)})  # fmt: skip
    return settings


def setting_name(s: dict) -> str:
    return "tune-{steps}x{batch}-gen{generated}-lr{lr:g}-codes{codes_lr:g}-seed{seed}".format(**s)


def tune_and_measure(s, args, state, rounded, cfg, tokenizer, model_dir, windows, generated, device) -> dict:
    tensors = dict(rounded)
    report = tune_end_to_end(state, tensors, cfg, LINEARS, torch.cat([windows, generated[: s["generated"]]]), GROUP,
                             s["steps"], s["lr"], batch_size=s["batch"], seed=s["seed"], progress=False,
                             codes_lr=s["codes_lr"], device=device)  # fmt: skip
    out_dir = os.path.join(args.out, setting_name(s))
    write_checkpoint(model_dir, out_dir, tensors, AWQConfig(group_size=GROUP), tokenizer)
    ppl, _ = perplexity(out_dir, args.heldout, max_windows=args.max_windows)
    row = {"name": setting_name(s), **s, **report, "ppl": ppl, "chat": chat_answer(out_dir)}
    print(json.dumps(row), flush=True)
    return row


def run_children(args, settings: list[dict], t_start: float) -> list[dict]:
    """Each setting in a process of its own, `args.parallel` at a time (tuning a small model is bound by the CPU
    launching kernels, not by the GPU); children still running at --budget-s are stopped."""
    threads = str(max(1, (os.cpu_count() or 2) // args.parallel))
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    pending, running, rows = list(settings), [], []
    while pending or running:
        while pending and len(running) < args.parallel:
            s = pending.pop(0)
            item = ":".join(str(s[k]) for k in ("steps", "batch", "generated", "lr", "codes_lr", "seed"))
            cmd = [sys.executable, __file__, "--out", args.out, "--settings", item, "--device", args.device, "--child"]
            if args.max_windows is not None:
                cmd += ["--max-windows", str(args.max_windows)]
            running.append((s, subprocess.Popen(cmd, env=env)))
        time.sleep(2)
        over = args.budget_s is not None and time.perf_counter() - t_start > args.budget_s
        for s, proc in list(running):
            if proc.poll() is None and not over:
                continue
            if proc.poll() is None:
                proc.kill()
                print(f"{setting_name(s)}: stopped (budget)", flush=True)
            running.remove((s, proc))
            result = os.path.join(args.out, setting_name(s) + ".json")
            if os.path.exists(result):
                with open(result) as f:
                    rows.append(json.load(f))
        if over:
            pending.clear()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--settings", default="240:2:238:1e-3:2e-2:0")
    p.add_argument("--device", default="auto")
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--parallel", type=int, default=1, help="settings tuned at once, each in its own process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-windows", type=int, default=None, help="held-out windows of 512 tokens (default: all)")
    args = p.parse_args()
    t_start = time.perf_counter()
    device = resolve_device(args.device)
    settings = parse_settings(args.settings)
    os.makedirs(args.out, exist_ok=True)
    with open(data_path("heldout.txt"), encoding="utf-8") as f:
        args.heldout = heldout = f.read()
    with open(data_path("calibration.txt"), encoding="utf-8") as f:
        calib_text = f.read()

    model_dir, _ = resolve_model(None)
    cfg = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    state = dict(iterate_safetensors(model_dir))
    bf16_ppl = rows = None
    if not args.child:
        t0 = time.perf_counter()
        bf16_ppl, tokens = perplexity(None, heldout, max_windows=args.max_windows)
        print(f"bf16: perplexity {bf16_ppl:.3f} over {tokens} tokens ({time.perf_counter() - t0:.0f} s)", flush=True)

    base = os.path.join(args.out, f"gptq-g{GROUP}")
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(base, "model.safetensors")):
        quantize_model(None, base, GROUP, "gptq", progress=False)
    rounded = load_file(os.path.join(base, "model.safetensors"))
    if not args.child:
        gptq_ppl, _ = perplexity(base, heldout, max_windows=args.max_windows)
        rows = [{"name": "gptq", "ppl": gptq_ppl, "seconds": round(time.perf_counter() - t0, 1)}]
        print(f"gptq: perplexity {gptq_ppl:.3f} ({100 * (gptq_ppl / bf16_ppl - 1):+.2f} %)", flush=True)

    windows = calibration_ids(tokenizer, calib_text, 1 << 30, 512)
    most = max(s["generated"] for s in settings)
    generated = windows[:0]
    cached = os.path.join(args.out, "generated.pt")  # reused by later runs with the same --out
    if os.path.exists(cached):
        generated = torch.load(cached)
    if len(generated) < most:
        t0 = time.perf_counter()
        generated = self_generated_windows(model_dir, windows, most, progress=False, device=str(device))
        torch.save(generated, cached)
        print(f"self-generated {most} windows in {time.perf_counter() - t0:.0f} s", flush=True)

    if args.child:  # one setting, in a process of its own (--parallel)
        rows = [tune_and_measure(settings[0], args, state, rounded, cfg, tokenizer, model_dir, windows, generated,
                                 device)]  # fmt: skip
        with open(os.path.join(args.out, rows[0]["name"] + ".json"), "w") as f:
            json.dump(rows[0], f)
        return
    if args.parallel > 1:
        rows += run_children(args, settings, t_start)
    else:
        for s in settings:
            if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
                print(f"{setting_name(s)}: skipped (budget)", flush=True)
                continue
            rows.append(tune_and_measure(s, args, state, rounded, cfg, tokenizer, model_dir, windows, generated,
                                         device))  # fmt: skip
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump({"bf16": bf16_ppl, "rows": rows}, f, indent=1)

    print(f"\n| setting | KL before -> after | codes moved | tune s | perplexity | vs bf16 {bf16_ppl:.3f} | chat |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        kl = f"{r['kl_before']:.4f} -> {r['kl_after']:.4f}" if "kl_before" in r else "-"
        print(f"| {r['name']} | {kl} | {r.get('codes_changed', '-')} | {r['seconds']} | {r['ppl']:.3f} | "
              f"{100 * (r['ppl'] / bf16_ppl - 1):+.2f} % | {r.get('chat', '-')} |")


if __name__ == "__main__":
    main()
