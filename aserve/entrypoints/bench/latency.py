"""`aserve bench latency`: vLLM's `vllm bench latency`. One batch of --batch-size random token prompts of --input-len
tokens, each generating exactly --output-len tokens (temperature 1, top-p 1, EOS ignored; --n sequences each, or beam
search of width --n), is run --num-iters-warmup times unmeasured and --num-iters times measured, end to end through
LLM.generate; the latencies' mean, standard deviation and percentiles are printed as vLLM prints them. Prefix caching
is off unless asked for, as in vLLM (the same prompts every iteration would otherwise be cache hits)."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from tqdm import tqdm

from aserve.entrypoints.bench.datasets import TokenPoolPromptMaker
from aserve.entrypoints.bench.offline_engine import (
    OFFLINE_REFUSED,
    add_engine_flags,
    bench_sampling_params,
    make_llm,
    ordinary_token_ids,
)
from aserve.entrypoints.bench.refused import add_refused_args
from aserve.sampling_params import BeamSearchParams

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_latency_args(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("benchmark")
    b.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    b.add_argument("--output-len", type=int, default=128, help="tokens generated per sequence")
    b.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    b.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    b.add_argument("--use-beam-search", action="store_true", help="beam search of width --n instead of sampling")
    b.add_argument("--num-iters-warmup", type=int, default=10, help="iterations run first, not measured")
    b.add_argument("--num-iters", type=int, default=30, help="iterations measured")
    b.add_argument("--output-json", default=None, help="write the latencies to this JSON file")
    b.add_argument("--disable-detokenize", action="store_true", help="generate token ids only (no text)")
    add_engine_flags(p)
    p.set_defaults(enable_prefix_caching=False)
    add_refused_args(p, OFFLINE_REFUSED)


def run_latency(ns: argparse.Namespace) -> dict:
    for flag, value in (
        ("--input-len", ns.input_len),
        ("--output-len", ns.output_len),
        ("--batch-size", ns.batch_size),
        ("--n", ns.n),
        ("--num-iters", ns.num_iters),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1")
    if ns.num_iters_warmup < 0:
        raise ValueError("--num-iters-warmup must be >= 0")
    llm = make_llm(ns)
    max_model_len = llm.model_config.max_model_len
    if max_model_len < ns.input_len + ns.output_len:
        raise ValueError(
            f"--input-len + --output-len ({ns.input_len + ns.output_len}) exceed the model's "
            f"max_model_len {max_model_len}: lower them, or raise --max-model-len"
        )
    maker = TokenPoolPromptMaker(ordinary_token_ids(llm))
    rng = np.random.default_rng(ns.seed or 0)
    prompts = [{"prompt_token_ids": maker.random(rng, ns.input_len)} for _ in range(ns.batch_size)]
    params = bench_sampling_params(ns.n, ns.output_len, ns.disable_detokenize)
    beam = BeamSearchParams(beam_width=ns.n, max_tokens=ns.output_len, ignore_eos=True)

    def latency() -> float:
        start = time.perf_counter()
        if ns.use_beam_search:
            llm.beam_search(prompts, beam)
        else:
            llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    print("Warming up...")
    for _ in tqdm(range(ns.num_iters_warmup), desc="Warmup iterations"):
        latency()
    if ns.profile:  # vLLM's: one profiled iteration instead of the measured ones
        print("Profiling one iteration...")
        llm.start_profile()
        latency()
        llm.stop_profile()
        return {}
    latencies = np.array([latency() for _ in tqdm(range(ns.num_iters), desc="Bench iterations")])
    percentiles = np.percentile(latencies, PERCENTAGES)
    print(f"Avg latency: {np.mean(latencies).item()} seconds")
    print(f"Std latency: {np.std(latencies).item()} seconds")
    for percentage, value in zip(PERCENTAGES, percentiles):
        print(f"{percentage}% percentile latency: {value} seconds")
    results = {
        "avg_latency": np.mean(latencies).item(),
        "std_latency": np.std(latencies).item(),
        "latencies": latencies.tolist(),
        "percentiles": dict(zip(PERCENTAGES, percentiles.tolist())),
    }
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=4)
    return results
