"""`aserve bench throughput`: vLLM's `vllm bench throughput`. --num-prompts requests go to LLM.generate at once, each
generating exactly its output length (temperature 1, top-p 1, EOS ignored, --n sequences); the wall time gives
requests, total tokens and output tokens per second, printed as vLLM prints them. Datasets: random (token-id prompts
of --input-len tokens, drawn from the vocabulary's ordinary tokens; --random-range-ratio, --prefix-len),
prefix_repetition, and sharegpt from a local --dataset-path (the default when one is given, as in vLLM)."""

from __future__ import annotations

import argparse
import json
import time

from aserve.entrypoints.bench.datasets import (
    TokenPoolPromptMaker,
    add_synthetic_dataset_args,
    oversample,
    prefix_repetition_dataset,
    random_dataset,
    take,
)
from aserve.entrypoints.bench.offline_engine import (
    OFFLINE_REFUSED,
    add_engine_flags,
    bench_sampling_params,
    make_llm,
    ordinary_token_ids,
)
from aserve.entrypoints.bench.refused import add_refused_args
from aserve.entrypoints.bench.serve_args import DATASET_NAMES
from aserve.entrypoints.bench.sharegpt import ShareGPTSampler, read_sharegpt
from loadgen.workloads import RequestSpec

THROUGHPUT_DATASETS = ("random", "sharegpt", "prefix_repetition")
_REFUSED = {
    **OFFLINE_REFUSED,
    "--hf-subset": "aserve reads no Hugging Face datasets",
    "--hf-split": "aserve reads no Hugging Face datasets",
}


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("benchmark")
    b.add_argument(
        "--backend",
        choices=("vllm", "vllm-chat", "hf", "mii"),
        default="vllm",
        help="vllm: LLM.generate (the others are refused)",
    )
    b.add_argument(
        "--dataset-name",
        choices=DATASET_NAMES,
        default=None,
        help=f"{', '.join(THROUGHPUT_DATASETS)} (default: sharegpt with --dataset-path, else random)",
    )
    b.add_argument("--dataset-path", default=None, help="sharegpt: the ShareGPT JSON file")
    b.add_argument("--dataset", default=None, help="the older name of --dataset-path")
    b.add_argument("--input-len", type=int, default=None, help="random: prompt tokens (needed for random)")
    b.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens per request (default: random 128, sharegpt the reply's length)",
    )
    b.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    b.add_argument("--num-prompts", type=int, default=1000, help="requests")
    b.add_argument("--output-json", default=None, help="write the throughput to this JSON file")
    b.add_argument("--disable-detokenize", action="store_true", help="generate token ids only (no text)")
    add_synthetic_dataset_args(b, "--prefix-len")
    b.add_argument(
        "--disable-frontend-multiprocessing",
        action="store_true",
        help="accepted for vLLM's command lines (LLM runs in this process)",
    )
    add_engine_flags(p)
    add_refused_args(p, _REFUSED)


def run_throughput(ns: argparse.Namespace) -> dict:
    if ns.backend != "vllm":
        raise ValueError(
            f"--backend {ns.backend} is not supported by `aserve bench throughput`: it runs aserve's "
            "LLM.generate (--backend vllm)"
        )
    if ns.num_prompts < 1 or ns.n < 1:
        raise ValueError("--num-prompts and --n must be >= 1")
    path = ns.dataset_path or ns.dataset
    name = ns.dataset_name or ("sharegpt" if path else "random")
    if name not in THROUGHPUT_DATASETS:
        raise ValueError(
            f"`aserve bench throughput` does not read the {name} dataset (it needs a download, a Hugging "
            f"Face dataset or images); --dataset-name takes {', '.join(THROUGHPUT_DATASETS)}"
        )
    if name == "random" and ns.input_len is None:
        raise ValueError("the random dataset needs --input-len")
    if name == "sharegpt" and path is None:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json (aserve downloads nothing)")
    llm = make_llm(ns)
    specs = _requests(ns, name, path, llm)
    longest = max(spec.prompt_tokens + spec.max_tokens for spec in specs)
    if longest > llm.model_config.max_model_len:
        raise ValueError(
            f"a request needs {longest} tokens, over the model's max_model_len "
            f"{llm.model_config.max_model_len}: shorten the requests, or raise --max-model-len"
        )
    prompts = [spec.prompt if isinstance(spec.prompt, str) else {"prompt_token_ids": spec.prompt} for spec in specs]
    params = [bench_sampling_params(ns.n, spec.max_tokens, ns.disable_detokenize) for spec in specs]
    if ns.profile:
        print("Profiling the run (the profiler's overhead is in the figures below)...")
        llm.start_profile()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    if ns.profile:
        llm.stop_profile()
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    output_tokens = sum(len(seq.token_ids) for out in outputs for seq in out.outputs)
    total_tokens = prompt_tokens + output_tokens
    print(
        f"Throughput: {len(specs) / elapsed:.2f} requests/s, {total_tokens / elapsed:.2f} total tokens/s, "
        f"{output_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    results = {
        "elapsed_time": elapsed,
        "num_requests": len(specs),
        "total_num_tokens": total_tokens,
        "requests_per_second": len(specs) / elapsed,
        "tokens_per_second": total_tokens / elapsed,
    }
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=4)
    return results


def _requests(ns: argparse.Namespace, name: str, path: str | None, llm) -> list[RequestSpec]:
    seed = ns.seed or 0
    if name == "sharegpt":
        tokenizer = llm.get_tokenizer()
        sampler = ShareGPTSampler(ns.num_prompts, ns.output_len)
        for prompt, completion in read_sharegpt(path, seed):
            sampler.offer(prompt, len(tokenizer.encode(prompt)), len(tokenizer.encode(completion)))
            if sampler.done:
                break
        return oversample(sampler.specs, ns.num_prompts, seed)
    maker = TokenPoolPromptMaker(ordinary_token_ids(llm))
    if name == "random":
        output_len = 128 if ns.output_len is None else ns.output_len
        workload = random_dataset(maker, ns.input_len, output_len, ns.random_range_ratio, ns.prefix_len)
    else:
        output_len = ns.prefix_repetition_output_len if ns.output_len is None else ns.output_len
        workload = prefix_repetition_dataset(
            maker,
            ns.prefix_repetition_prefix_len,
            ns.prefix_repetition_suffix_len,
            ns.prefix_repetition_num_prefixes,
            output_len,
        )
    return take(workload, ns.num_prompts, seed)
