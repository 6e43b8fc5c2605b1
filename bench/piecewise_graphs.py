"""Piecewise CUDA graphs of steps with prompts (aserve/worker/piecewise_graphs.py) on a GPU, in one command:

    python bench/piecewise_graphs.py [--sections parity,host] [--variants gqa,qwen3,gemma3,qwen3_moe,phi3]
                                     [--arch llama3-8b] [--budget 128]

parity  each tiny random family of tests/tiny_models.py in float32: 12 prompts of 3-200 tokens, a 96-token step
        budget and 4 sequences (steps that mix prompt chunks with decodes), 24 greedy tokens with logprobs, eager
        (--enforce-eager) against graphs: identical outputs, the largest logprob difference up to the first
        divergence, and how many steps replayed pieces.
host    the --arch shape with random weights (bf16), 64 sequences, a --budget-token step budget: 128 prompts of 512
        tokens, 128 generated each; the host time of each step's launch (ModelRunner.launch: inputs, the forward's
        launches, sampling), decode-only steps and steps with prompt tokens beside 8 or more decodes, with the pieces
        and without them (ASERVE_PIECEWISE_GRAPHS=0).
Each measurement runs in a process of its own. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]
MARK = "PIECEWISE_RESULT "
PROMPT_LENGTHS = (3, 17, 40, 64, 90, 130, 5, 200, 33, 77, 150, 9)


def parity_child(variant: str, root: str) -> dict:
    import torch
    from tiny_models import make_tiny_model

    from aserve import LLM, SamplingParams

    path = make_tiny_model(os.path.join(root, variant), variant)
    ids = [[(7 * i + 3 * j) % 380 + 2 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
    prompts = [{"prompt_token_ids": p} for p in ids]
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=1)
    runs, replays = {}, 0
    for eager in (True, False):
        llm = LLM(path, dtype="float32", max_model_len=256, gpu_memory_utilization=0.2, max_num_batched_tokens=96,
                  max_num_seqs=4, enforce_eager=eager)  # fmt: skip
        pieces = llm.engine.core.runner.piecewise
        if pieces is not None:
            run, counted = pieces.run, []
            pieces.run = lambda *a: counted.append(1) or run(*a)  # noqa: E731
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        runs[eager] = [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]
        replays = len(counted) if pieces is not None else replays
        del llm
        torch.cuda.empty_cache()
    diffs = []
    for (ta, la), (tb, lb) in zip(runs[True], runs[False]):
        k = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
        diffs += [abs(a - b) for a, b in zip(la[: k + 1], lb[: k + 1])]
    same = sum(a[0] == b[0] for a, b in zip(runs[True], runs[False]))
    return {"identical": f"{same}/{len(prompts)}", "max_logprob_diff": max(diffs), "piece_replays": replays}


def host_child(arch: str, budget: int, root: str) -> dict:
    import random

    import gpu_bench

    from aserve import LLM, SamplingParams

    llm = LLM(gpu_bench.dummy_model_dir(root, arch), dtype="bfloat16", load_format="dummy", max_model_len=2048,
              max_num_seqs=64, max_num_batched_tokens=budget)  # fmt: skip
    runner = llm.engine.core.runner
    prompts = lambda n, seed: [  # noqa: E731
        {"prompt_token_ids": [random.Random(seed * 1000 + i).randrange(100, 30000) for _ in range(512)]}
        for i in range(n)
    ]
    llm.generate(prompts(64, 1), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    launch, rows = runner.launch, []

    def timed(sched, prev=None, overlap=False):
        t0 = time.perf_counter()
        out = launch(sched, prev, overlap)
        prompt = sum(s.num_new_tokens for s in sched.scheduled if s.num_new_tokens > 1)
        decodes = sum(1 for s in sched.scheduled if s.num_new_tokens == 1)
        rows.append((prompt, decodes, time.perf_counter() - t0))
        return out

    runner.launch = timed
    llm.generate(prompts(128, 0), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))

    def p50(values: list[float]) -> float | None:
        return round(sorted(values)[len(values) // 2] * 1e3, 2) if values else None

    return {"decode_only_ms": p50([t for p, d, t in rows if p == 0]),
            "mixed_ms": p50([t for p, d, t in rows if p and d >= 8]),
            "mixed_steps": sum(1 for p, d, _ in rows if p and d >= 8),
            "pieces": runner.piecewise is not None and bool(runner.piecewise.pieces)}  # fmt: skip


def run_child(args: list[str], env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    return {"error": (proc.stderr or proc.stdout)[-600:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="parity,host")
    p.add_argument("--variants", default="gqa,qwen3,gemma3,qwen3_moe,phi3")
    p.add_argument("--arch", default="llama3-8b")
    p.add_argument("--budget", type=int, default=128, help="the host section's step budget (max_num_batched_tokens)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child:
        root = tempfile.mkdtemp()
        kind, arg = ns.child
        result = parity_child(arg, root) if kind == "parity" else host_child(ns.arch, ns.budget, root)
        print(MARK + json.dumps(result), flush=True)
        return
    rows, sections = [], ns.sections.split(",")
    for variant in ns.variants.split(",") if "parity" in sections else ():
        rows.append((f"parity {variant}", run_child(["--child", "parity", variant])))
        print(rows[-1], flush=True)
    for mode, env in (("pieces", {}), ("eager", {"ASERVE_PIECEWISE_GRAPHS": "0"})) if "host" in sections else ():
        rows.append((f"host {mode}", run_child(["--arch", ns.arch, "--budget", str(ns.budget), "--child", "host", mode],
                                              env)))  # fmt: skip
        print(rows[-1], flush=True)
    print("| run | result |\n|---|---|")
    for name, result in rows:
        print(f"| {name} | {', '.join(f'{k} {v}' for k, v in result.items())} |")


if __name__ == "__main__":
    main()
