"""Async scheduling A/B on the GPU (Llama-3-8B shape, random weights, bf16), in one command:

    PYTHONPATH=. python bench/gpu_async_bench.py --out DIR [--repeats 3] [--hf]

Two engines live side by side (30 GiB of KV each), identical except `async_scheduling`; each measurement alternates
between them so that host jitter hits both alike:
- batch-1 decode, 128 prompt + 256 generated tokens: ms/token (gpu_bench.batch1_decode_ms);
- offline throughput, 256 requests x 512 prompt / 256 output tokens, EOS ignored: output tok/s;
- greedy agreement: how many of the 256 greedy outputs are identical between the two engines;
- with --hf: transformers `generate` with static batches of 64 on the same workload (the issue's baseline).
Prints a table last; writes results.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402

from aserve import LLM, SamplingParams  # noqa: E402


def workload():
    gen = torch.Generator().manual_seed(2)
    return [{"prompt_token_ids": torch.randint(100, 100000, (512,), generator=gen).tolist()} for _ in range(256)]


def throughput(llm, prompts) -> tuple[float, float, list[list[int]]]:
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return n_out / elapsed, elapsed, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model_dir = gb.dummy_model_dir(tempfile.mkdtemp())
    engines = {}
    for name, flag in (("async", True), ("sync", False)):
        t0 = time.perf_counter()
        engines[name] = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
                            kv_cache_memory_gb=30, async_scheduling=flag)  # fmt: skip
        print(f"{name}: engine up in {time.perf_counter() - t0:.1f} s", flush=True)
    results: dict[str, list] = {f"{k}_{m}": [] for k in engines for m in ("b1_ms", "tok_s", "seconds")}
    prompts = workload()
    for llm in engines.values():  # warm-up: kernel compilation, allocator
        llm.generate(prompts[:16], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    outputs = {}
    for r in range(args.repeats):
        for name, llm in engines.items():
            ms = gb.batch1_decode_ms(llm)
            results[f"{name}_b1_ms"].append(ms)
            print(f"repeat {r} {name}: batch-1 decode {ms:.3f} ms/token", flush=True)
        for name, llm in engines.items():
            tok_s, seconds, outs = throughput(llm, prompts)
            results[f"{name}_tok_s"].append(tok_s)
            results[f"{name}_seconds"].append(seconds)
            outputs[name] = outs
            print(f"repeat {r} {name}: throughput {tok_s:.0f} out tok/s ({seconds:.2f} s)", flush=True)
    same = sum(a == b for a, b in zip(outputs["async"], outputs["sync"]))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(outputs["async"], outputs["sync"])]  # fmt: skip
    diffs = [d for d in first_diff if d is not None]
    results["greedy_identical"] = same
    results["first_divergence_median"] = statistics.median(diffs) if diffs else None
    if args.hf:
        engines.clear()  # both engines' GPU memory goes back before transformers loads the model
        del llm  # the loops' variable still holds the last engine
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        gb.RESULTS.clear()
        gb.RESULTS["throughput_aserve"] = {"value": statistics.median(results["async_tok_s"])}
        gb.hf(model_dir, generate_batch=False)
        results["hf"] = {k: v for k, v in gb.RESULTS.items()}
    with open(os.path.join(args.out, "async_results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)

    med = lambda k: statistics.median(results[k])  # noqa: E731
    print("\n| measure | async scheduling | sync | async / sync |")
    print("|---|---|---|---|")
    a, s = med("async_b1_ms"), med("sync_b1_ms")
    print(f"| batch-1 decode ms/token (median of {args.repeats}) | {a:.3f} | {s:.3f} | {s / a:.2f}x faster |")
    a, s = med("async_tok_s"), med("sync_tok_s")
    print(f"| throughput out tok/s (median of {args.repeats}) | {a:,.0f} | {s:,.0f} | {a / s:.2f}x |")
    print(
        f"| all runs tok/s | {', '.join(f'{x:,.0f}' for x in results['async_tok_s'])} | "
        f"{', '.join(f'{x:,.0f}' for x in results['sync_tok_s'])} | |"
    )
    print(
        f"| greedy outputs identical (of 256) | {same} | | first divergence median token "
        f"{results['first_divergence_median']} |"
    )
    if args.hf:
        print(json.dumps(results["hf"], indent=1, default=str))


if __name__ == "__main__":
    main()
