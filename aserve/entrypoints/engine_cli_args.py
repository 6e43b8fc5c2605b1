"""`aserve serve`'s engine flags: one per EngineArgs field, with vLLM's names, help that states each default, and
the parsed namespace back to EngineArgs. Shared by `aserve serve`, `aserve run-batch` and `aserve bench`."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from aserve.config import EngineArgs
from aserve.entrypoints.openai.cli_args import json_object, json_value
from aserve.fixed_engine_args import FIXED_ENGINE_ARGS

_HELP = {
    "model": "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "tokenizer": "a tokenizer directory other than the model's (default: the model's)",
    "served_model_name": "the name(s) requests use; responses and metrics carry the first (default: the model's "
    "directory or file name)",
    "block_size": "tokens per KV-cache block (a power of two <= 128)",
    "max_model_len": "the longest prompt + output in tokens (default: the model's max_position_embeddings)",
    "max_num_seqs": "the most sequences in one step",
    "cuda_graph_sizes": "decode steps of up to this many requests replay CUDA graphs: N alone captures 1, 2, 4 and "
    "each multiple of 8 up to N, several values exactly those (default: aserve's 20 sizes from 1 to 512, up to "
    "--max-num-seqs)",
    "max_num_batched_tokens": "the most tokens in one step, prompts chunked to fit (default: 8192 on GPU, 2048 on CPU)",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes already computed",
    "gpu_memory_utilization": "the share of GPU memory the model, activations and KV cache may take",
    "num_gpu_blocks_override": "exactly this many KV-cache blocks (tests, experiments)",
    "seed": "the engine's random seed (unseeded requests draw from it; none: a random one)",
    "speculative_config": "speculative decoding, vLLM's JSON: ngram / draft_model / layer_skip (README)",
    "attention_backend": "auto (triton on GPU, torch on CPU) | torch | triton",
    "max_logprobs": "the most logprobs / prompt_logprobs a request may ask for per token (-1: the vocabulary)",
    "generation_config": "sampling defaults for requests that leave them unset: auto (the model's "
    "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty), vllm (aserve's own), or a "
    "directory holding one",
    "override_generation_config": "sampling defaults over --generation-config's, a JSON object (e.g. "
    '{"temperature": 0.5, "max_new_tokens": 512}: max_new_tokens caps every request\'s max_tokens)',
    "hf_overrides": "config.json fields to set before the model is read, a JSON object (e.g. "
    '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}} for '
    "Qwen3 at 128k; a nested object merges into the sub-config it names)",
    "dtype": "auto | bfloat16 | float16 | float32",
    "load_format": "auto | dummy (random weights at the model's real shapes)",
    "kv_cache_memory_gb": "KV cache budget in GiB (CPU default: 2)",
    "kv_cache_memory_bytes": "KV cache budget in bytes, vLLM's spelling of --kv-cache-memory-gb (e.g. 8G)",
    "device": "auto | cpu | cuda",
    "enforce_eager": "CPU: do not torch.compile element-wise ops (faster start)",
    "debug_invariants": "check KV-block and queue invariants after every step (slow)",
    "max_queue_len": "serving: answer 429 (with Retry-After) when more sequences than this would wait for a slot",
    "async_scheduling": "prepare step N+1 while the GPU runs step N (default: on for CUDA, off on CPU)",
    "deterministic": "bitwise-reproducible tokens and logprobs per request whatever else is batched with it, "
    "however its prompt is chunked, with or without a prefix-cache hit, preemption or speculation (batch-invariant "
    "kernels; seeded sampling keyed by output position)",
    "kv_cache_dtype": "auto (the model's dtype) | fp8 / fp8_e4m3: KV cache in FP8 e4m3, twice the tokens in the same "
    "memory (per-layer k/v scales from the checkpoint, else 1.0)",
    "long_prefill_token_threshold": "at most this many of a prompt's tokens per step (0: what the token budget "
    "leaves): a long prompt joining running decodes lengthens their steps, and so their inter-token latency, less",
    "max_decode_slowdown": "a step that decodes takes only the prompt tokens that keep it within this many times "
    "the decode step of the live requests' batch (a step-time model measured at start-up), bounding the "
    "inter-token latency that prompts add, at some cost in time to first token under load (e.g. 2; 0: off, "
    "prompts take what the budget leaves)",
    "tensor_parallel_size": "split the model across this many GPUs (processes on CPU), Megatron-style; also -tp",
    "quantization": "awq / gptq / compressed-tensors / fp8: require a checkpoint so quantised (detected from the "
    "checkpoint either way); fp8 / int8 on a 16-bit checkpoint: quantise its linear weights at load to FP8 e4m3 / int8 "
    "(per channel)",
    "profiler_config": 'vLLM\'s profiler hooks, a JSON object: {"profiler": "torch", "torch_profiler_dir": DIR} '
    "(traces of the steps between LLM.start_profile / stop_profile or POST /start_profile / /stop_profile) or "
    '{"profiler": "cuda"} (Nsight Systems\' capture range); default: $VLLM_TORCH_PROFILER_DIR as the torch one, if '
    "set, else none",
    "quantize_lm_head": "round the lm_head at load: int8 per channel (unquantised / int8 models), fp8 per channel "
    "(--quantization fp8, FP8 checkpoints), int4 per group (AWQ / GPTQ); a tied embedding keeps its 16-bit table",
}


_HELP.update({name: rule.help for name, rule in FIXED_ENGINE_ARGS.items()})
_ALIASES = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",)}  # vLLM's short flags
# served_model_name: several names, requests may use any, responses carry the first
_NARGS = {"served_model_name": "+", "cuda_graph_sizes": "+", "hf_token": "?"}  # --hf-token alone: vLLM's


def human_readable_int(value: str) -> int:
    """vLLM's token counts: 4096, 32k (32,000), 32K (32,768), 1m / 1M (10**6 / 2**20)."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if value and value[-1] in units:
            number = float(value[:-1]) * units[value[-1]]
            if number != int(number):
                raise ValueError
            return int(number)
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of tokens: {value!r} (e.g. 4096, 32k, 32K)") from None


_TYPES = {"max_model_len": human_readable_int, "max_num_batched_tokens": human_readable_int,
          "kv_cache_memory_bytes": human_readable_int,
          "override_generation_config": json_object, "hf_overrides": json_object, "limit_mm_per_prompt": json_object,
          "kv_transfer_config": json_object, "mm_processor_kwargs": json_object, "cuda_graph_sizes": int,
          "profiler_config": json_object, "kv_events_config": json_object,
          "compilation_config": json_value}  # fmt: skip


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field: --max-num-seqs, --enable-prefix-caching/--no-enable-prefix-caching, ..."""
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        help_text = _HELP.get(f.name, "")
        if "default:" not in help_text:
            help_text += f" (default: {f.default})"
        if hint is bool or hint == bool | None:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
            continue
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        parser.add_argument(flag, *_ALIASES.get(f.name, ()), type=_TYPES.get(f.name, base), default=f.default,
                            help=help_text,
                            **({"nargs": _NARGS[f.name]} if f.name in _NARGS else {}))  # fmt: skip


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if values["served_model_name"] is not None:
        values["served_model_name"] = values["served_model_name"][0]
    return EngineArgs(**values)


class HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it ("default: ...")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if "default" in help or not action.option_strings or action.default is argparse.SUPPRESS:
            return help
        if isinstance(action, argparse._StoreTrueAction):
            default = "off"
        elif action.default is None:
            default = "none"
        else:
            default = "%(default)s"
        return f"{help} (default: {default})" if help else f"default: {default}"
