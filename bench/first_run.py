"""The first traffic of a fresh engine against its steady state, on a GPU, a Llama-3-8B-shaped model with random
weights: how much of the first run's cost is Triton compiling (an empty cache) and how much is not (the cache that
run filled, reused by a new process).

    python bench/first_run.py [--arch llama3-8b] [--num-requests 64] [--input-len 512] [--output-len 64]

Each setting in its own process: "fresh" with an empty TRITON_CACHE_DIR, then "cached" with the directory the fresh
process filled. Per setting: seconds to build the engine (LLM(...) returning), then the offline workload (random
token prompts, greedy, EOS ignored) twice: output tok/s of the first run and of the second (the steady state).
Prints a table, then the Triton kernel variants compiled in each phase of the fresh process (what a start-up
warm-up would have to cover).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def one_setting(args) -> dict:
    import torch

    sys.path.insert(0, HERE)
    from gpu_bench import dummy_model_dir

    from aserve import LLM, SamplingParams

    model_dir = dummy_model_dir(tempfile.mkdtemp(), args.arch)
    seen = compiled_kernels()
    t0 = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256)
    out = {"start_s": round(time.perf_counter() - t0, 1)}
    seen = note_compiled(out, "start", seen)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for run in ("first", "second"):
        prompts = [{"prompt_token_ids": torch.randint(100, 100000, (args.input_len,), generator=gen).tolist()}
                   for _ in range(args.num_requests)]  # fmt: skip
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        out[f"{run}_tok_s"] = round(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, 1)
        seen = note_compiled(out, run, seen)
    return out


def compiled_kernels() -> collections.Counter:
    """Kernel name -> compiled variants in the Triton cache (each variant's metadata is <name>.json in its own
    directory)."""
    root = os.environ.get("TRITON_CACHE_DIR", "")
    names = collections.Counter()
    for path in glob.glob(os.path.join(root, "*", "*.json")) if root else ():
        name = os.path.basename(path)[: -len(".json")]
        if not name.startswith("__grp__"):
            names[name] += 1
    return names


def note_compiled(out: dict, phase: str, before: collections.Counter) -> collections.Counter:
    """Records the kernel variants `phase` added to the Triton cache -> the cache's contents now."""
    now = compiled_kernels()
    out[f"compiled_{phase}"] = dict(now - before)
    return now


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama3-8b")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one setting
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_setting(args)))
        return
    cache = tempfile.mkdtemp(prefix="triton-")
    rows = {}
    for setting in ("fresh Triton cache", "cached (the same directory, a new process)"):
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        cmd = [sys.executable, __file__, "--one", "--arch", args.arch, "--num-requests", str(args.num_requests),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{setting}: the child process failed ({proc.returncode})")
        rows[setting] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(setting, rows[setting], flush=True)
    print("\n| setting | engine start s | first run out tok/s | second run out tok/s | first / second |")
    print("|---|---|---|---|---|")
    for setting, r in rows.items():
        print(f"| {setting} | {r['start_s']} | {r['first_tok_s']} | {r['second_tok_s']} | "
              f"{r['first_tok_s'] / r['second_tok_s']:.3f} |")  # fmt: skip
    print("\nTriton kernel variants compiled (fresh cache): during start-up / the first run / the second run")
    fresh = rows["fresh Triton cache"]
    for phase in ("start", "first", "second"):
        print(f"  {phase}: {fresh[f'compiled_{phase}']}")


if __name__ == "__main__":
    main()
