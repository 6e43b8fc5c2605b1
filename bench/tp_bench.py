"""Tensor parallelism: one model with random weights (load_format dummy) at several tensor-parallel sizes, batch-1
decode and offline throughput, on the 2-GPU machine (NCCL):

    python bench/tp_bench.py --out DIR [--arch llama3-8b,llama3-70b] [--tp 1,2] [--sections decode,throughput]
        [--quantization fp8]
    python bench/tp_bench.py --tiny [--tp 1,2]       # CPU, a tiny Llama shape, gloo between processes: a smoke run

--arch also takes bench/gpu_bench.py's shapes (qwen3-30b-a3b and mixtral-8x7b: mixture-of-experts models, their
experts split across the ranks; --quantization fp8 rounds every linear and expert to e4m3 at load).

decode      batch 1: 128 random prompt tokens, 256 generated, minus the time to the first token; ms/token against the
            per-GPU floor (the weights one rank reads per token / the measured copy bandwidth)
throughput  256 requests x 512 prompt / 256 output tokens (EOS ignored): output tok/s

Llama-3-70B's bf16 weights (141 GB) do not fit one H200: its TP=1 run is skipped. Prints a table last (with the
TP=N / TP=1 ratios where both ran); writes results.json under --out.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402

LLAMA3_70B = dict(gb.LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64)  # fmt: skip
TINY = dict(gb.LLAMA3_8B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, bos_token_id=0, eos_token_id=1)  # fmt: skip
SHAPES = {"llama3-8b": gb.LLAMA3_8B, "llama3-70b": LLAMA3_70B, "tiny": TINY}
TOO_BIG_FOR_ONE_GPU = {"llama3-70b"}

# (prompt tokens, generated tokens) of the decode run; (requests, prompt, output tokens) of the throughput run
GPU_WORKLOAD = {"decode": (128, 256), "throughput": (256, 512, 256)}
CPU_WORKLOAD = {"decode": (16, 32), "throughput": (8, 32, 16)}


def model_dir(root: str, arch: str) -> str:
    """config.json of the shape plus a small real tokenizer: enough for load_format=dummy."""
    from tiny_models import build_tokenizer
    from transformers import LlamaConfig

    if arch not in SHAPES:
        return gb.dummy_model_dir(root, arch)
    path = os.path.join(root, f"{arch}-shape")
    LlamaConfig(**SHAPES[arch]).save_pretrained(path)
    build_tokenizer(path)
    return path


def decode_ms(llm, prompt_len: int, gen: int) -> float:
    """ms per generated token at batch 1 (the median of 3, after a warm-up), the first token's time taken out."""
    from aserve import SamplingParams

    rng = torch.Generator().manual_seed(1)
    vocab = llm.engine.config.vocab_size
    prompt = lambda: {"prompt_token_ids": torch.randint(2, vocab, (prompt_len,), generator=rng).tolist()}  # noqa: E731
    llm.generate(prompt(), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompt(), SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True), use_tqdm=False)
        e2e = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(prompt(), SamplingParams(max_tokens=1), use_tqdm=False)
        times.append((e2e - (time.perf_counter() - t0)) / (gen - 1) * 1e3)
    return sorted(times)[1]


def throughput_tok_s(llm, requests: int, prompt_len: int, gen: int) -> float:
    from aserve import SamplingParams

    rng = torch.Generator().manual_seed(2)
    vocab = llm.engine.config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (prompt_len,), generator=rng).tolist()}
               for _ in range(requests)]  # fmt: skip
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # compile, warm up
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def run(arch: str, path: str, tp: int, sections: list[str], cpu: bool, quantization: str | None = None) -> None:
    from aserve import LLM

    workload = CPU_WORKLOAD if cpu else GPU_WORKLOAD
    kwargs = dict(device="cpu", dtype="float32", enforce_eager=True, kv_cache_memory_gb=0.25) if cpu else {}
    kwargs["quantization"] = quantization
    kwargs.setdefault("dtype", "bfloat16")
    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", tensor_parallel_size=tp, max_model_len=4096, max_num_seqs=256, **kwargs)
    key = f"{arch}_tp{tp}"
    gb.record(f"{key}_startup", round(time.perf_counter() - t0, 1), "s")
    try:
        if "decode" in sections:
            ms = decode_ms(llm, *workload["decode"])
            weights = sum(p.numel() * p.element_size() for p in llm.engine.core.runner.model.parameters())
            note = f"(rank 0 holds {weights / 1e9:.2f} GB of weights)"
            bw = gb.RESULTS.get("copy_bandwidth", {}).get("value")
            if bw:
                floor = weights / (bw * 1e12) * 1e3
                note = f"(per-GPU floor {floor:.2f} ms = {weights / 1e9:.2f} GB / {bw} TB/s: {ms / floor:.2f}x)"
            gb.record(f"{key}_decode_b1_ms_per_token", round(ms, 3), "ms", note)
        if "throughput" in sections:
            n, p, g = workload["throughput"]
            gb.record(f"{key}_throughput", round(throughput_tok_s(llm, n, p, g), 1), "out tok/s",
                      f"({n} x {p} prompt / {g} output tokens)")  # fmt: skip
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()


def ratios(archs: list[str], sizes: list[int]) -> None:
    """TP=N against TP=1 where both ran: decode speed-up (ms at TP=1 / ms at TP=N) and throughput ratio."""
    r = gb.RESULTS
    for arch in archs:
        for tp in sizes:
            base, this = f"{arch}_tp1", f"{arch}_tp{tp}"
            if tp == 1:
                continue
            dec = (r.get(f"{base}_decode_b1_ms_per_token"), r.get(f"{this}_decode_b1_ms_per_token"))
            if all(dec):
                gb.record(f"{this}_decode_speedup", round(dec[0]["value"] / dec[1]["value"], 2), "x",
                          "(target >= 1.6 at TP=2 on 2 H200s)" if arch == "llama3-8b" else "")  # fmt: skip
            thr = (r.get(f"{base}_throughput"), r.get(f"{this}_throughput"))
            if all(thr):
                gb.record(f"{this}_throughput_ratio", round(thr[1]["value"] / thr[0]["value"], 2), "x",
                          "(target >= 1.7 at TP=2 on 2 H200s)" if arch == "llama3-8b" else "")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="llama3-8b,llama3-70b")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated")
    p.add_argument("--sections", default="decode,throughput")
    p.add_argument("--tiny", action="store_true", help="CPU, a tiny Llama shape, gloo (a smoke run of this script)")
    p.add_argument("--quantization", default=None, help="e.g. fp8: every linear and expert rounded at load")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    archs = ["tiny"] if args.tiny else args.arch.split(",")
    sizes = [int(n) for n in args.tp.split(",")]
    sections = args.sections.split(",")
    if not args.tiny:
        print(f"torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name()}", flush=True)
        gb.run_section("ceilings", gb.ceilings)  # copy bandwidth: the decode floor's denominator
    root = tempfile.mkdtemp()
    for arch in archs:
        path = model_dir(root, arch)
        for tp in sizes:
            if tp == 1 and arch in TOO_BIG_FOR_ONE_GPU:
                gb.record(f"{arch}_tp1", "skipped", "", "(its weights do not fit one GPU)")
                continue
            print(f"== {arch} tensor_parallel_size {tp}", flush=True)
            try:
                run(arch, path, tp, sections, args.tiny, args.quantization)
            except Exception as e:  # recorded; the next configuration still runs
                gb.record(f"{arch}_tp{tp}_error", f"{type(e).__name__}: {str(e)[:300]}")
    ratios(archs, sizes)
    gb.write_results(args.out)


if __name__ == "__main__":
    main()
