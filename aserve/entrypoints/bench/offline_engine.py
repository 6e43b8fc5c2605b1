"""What `aserve bench latency` and `aserve bench throughput` share: `aserve serve`'s engine flags and --profile, the
LLM they make, and vLLM's offline benchmark flags that would change what is measured (refused by name)."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from aserve.entrypoints.engine_cli_args import add_engine_args, engine_args_from
from aserve.sampling_params import SamplingParams

OFFLINE_REFUSED = {
    "--lora-path": "aserve serves no LoRA adapters",
    "--async-engine": "the offline benchmarks run LLM; `aserve bench serve` measures the async engine over HTTP",
    "--hf-max-batch-size": "it is for the hf backend, which aserve does not run",
}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--profile", action="store_true",
                        help="run the engine's profiler (--profiler-config, or $VLLM_TORCH_PROFILER_DIR) over the "
                             "measured run")  # fmt: skip


def make_llm(ns: argparse.Namespace):
    """LLM(...) from the engine flags, as `aserve serve` reads them."""
    from aserve.entrypoints.llm import LLM

    args = engine_args_from(ns)
    return LLM(**{field.name: getattr(args, field.name) for field in dataclasses.fields(args)})


def bench_sampling_params(n: int, max_tokens: int, disable_detokenize: bool) -> SamplingParams:
    """vLLM's offline benchmarks' sampling: temperature 1, top-p 1, exactly max_tokens tokens (EOS ignored)."""
    return SamplingParams(
        n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=max_tokens, detokenize=not disable_detokenize
    )


def ordinary_token_ids(llm) -> np.ndarray:
    """The ids random prompts draw from: the model's vocabulary less the tokenizer's special tokens."""
    vocab_size = min(len(llm.get_tokenizer()), llm.model_config.get_vocab_size())
    return np.setdiff1d(np.arange(vocab_size), np.asarray(llm.get_tokenizer().all_special_ids, dtype=np.int64))
