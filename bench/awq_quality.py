"""AWQ quality on CPU: perplexity of the embedded SmolLM2-135M-Instruct (bf16) against its int4 versions (plain
round-to-nearest, AWQ, GPTQ, AWQ + GPTQ, per group size) on held-out text, plus the greedy chat check, in one command:

    python bench/awq_quality.py [--groups 64,32] [--methods rtn,awq,gptq,awq-gptq] [--window 512] [--max-windows N]
                                [--num-samples 16] [--sequential] [--no-act-order] [--out DIR]
                                [--tune-steps N [--tune-lr 1e-3] [--tune-codes-lr LR]]

Held-out text: aserve/quantize/data/heldout.txt (Alice's Adventures in Wonderland); the quantiser calibrates
on calibration.txt (As You Like It, Paradise Lost I-III). Quantised checkpoints go to --out (reused if present).
Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from aserve import LLM, SamplingParams
from aserve.quantize.perplexity import perplexity
from aserve.quantize.quantize import data_path, quantize_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat_answer(model: str | None) -> str:
    llm = LLM(model, max_model_len=512, kv_cache_memory_gb=0.1, enforce_eager=True)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32))
    return out[0].outputs[0].text.strip().replace("\n", " ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default="64,32")
    p.add_argument("--methods", default="rtn,awq,awq-gptq")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--num-samples", type=int, default=16, help="calibration sequences of 512 tokens")
    p.add_argument("--sequential", action="store_true", help="calibrate on the quantised model's activations")
    p.add_argument("--no-act-order", action="store_true", help="GPTQ in input order (the default: act order)")
    p.add_argument("--tune-steps", type=int, default=0, help="end-to-end tuning after rounding (tune.py)")
    p.add_argument("--tune-lr", type=float, default=1e-3)
    p.add_argument("--tune-codes-lr", type=float, default=0.0)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "aserve-awq-quality"))
    args = p.parse_args()
    with open(data_path("heldout.txt"), encoding="utf-8") as f:
        text = f.read()

    rows = []
    t0 = time.perf_counter()
    base, count = perplexity(None, text, args.window, args.max_windows)
    rows.append(("bf16", "-", base, time.perf_counter() - t0, None, chat_answer(None)))
    print(f"bf16: perplexity {base:.3f} over {count} tokens", flush=True)
    for group in (int(g) for g in args.groups.split(",")):
        for method in args.methods.split(","):
            tuned = f"-tune{args.tune_steps}-{args.tune_lr:g}-{args.tune_codes_lr:g}" if args.tune_steps else ""
            out = os.path.join(args.out, f"{method}-g{group}{tuned}")
            seconds = None
            if not os.path.exists(os.path.join(out, "model.safetensors")):
                seconds = quantize_model(None, out, group_size=group, method=method, num_samples=args.num_samples,
                                         sequential=args.sequential, act_order=not args.no_act_order,
                                         tune_steps=args.tune_steps, tune_lr=args.tune_lr,
                                         tune_codes_lr=args.tune_codes_lr)["seconds"]  # fmt: skip
            t0 = time.perf_counter()
            ppl, _ = perplexity(out, text, args.window, args.max_windows)
            rows.append((method.upper(), group, ppl, time.perf_counter() - t0, seconds, chat_answer(out)))
            print(f"{method} g{group}: perplexity {ppl:.3f} ({100 * (ppl / base - 1):+.2f} %)", flush=True)

    print(f"\nheld-out tokens scored: {count} (windows of {args.window})\n")
    print("| model | group | perplexity | vs bf16 | quantise s | eval s | chat: capital of France? |")
    print("|---|---|---|---|---|---|---|")
    for name, group, ppl, eval_s, quant_s, answer in rows:
        quant = "-" if quant_s is None else f"{quant_s:.0f}"
        print(f"| {name} | {group} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f} % | {quant} | {eval_s:.0f} | "
              f"{answer[:60]}{' (Paris)' if 'Paris' in answer else ' (NO PARIS)'} |")  # fmt: skip


if __name__ == "__main__":
    main()
