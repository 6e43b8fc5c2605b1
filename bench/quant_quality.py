"""Quantisation quality on CPU in one command: the default model (SmolLM2-135M-Instruct, the embedded GGUF dequantised
to float weights) unquantised and through aserve's weight quantisations, each against the unquantised model:

    python bench/quant_quality.py [--dtype bfloat16] [--methods fp32,int8,fp8,awq,gptq,...] [--window 512]
                                  [--max-windows N] [--prompts 16] [--prompt-len 32] [--max-tokens 32]
                                  [--group-size 64] [--num-samples 16] [--out DIR]

Rows (the baseline is the model in --dtype, unquantised):
    fp32    the same model in float32 (the float noise floor of the comparison)
    int8    `--quantization int8`: int8 weights, one scale per output channel, quantised at load
    fp8     `--quantization fp8`: e4m3 weights, one scale per output channel, quantised at load; without FP8 tensor
            cores (this CPU) weight-only: the activations are not quantised, as a GPU's FP8 kernels do at up to 16
            rows but not beyond (per-token e4m3 activations into torch._scaled_mm)
    awq     `aserve quantize --method awq` (int4, AutoAWQ format), group --group-size
    gptq    `aserve quantize --method gptq --format gptq` (int4, GPTQ format), group --group-size
    gptq-head  the same with `--quantize-lm-head`: the head quantised too, by GPTQ on the calibration tokens
    ROW+head  ROW with `--quantize-lm-head` (base+head: the unquantised model's): the lm_head rounded at load, int8
            per channel (base, int8), fp8 per channel (fp8) or int4 (awq, gptq: per group of 128 inputs, or of
            --group-size where 128 does not divide the hidden size); the tied embedding keeps its table
    ROW+fp8kv  ROW (or ROW+head) with `--kv-cache-dtype fp8` (base+fp8kv: the unquantised model's): the KV cache in
            e4m3, per-tensor scales 1.0; perplexity then reads every key and value through the FP8 cache
The int4 checkpoints are written to --out (reused when present; calibration: --num-samples x 512 tokens of
aserve/quantize/data/calibration.txt).

Columns: perplexity on aserve/quantize/data/heldout.txt (aserve/quantize/perplexity.py: consecutive windows of
--window tokens, through each model's own forward) and its change against the baseline; greedy agreement with the
baseline over --prompts prompts (the first --prompt-len tokens of evenly spaced held-out windows, --max-tokens
greedy tokens each, EOS ignored): "prefix" is the mean share of a continuation's tokens before its first difference
from the baseline's, "identical" the share of continuations equal to the baseline's; multiple choice: the 20
questions of bench/lm_eval_task scored as lm-evaluation-harness scores them (acc, acc_norm) and how many of each
model's picks equal the baseline's. Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

from aserve import LLM, SamplingParams
from aserve.layers.quantization.lm_head import int4_group_size
from aserve.quantize.perplexity import model_nll, window_ids
from aserve.quantize.quantize import data_path, quantize_model

MC_QUESTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_task", "questions.jsonl")
SMOLLM2_HIDDEN = 576  # the int4 head's group: 128 where it divides the hidden size (not SmolLM2's), else --group-size
ONLINE = {"int8": "int8", "fp8": "fp8"}  # row -> --quantization
# row -> (aserve quantize --method, --format, --quantize-lm-head)
CHECKPOINTS = {"awq": ("awq", "awq", False), "gptq": ("gptq", "gptq", False), "gptq-head": ("gptq", "gptq", True)}
LABELS = {
    "fp32": "float32, unquantised",
    "int8": "int8 per channel (`--quantization int8`)",
    "fp8": "fp8 e4m3 per channel (`--quantization fp8`, weight-only on CPU)",
    "awq": "AWQ int4 g{g} (`aserve quantize --method awq`)",
    "gptq": "GPTQ int4 g{g} (`aserve quantize --method gptq --format gptq`)",
    "gptq-head": "GPTQ int4 g{g} with its lm_head GPTQ int4 g{g} (`aserve quantize ... --quantize-lm-head`)",
    "base": "{dtype}, unquantised",
}
HEAD_KINDS = {"fp8": "fp8", "awq": "int4 g{hg}", "gptq": "int4 g{hg}"}  # row -> its quantised head (else int8)
HEAD_METHODS = ("fp32", "base", "int8", "fp8", "awq", "gptq")  # the rows that take +head


def evaluate(model: str | None, dtype: str, quantization: str | None, text: str, args,
             quantize_lm_head: bool = False, kv_cache_dtype: str = "auto") -> dict:  # fmt: skip
    """-> {"ppl", "tokens", "outputs", "seconds"} of one model: perplexity on the held-out windows, then greedy
    continuations of the prompts."""
    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype, device="cpu", quantization=quantization, max_model_len=args.window,
              max_num_seqs=args.prompts, enforce_eager=True, kv_cache_memory_gb=0.25,
              enable_prefix_caching=False, quantize_lm_head=quantize_lm_head,
              kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    windows = window_ids(llm.get_tokenizer(), text, args.window)
    scored = windows[: args.max_windows] if args.max_windows else windows
    total, count = model_nll(llm.engine.core.runner.model, scored, kv_dtype=llm.engine.core.runner.kv_dtype)
    step = max(1, len(windows) // args.prompts)
    prompts = [windows[i * step][: args.prompt_len] for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"ppl": math.exp(total / count), "tokens": count, "outputs": [o.outputs[0].token_ids for o in outs],
            "choices": multiple_choice(llm), "seconds": time.perf_counter() - t0}  # fmt: skip


def multiple_choice(llm: LLM) -> list[tuple[int, int, int]]:
    """bench/lm_eval_task's questions as lm-evaluation-harness scores them (the task's prompt, each choice's
    log-likelihood after it; acc: the largest sum, acc_norm: the largest per character) -> per question (answer,
    acc's pick, acc_norm's pick). The log-likelihoods are the prompt logprobs of context + choice."""
    tok = llm.get_tokenizer()
    with open(MC_QUESTIONS, encoding="utf-8") as f:
        questions = [json.loads(line) for line in f if line.strip()]
    requests, spans = [], []
    for q in questions:
        context = f"Question: {q['question']}\nAnswer:"
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        for choice in q["choices"]:
            ids = tok(f"{context} {choice}", add_special_tokens=False)["input_ids"]
            requests.append({"prompt_token_ids": ids})
            spans.append(len(ctx))
    outs = llm.generate(requests, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    scores = []
    for out, start in zip(outs, spans, strict=True):
        ids = out.prompt_token_ids
        scores.append(sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))))
    picks, i = [], 0
    for q in questions:
        ll = scores[i : i + len(q["choices"])]
        norm = [v / len(c) for v, c in zip(ll, q["choices"], strict=True)]
        picks.append((q["answer"], ll.index(max(ll)), norm.index(max(norm))))
        i += len(q["choices"])
    return picks


def agreement(base: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """-> (mean share of each continuation before its first difference from the baseline's, share identical)."""
    prefixes = []
    for b, o in zip(base, other, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(b, o)) if x != y), min(len(b), len(o)))
        prefixes.append(same / len(b))
    return sum(prefixes) / len(prefixes), sum(p == 1.0 for p in prefixes) / len(prefixes)


def checkpoint(row: str, args) -> tuple[str, float | None]:
    """The int4 checkpoint of `row` under --out (written first if absent) -> (its directory, seconds to write)."""
    method, fmt, head = CHECKPOINTS[row]
    out = os.path.join(args.out, f"{method}-{fmt}-g{args.group_size}-n{args.num_samples}{'-head' if head else ''}")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out, None
    report = quantize_model(None, out, group_size=args.group_size, method=method, num_samples=args.num_samples,
                            device="cpu", fmt=fmt, progress=False, quantize_lm_head=head)  # fmt: skip
    return out, report["seconds"]


def parse_row(row: str) -> tuple[str, bool, bool]:
    """A --methods entry -> (method, +head, +fp8kv)."""
    fp8_kv = row.endswith("+fp8kv")
    rest = row.removesuffix("+fp8kv")
    return rest.removesuffix("+head"), rest.endswith("+head"), fp8_kv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", help="the baseline's (and every quantised model's) dtype")
    p.add_argument("--methods", default="fp32,int8,fp8,awq,gptq")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--group-size", type=int, default=64, help="AWQ / GPTQ (SmolLM2's hidden size 576: 64 or 32)")
    p.add_argument("--num-samples", type=int, default=16, help="AWQ / GPTQ calibration sequences of 512 tokens")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "aserve-quant-quality"))
    args = p.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = {m for m in methods if parse_row(m)[0] not in (HEAD_METHODS if parse_row(m)[1] else LABELS)}
    if unknown:
        p.error(
            f"unknown methods {sorted(unknown)} (choose from {', '.join(LABELS)}; ROW+head for ROW in "
            f"{', '.join(HEAD_METHODS)})"
        )
    with open(data_path("heldout.txt"), encoding="utf-8") as f:
        text = f.read()

    base = evaluate(None, args.dtype, None, text, args)
    print(f"{args.dtype}: perplexity {base['ppl']:.3f} over {base['tokens']} tokens ({base['seconds']:.0f} s)",
          flush=True)  # fmt: skip
    rows = [(f"{args.dtype}, unquantised (baseline)", base, None)]
    for row in methods:
        method, head, fp8_kv = parse_row(row)
        model, dtype, quantization, seconds = None, args.dtype, ONLINE.get(method), None
        if method == "fp32":
            dtype = "float32"
        elif method in CHECKPOINTS:
            model, seconds = checkpoint(method, args)
        result = evaluate(model, dtype, quantization, text, args, quantize_lm_head=head,
                          kv_cache_dtype="fp8" if fp8_kv else "auto")  # fmt: skip
        label = LABELS[method].format(g=args.group_size, dtype=args.dtype)
        if head:
            kind = HEAD_KINDS.get(method, "int8").format(hg=int4_group_size(SMOLLM2_HIDDEN, args.group_size))
            label += f" + {kind} lm_head (`--quantize-lm-head`)"
        if fp8_kv:
            label += " + fp8 KV cache (`--kv-cache-dtype fp8`)"
        rows.append((label, result, seconds))
        print(f"{row}: perplexity {result['ppl']:.3f} ({100 * (result['ppl'] / base['ppl'] - 1):+.2f} %)", flush=True)

    print(f"\nheld-out tokens scored: {base['tokens']} (windows of {args.window}); greedy agreement: {args.prompts} "
          f"prompts of {args.prompt_len} tokens, {args.max_tokens} tokens each\n")  # fmt: skip
    n = len(base["choices"])
    print(f"multiple choice: bench/lm_eval_task's {n} questions, acc / acc_norm as lm-evaluation-harness scores them; "
          "same picks: questions where both picks equal the baseline's\n")  # fmt: skip
    print("| model | perplexity | vs baseline | greedy prefix agreement | identical continuations | MC acc / acc_norm "
          "| same picks as baseline | quantise s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label, result, seconds in rows:
        prefix, identical = agreement(base["outputs"], result["outputs"])
        change = "-" if result is base else f"{100 * (result['ppl'] / base['ppl'] - 1):+.2f} %"
        quant = "-" if seconds is None else f"{seconds:.0f}"
        acc = sum(a == p for a, p, _ in result["choices"]) / n
        acc_norm = sum(a == p for a, _, p in result["choices"]) / n
        same = sum(b[1:] == r[1:] for b, r in zip(base["choices"], result["choices"], strict=True))
        print(f"| {label} | {result['ppl']:.3f} | {change} | {100 * prefix:.1f} % | {100 * identical:.0f} % | "
              f"{acc:.2f} / {acc_norm:.2f} | {same} / {n} | {quant} |")  # fmt: skip


if __name__ == "__main__":
    main()
