"""Offline throughput and batch-1 latency: aserve vs transformers on the same random-token workload.

    python bench/offline_throughput.py --num-requests 64 --input-len 256 --output-len 128
    python bench/offline_throughput.py --backend transformers --hf-batch-size 64
    python bench/offline_throughput.py --latency --input-len 128 --output-len 256     # batch 1, ms/token
    python bench/offline_throughput.py --latency --quantization int8                  # int8 weights (at load)
    python bench/offline_throughput.py --latency --kv-cache-dtype fp8                 # FP8 KV cache
    python bench/offline_throughput.py --latency --quantization int8 --quantize-lm-head  # and an int8 lm_head
    python bench/offline_throughput.py --latency --quantization none,int8 --iters 9   # both, rounds alternating

Prompts are random token ids (seeded), EOS is ignored, so every request produces exactly --output-len tokens.
Model load and a small warm-up are excluded from the timings. Prints a table; --json appends a JSON line to a file.
With --latency, --quantization may name several methods (comma-separated, `none` for the unquantised model): one
engine each in the same process, measured in alternating rounds (a shared machine's drift then hits every method
alike), each method's medians reported with its speed-up over the first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

VOCAB_PROBE = 40000  # prompt ids are drawn below this (and the model's vocabulary)


def make_prompts(num: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 40000)
    return [[rng.randrange(100, hi) for _ in range(input_len)] for _ in range(num)]


def run_aserve(args):
    from aserve import LLM, SamplingParams

    kw = dict(dtype=args.dtype, seed=args.seed, load_format=args.load_format)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantize_lm_head:
        kw["quantize_lm_head"] = True
    llm = LLM(args.model, **kw)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = make_prompts(2, 16, llm.engine.config.vocab_size, args.seed + 1)
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=4, ignore_eos=True))
    llm.engine.reset_prefix_cache()

    def timed(batch):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        return elapsed

    def ttft(batch):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(max_tokens=1, ignore_eos=True))
        return time.perf_counter() - t0

    return timed, ttft


def run_transformers(args):
    import torch
    from transformers import AutoModelForCausalLM

    from aserve.config import _DTYPES
    from aserve.models.model_path import resolve_model

    model_dir, _ = resolve_model(args.model)
    dtype = _DTYPES.get(args.dtype, torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    @torch.inference_mode()
    def generate(batch, max_new):
        for i in range(0, len(batch), args.hf_batch_size):
            ids = torch.tensor(batch[i : i + args.hf_batch_size])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            assert out.shape[1] == ids.shape[1] + max_new

    generate(make_prompts(2, 16, model.config.vocab_size, args.seed + 1), 4)

    def timed(batch):
        t0 = time.perf_counter()
        generate(batch, args.output_len)
        return time.perf_counter() - t0

    def ttft(batch):
        t0 = time.perf_counter()
        generate(batch, 1)
        return time.perf_counter() - t0

    return timed, ttft


def latency(args, runner, result: dict) -> list[tuple]:
    """Batch 1: for each method of --quantization, the medians of --iters rounds (methods alternating within a round,
    fresh prompts every measurement so no prefix cache helps) -> the table's rows; `result` gets the first method's
    numbers (and, with several, each method's)."""
    import copy

    methods = (args.quantization or "none").split(",")
    engines = []
    for method in methods:
        margs = copy.copy(args)
        margs.quantization = None if method == "none" else method
        engines.append(runner(margs))
    e2e, first = [[] for _ in methods], [[] for _ in methods]
    for i in range(args.iters):
        for j, (timed, ttft) in enumerate(engines):
            seed = args.seed + 1000 * i + 10 * j
            e2e[j].append(timed(make_prompts(1, args.input_len, VOCAB_PROBE, seed)))
            first[j].append(ttft(make_prompts(1, args.input_len, VOCAB_PROBE, seed + 7)))
    per_method = []
    for j, method in enumerate(methods):
        e2e_s, ttft_s = statistics.median(e2e[j]), statistics.median(first[j])
        per_method.append(dict(
            quantization=method,
            e2e_s=round(e2e_s, 3),
            ttft_ms=round(ttft_s * 1e3, 1),
            ms_per_token=round(e2e_s * 1e3 / args.output_len, 2),
            decode_ms_per_token=round((e2e_s - ttft_s) * 1e3 / (args.output_len - 1), 2),
            decode_rounds_ms=[round((a - b) * 1e3 / (args.output_len - 1), 2) for a, b in zip(e2e[j], first[j])],
        ))  # fmt: skip
    result.update(mode="latency", **{k: v for k, v in per_method[0].items() if k != "quantization"})
    if len(methods) > 1:
        result["methods"] = per_method
    rows = [
        ("e2e (s)", *(m["e2e_s"] for m in per_method)),
        ("TTFT (ms)", *(m["ttft_ms"] for m in per_method)),
        ("ms / output token (e2e / n)", *(m["ms_per_token"] for m in per_method)),
        ("decode ms / token ((e2e - TTFT) / (n - 1))", *(m["decode_ms_per_token"] for m in per_method)),
    ]
    if len(methods) > 1:
        base = per_method[0]["decode_ms_per_token"]
        speedups = (f"{base / m['decode_ms_per_token']:.2f}x" for m in per_method)
        rows.append(("decode speed-up over the first", *speedups))
        rounds = (" / ".join(map(str, m["decode_rounds_ms"])) for m in per_method)
        rows.append(("decode ms / token, each round", *rounds))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", choices=["aserve", "transformers"], default="aserve")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--latency", action="store_true", help="batch 1: ms per output token (median of --iters)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--quantization", default=None, help="aserve: e.g. int8 or fp8 (quantised at load)")
    p.add_argument("--quantize-lm-head", action="store_true", help="aserve: the lm_head quantised too")
    p.add_argument("--kv-cache-dtype", default="auto", help="aserve: auto or fp8 (the KV cache's element type)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="transformers static batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="append the result as a JSON line to this file")
    args = p.parse_args()

    import torch

    runner = run_aserve if args.backend == "aserve" else run_transformers
    result = {
        "backend": args.backend,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    if args.latency:
        rows = latency(args, runner, result)
    else:
        prompts = make_prompts(args.num_requests, args.input_len, VOCAB_PROBE, args.seed)
        timed, _ = runner(args)
        elapsed = timed(prompts)
        n_out = args.num_requests * args.output_len
        n_in = args.num_requests * args.input_len
        result.update(
            mode="throughput",
            num_requests=args.num_requests,
            elapsed_s=round(elapsed, 2),
            output_tok_s=round(n_out / elapsed, 1),
            total_tok_s=round((n_out + n_in) / elapsed, 1),
        )
        rows = [
            ("elapsed (s)", result["elapsed_s"]),
            ("output tok/s", result["output_tok_s"]),
            ("total tok/s (prompt + output)", result["total_tok_s"]),
        ]
    title = f"{args.backend} {result['mode']}: " + (
        f"batch 1, {args.input_len} in / {args.output_len} out"
        if args.latency
        else f"{args.num_requests} req x {args.input_len} in / {args.output_len} out"
    )
    print(f"\n{title} ({args.dtype}, {result['threads']} threads)")
    methods = [m["quantization"] for m in result.get("methods", [])]
    print("| metric | " + (" | ".join(methods) if methods else "value") + " |\n|---|" + "---|" * max(1, len(methods)))
    for name, *values in rows:
        print(f"| {name} | " + " | ".join(map(str, values)) + " |")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
