"""Speculative decoding on the GPU at the Llama-3-8B shape (random weights, bf16), every setting in one process:

    PYTHONPATH=. python bench/spec_gpu.py --out DIR [--sections worst,full] [--arch llama3-8b]

worst  acceptance ~ 0 (random weights: drafts are almost never right): offline 256 requests x 512 in / 256 out
       (output tok/s) and batch 1 (128 in / 256 out, ms per token), without speculation, with n-gram `auto` and
       with n-gram k = 4. Targets: auto >= 97 % of the throughput and >= 95 % at batch 1; k = 4 at batch 1 <= 1.15x
       the ms per token.
full   every draft right: the layers after the first 4 add nothing (their o_proj and down_proj zeroed after load),
       so `layer_skip` over 4 layers drafts what the whole model computes. Batch-1 ms per token with k = 4 (target
       <= 0.4x without speculation; ideal ~0.3) and the output throughput of 16 concurrent requests (target >= 1.5x),
       both against the same zeroed model without speculation; then the same with an int8 copy of the head for
       the drafts (`"draft_head": "int8"`).

Each engine's start-up seconds are reported too. Prints a table last; writes results.json under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402

NGRAM_AUTO = {"method": "ngram", "num_speculative_tokens": "auto"}
NGRAM_4 = {"method": "ngram", "num_speculative_tokens": 4}
SKIP_4 = {"method": "layer_skip", "num_layers": 4, "num_speculative_tokens": 4}
SKIP_4_INT8_HEAD = {**SKIP_4, "draft_head": "int8"}


def run_engine(model_dir: str, spec: dict | None, name: str, sections: set[str], zero_after: int | None = None):
    """Builds one engine (its start-up timed), measures `sections` on it, and frees it before returning."""
    from aserve import LLM

    t0 = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256,
              speculative_config=spec)  # fmt: skip
    gb.record(f"startup_{name}", round(time.perf_counter() - t0, 1), "s")
    try:
        if zero_after is not None:
            zero_layers_after(llm, zero_after)
        return measure(llm, name, sections)
    finally:
        del llm
        gc.collect()  # the runner and its CUDA graphs hold each other
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(100, 100000, (length,), generator=gen).tolist()} for _ in range(n)]


def out_tok_s(llm, prompts: list[dict], max_tokens: int) -> float:
    """Output tokens per second of one generate() over `prompts`, after a warm-up of the same batch (Triton
    specialisations) and with the prefix cache emptied in between."""
    from aserve import SamplingParams

    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - t0
    lengths = {len(o.outputs[0].token_ids) for o in outs}
    assert lengths == {max_tokens}, f"asked for {max_tokens} tokens per request, got {lengths}"
    return len(prompts) * max_tokens / seconds


def acceptance(llm) -> str:
    stats = llm.engine.stats
    drafted, accepted = stats.spec_draft_tokens_total, stats.spec_accepted_tokens_total
    return f"(drafted {drafted}, accepted {accepted}, {accepted / max(drafted, 1):.0%})"


def measure(llm, name: str, sections: set[str]) -> dict:
    got = {}
    if "b1" in sections:
        got["b1"] = ms = gb.batch1_decode_ms(llm)
        gb.record(f"b1_ms_{name}", round(ms, 3), "ms/token", acceptance(llm))
    if "b16" in sections:
        got["b16"] = tps = out_tok_s(llm, random_prompts(16, 128, 16), 256)
        gb.record(f"c16_tok_s_{name}", round(tps, 1), "out tok/s", acceptance(llm))
    if "b256" in sections:
        got["b256"] = tps = out_tok_s(llm, random_prompts(256, 512, 2), 256)
        gb.record(f"offline_tok_s_{name}", round(tps, 1), "out tok/s", acceptance(llm))
    return got


def zero_layers_after(llm, first: int) -> None:
    """Layers `first`.. add nothing to the residual stream: their attention and MLP output projections are zeroed
    in place (CUDA graphs read the same storage)."""
    for layer in llm.engine.core.runner.model.layers[first:]:
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            for p in module.parameters():
                p.data.zero_()


def worst(model_dir: str) -> None:
    got = {name: run_engine(model_dir, spec, name, {"b1", "b256"})
           for name, spec in (("none", None), ("ngram_auto", NGRAM_AUTO), ("ngram_k4", NGRAM_4))}  # fmt: skip
    base = got["none"]
    gb.record("worst_auto_throughput_ratio", round(got["ngram_auto"]["b256"] / base["b256"], 3), "x",
              "(target >= 0.97)")  # fmt: skip
    gb.record("worst_auto_b1_speed_ratio", round(base["b1"] / got["ngram_auto"]["b1"], 3), "x", "(target >= 0.95)")
    gb.record("worst_k4_b1_ms_ratio", round(got["ngram_k4"]["b1"] / base["b1"], 3), "x", "(target <= 1.15)")
    gb.record("worst_k4_throughput_ratio", round(got["ngram_k4"]["b256"] / base["b256"], 3), "x")


def full(model_dir: str) -> None:
    got = {name: run_engine(model_dir, spec, name, {"b1", "b16"}, zero_after=4)
           for name, spec in (("zeroed_none", None), ("zeroed_skip4_k4", SKIP_4),
                              ("zeroed_skip4_k4_int8_head", SKIP_4_INT8_HEAD))}  # fmt: skip
    base = got["zeroed_none"]
    for name, suffix in (("zeroed_skip4_k4", ""), ("zeroed_skip4_k4_int8_head", "_int8_head")):
        spec = got[name]
        gb.record(f"full_k4{suffix}_b1_ms_ratio", round(spec["b1"] / base["b1"], 3), "x", "(target <= 0.4; ideal ~0.3)")
        gb.record(f"full_k4{suffix}_c16_throughput_ratio", round(spec["b16"] / base["b16"], 3), "x", "(target >= 1.5)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--sections", default="worst,full")
    p.add_argument("--arch", default="llama3-8b", choices=list(gb.ARCHS))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model_dir = gb.dummy_model_dir(tempfile.mkdtemp(), args.arch)
    for section in args.sections.split(","):
        gb.run_section(section, lambda s=section: {"worst": worst, "full": full}[s](model_dir))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(gb.RESULTS, f, indent=1)
    print("\n| result | value | note |\n|---|---|---|")
    for key, r in gb.RESULTS.items():
        print(f"| {key} | {r['value']} {r['unit']} | {r['note']} |")


if __name__ == "__main__":
    main()
