"""`aserve bench serve`'s requests, made before the run with the server's tokenizer: what --dataset-name names, as
the endpoint takes it (token ids for /v1/completions where the dataset is tokens, text for /v1/chat/completions).

  random, prefix_repetition  token ids drawn from the tokens of loadgen's word list as the server tokenises it
                             (ordinary tokens of any vocabulary); on the chat endpoint, their text (/detokenize)
  custom                     a JSONL file of {"prompt": ...} lines (loadgen's file format; a line's max_tokens wins
                             over --custom-output-len), shuffled by --seed; on /v1/completions rendered by the chat
                             template (/tokenize with messages) unless --skip-chat-template, as vLLM renders them
  sharegpt                   a local ShareGPT JSON file (aserve/entrypoints/bench/sharegpt.py)"""

from __future__ import annotations

import argparse
import asyncio
import random

import msgspec

from aserve.entrypoints.bench.datasets import (
    TokenPoolPromptMaker,
    oversample,
    prefix_repetition_dataset,
    random_dataset,
    take,
)
from aserve.entrypoints.bench.serve_args import SERVE_DATASETS
from aserve.entrypoints.bench.server_tokenizer import ServerTokenizer
from aserve.entrypoints.bench.sharegpt import ShareGPTSampler, read_sharegpt
from loadgen.workloads import RequestSpec
from loadgen.workloads.corpus import VOCABULARY
from loadgen.workloads.dataset import read_jsonl

_SHAREGPT_BATCH = 64  # conversations tokenised at once while sampling


def check_serve_dataset(ns: argparse.Namespace) -> None:
    """--dataset-name and --dataset-path as the dataset needs them, checked before the server is asked anything."""
    name = ns.dataset_name
    if name not in SERVE_DATASETS:
        raise ValueError(
            f"`aserve bench serve` does not read the {name} dataset (it needs a download, a Hugging Face "
            f"dataset or images); --dataset-name takes {', '.join(SERVE_DATASETS)}"
        )
    if name in ("random", "prefix_repetition") and ns.dataset_path is not None:
        raise ValueError(
            f"--dataset-name {name} makes its prompts: drop --dataset-path, or name its dataset (custom, sharegpt)"
        )
    if name in ("custom", "sharegpt") and ns.dataset_path is None:
        raise ValueError(f"--dataset-name {name} needs --dataset-path FILE (aserve downloads nothing)")


async def serve_requests(ns: argparse.Namespace, tokenizer: ServerTokenizer, chat: bool) -> list[RequestSpec]:
    """The requests of the dataset check_serve_dataset passed."""
    if ns.dataset_name == "custom":
        return await _custom(ns, tokenizer, chat)
    if ns.dataset_name == "sharegpt":
        return await _sharegpt(ns, tokenizer)
    specs = await _synthetic(ns, tokenizer)
    if chat:
        texts = await asyncio.gather(*(tokenizer.decode(spec.prompt) for spec in specs))
        specs = [msgspec.structs.replace(spec, prompt=text) for spec, text in zip(specs, texts)]
    return specs


async def _synthetic(ns: argparse.Namespace, tokenizer: ServerTokenizer) -> list[RequestSpec]:
    maker = TokenPoolPromptMaker(await tokenizer.encode(" ".join(VOCABULARY), add_special_tokens=False))
    if ns.dataset_name == "random":
        workload = random_dataset(
            maker, ns.random_input_len, ns.random_output_len, ns.random_range_ratio, ns.random_prefix_len
        )
    else:
        workload = prefix_repetition_dataset(
            maker,
            ns.prefix_repetition_prefix_len,
            ns.prefix_repetition_suffix_len,
            ns.prefix_repetition_num_prefixes,
            ns.prefix_repetition_output_len,
        )
    return take(workload, ns.num_prompts, ns.seed)


async def _custom(ns: argparse.Namespace, tokenizer: ServerTokenizer, chat: bool) -> list[RequestSpec]:
    lines = read_jsonl(ns.dataset_path)
    if not ns.disable_shuffle:
        random.Random(ns.seed).shuffle(lines)
    lines = lines[: ns.num_prompts]

    async def request(line) -> RequestSpec:
        prompt = line.prompt
        if isinstance(prompt, list) and chat:  # token ids, sent as their text
            prompt = await tokenizer.decode(prompt)
        if isinstance(prompt, list):  # token ids on /v1/completions, sent as they are
            tokens = prompt
        elif chat:  # the server renders the message
            tokens = await tokenizer.render(prompt)
        elif ns.skip_chat_template:
            tokens = await tokenizer.encode(prompt)
        else:  # rendered here, as vLLM renders custom prompts for /v1/completions
            prompt = tokens = await tokenizer.render(prompt)
        return RequestSpec(prompt=prompt, max_tokens=line.max_tokens or ns.custom_output_len, prompt_tokens=len(tokens))

    specs = list(await asyncio.gather(*(request(line) for line in lines)))
    return oversample(specs, ns.num_prompts, ns.seed, allowed=not ns.no_oversample)


async def _sharegpt(ns: argparse.Namespace, tokenizer: ServerTokenizer) -> list[RequestSpec]:
    pairs = read_sharegpt(ns.dataset_path, ns.seed, shuffle=not ns.disable_shuffle)
    sampler = ShareGPTSampler(ns.num_prompts, ns.sharegpt_output_len)
    for start in range(0, len(pairs), _SHAREGPT_BATCH):
        batch = pairs[start : start + _SHAREGPT_BATCH]
        counts = await asyncio.gather(*(tokenizer.encode(text) for pair in batch for text in pair))
        for i, (prompt, _) in enumerate(batch):
            sampler.offer(prompt, len(counts[2 * i]), len(counts[2 * i + 1]))
            if sampler.done:
                break
        if sampler.done:
            break
    return oversample(sampler.specs, ns.num_prompts, ns.seed, allowed=not ns.no_oversample)
