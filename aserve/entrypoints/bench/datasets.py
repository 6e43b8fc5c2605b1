"""The requests of vLLM's synthetic benchmark datasets, made with loadgen's workloads: `random` (random token prompts,
lengths drawn around --random-input-len / --random-output-len by --random-range-ratio, after a shared random prefix of
--random-prefix-len tokens) and `prefix_repetition` (a few shared prefixes, each with a unique suffix). Prompts are
token ids drawn from a tokenizer's ordinary tokens, so every prompt has exactly the tokens asked for."""

from __future__ import annotations

import argparse
import math
import random

import numpy as np

from loadgen.workloads import LengthDist, PromptMaker, RequestSpec, Workload
from loadgen.workloads.synthetic import RandomWorkload, SharedPrefixWorkload


def add_synthetic_dataset_args(group: argparse._ArgumentGroup, prefix_flag: str) -> None:
    """The random and prefix_repetition datasets' flags, vLLM's names; `prefix_flag` is the random prefix's
    (--random-prefix-len in bench serve, --prefix-len in bench throughput)."""
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [L * (1 - r), L * (1 + r)], r in [0, 1)",
    )
    group.add_argument(prefix_flag, type=int, default=0, help="random: tokens of one prefix every prompt shares")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="prefix_repetition: prefix tokens")
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="prefix_repetition: suffix tokens")
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="prefix_repetition: prefixes")
    group.add_argument("--prefix-repetition-output-len", type=int, default=128, help="prefix_repetition: output tokens")


class TokenPoolPromptMaker(PromptMaker):
    """Token-id prompts drawn uniformly from `token_ids` (a tokenizer's tokens, special ones left out) rather than from
    [0, vocab_size): the ids every server and tokenizer accepts, however small its vocabulary."""

    def __init__(self, token_ids) -> None:
        self.token_ids = np.unique(np.asarray(list(token_ids), dtype=np.int64))
        if len(self.token_ids) == 0:
            raise ValueError("no token ids to draw random prompts from")
        super().__init__("ids", vocab_size=len(self.token_ids))

    def random(self, rng: np.random.Generator, num_tokens: int) -> list[int]:
        picks = rng.integers(0, len(self.token_ids), size=num_tokens)
        return [int(t) for t in self.token_ids[picks]]


def length_range(length: int, range_ratio: float, minimum: int = 0) -> LengthDist:
    """vLLM's --random-range-ratio: integers uniform in [floor(L * (1 - r)), ceil(L * (1 + r))], r in [0, 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), minimum)
    return LengthDist("fixed", low) if low == high else LengthDist("uniform", low, high)


def random_dataset(
    maker: PromptMaker, input_len: int, output_len: int, range_ratio: float = 0.0, prefix_len: int = 0
) -> Workload:
    """vLLM's random: `prefix_len` random tokens every prompt shares, then input and output lengths drawn around
    `input_len` and `output_len` (length_range)."""
    if input_len < 0 or output_len < 1 or prefix_len < 0:
        raise ValueError("random dataset lengths: the input must be >= 0 tokens, the output >= 1, the prefix >= 0")
    inputs = length_range(input_len, range_ratio)
    if prefix_len + inputs.a < 1:
        raise ValueError(
            f"an input length of {input_len} with --random-range-ratio {range_ratio} can draw an empty prompt: "
            "raise the input length or the prefix length, or lower the range ratio"
        )
    outputs = length_range(output_len, range_ratio, minimum=1)
    if prefix_len == 0:
        return RandomWorkload(maker, inputs, outputs)
    return SharedPrefixWorkload(maker, 1, prefix_len, inputs, outputs)


def prefix_repetition_dataset(
    maker: PromptMaker, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int
) -> Workload:
    """vLLM's prefix_repetition: `num_prefixes` prefixes of `prefix_len` tokens, each prompt one of them (drawn at
    random) followed by `suffix_len` random tokens."""
    if suffix_len < 1 or output_len < 1:
        raise ValueError("--prefix-repetition-suffix-len and --prefix-repetition-output-len must be >= 1")
    return SharedPrefixWorkload(
        maker, num_prefixes, prefix_len, LengthDist("fixed", suffix_len), LengthDist("fixed", output_len)
    )


def take(workload: Workload, num_requests: int, seed: int) -> list[RequestSpec]:
    """The workload's first `num_requests` requests for this seed."""
    stream = workload.sessions(np.random.default_rng(seed))
    return [next(stream).turns[0] for _ in range(num_requests)]


def oversample(specs: list[RequestSpec], num_requests: int, seed: int, allowed: bool = True) -> list[RequestSpec]:
    """vLLM's filling of a dataset with fewer usable entries than --num-prompts: random repeats of them (none with
    --no-oversample)."""
    if not specs:
        raise ValueError("the dataset has no usable entries")
    if len(specs) >= num_requests or not allowed:
        return specs[:num_requests]
    return specs + random.Random(seed).choices(specs, k=num_requests - len(specs))
