"""vLLM's engine arguments for what aserve does in one way only. Each is an EngineArgs field (so an `LLM(...)` keyword
and an `aserve serve` flag); a value that means what aserve does is accepted, any other is refused when the engine
starts, with the reason (never taken and ignored).

compilation_config is the one with an effect: level / mode 0 (vLLM's "no compilation, no CUDA graphs") is
--enforce-eager; 3 (vLLM's default) is aserve's default, decode steps replayed as CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FixedArg:
    accepts: Callable[[Any], bool]
    reason: str  # why other values are refused: what aserve does
    help: str  # the flag's --help line


def _is(*values) -> Callable[[Any], bool]:
    return lambda value: any(value == v and type(value) is type(v) for v in values)


def _any(value) -> bool:
    return True


def _text_only(limits) -> bool:
    """vLLM's limit_mm_per_prompt: {"image": 0, ...}, or {"image": {"count": 0, ...}}; all zero is text only."""
    if limits is None:
        return True
    if not isinstance(limits, dict):
        return False
    counts = [v.get("count", 1) if isinstance(v, dict) else v for v in limits.values()]
    return all(isinstance(c, int) and c == 0 for c in counts)


def compilation_level(config) -> int | None:
    """vLLM's compilation_config as a level: 3, {"level": 3} or {"mode": 3} -> 3; None / {} -> None (the default);
    anything else -> -1 (not one aserve takes)."""
    if config is None or config == {}:
        return None
    if isinstance(config, dict) and len(config) == 1:
        key, config = next(iter(config.items()))
        if key not in ("level", "mode"):
            return -1
    if isinstance(config, int) and not isinstance(config, bool) and config in (0, 3):
        return config
    return -1


FIXED_ENGINE_ARGS: dict[str, FixedArg] = {
    "trust_remote_code": FixedArg(
        _any, "", "accepted: aserve builds every architecture itself and never runs a checkpoint's code"
    ),
    "tokenizer_mode": FixedArg(
        _is("auto"),
        "aserve runs the model's fast (Rust) tokenizer (auto) only",
        "accepted as auto: the model's fast (Rust) tokenizer",
    ),
    "swap_space": FixedArg(_any, "", "accepted: preempted requests are recomputed, never swapped to CPU memory"),
    "enable_chunked_prefill": FixedArg(
        _is(True, None),
        "aserve always chunks prompts (a prompt runs in steps of at most --max-num-batched-tokens tokens)",
        "accepted on: aserve always chunks prompts within --max-num-batched-tokens",
    ),
    "pipeline_parallel_size": FixedArg(
        _is(1),
        "aserve splits models by tensor parallelism only (--tensor-parallel-size)",
        "accepted as 1: aserve splits models by tensor parallelism only; also -pp",
    ),
    "data_parallel_size": FixedArg(
        _is(1),
        "one engine per server: run a server per replica behind a load balancer",
        "accepted as 1: one engine per server",
    ),
    "disable_custom_all_reduce": FixedArg(
        _any, "", "accepted: tensor-parallel all-reduces are NCCL's (gloo on CPU); there is no custom all-reduce"
    ),
    "distributed_executor_backend": FixedArg(
        _is(None, "mp", "uni"),
        "tensor-parallel ranks are processes on this host (mp; uni: one process, tensor parallel size 1); no Ray",
        "accepted as mp (tensor-parallel ranks are processes on this host) or uni (tensor parallel size 1)",
    ),
    "max_seq_len_to_capture": FixedArg(
        lambda v: isinstance(v, int) and v >= 1,
        "it must be a length >= 1",
        "accepted: aserve's CUDA graphs replay decode steps of any context length",
    ),
    "compilation_config": FixedArg(
        lambda v: compilation_level(v) != -1,
        "aserve does not torch.compile the model: "
        "it takes a level only, 0 (no CUDA graphs, as --enforce-eager) or 3 (vLLM's "
        "default: decode steps as CUDA graphs)",
        'vLLM\'s level (JSON: 3, or {"level": 3} / {"mode": 3}): 3 is aserve\'s default '
        "(decode steps as CUDA graphs), 0 is --enforce-eager; others refused",
    ),
    "task": FixedArg(
        _is("auto", "generate"),
        "aserve runs generative models only (no pooling, embedding or scoring models)",
        "accepted as auto or generate: aserve runs generative models",
    ),
    "runner": FixedArg(
        _is("auto", "generate"),
        "aserve runs generative models only (no pooling runner)",
        "accepted as auto or generate: aserve runs generative models",
    ),
    "limit_mm_per_prompt": FixedArg(
        _text_only,
        "aserve serves a vision-language checkpoint by its language model: text only (0 for every modality)",
        'accepted with every count 0 (JSON, e.g. {"image": 0}): prompts are text only',
    ),
    "enable_lora": FixedArg(_is(False), "aserve serves no LoRA adapters", "accepted off: no LoRA adapters"),
    "enable_sleep_mode": FixedArg(
        _is(False), "the engine holds its GPU memory while it runs (no sleep / wake_up)", "accepted off: no sleep mode"
    ),
    "skip_tokenizer_init": FixedArg(
        _is(False),
        "the engine detokenises every output (stop strings and chat rendering need the tokenizer)",
        "accepted off: the tokenizer is always loaded",
    ),
    "cpu_offload_gb": FixedArg(
        lambda v: v == 0,
        "the weights stay on the device (no CPU offload)",
        "accepted as 0: the weights stay on the device",
    ),
    "logprobs_mode": FixedArg(
        _is("raw_logprobs"),
        "logprobs are the model's own log-softmax, before temperature, "
        "penalties, logit_bias and top-k / top-p (vLLM's raw_logprobs)",
        "accepted as raw_logprobs: logprobs are the model's own log-softmax, before any sampling parameter",
    ),
    "scheduling_policy": FixedArg(
        _is("fcfs"), "requests are scheduled first come, first served", "accepted as fcfs: first come, first served"
    ),
    "model_impl": FixedArg(
        _is("auto", "vllm"),
        "every architecture runs aserve's own model code (transformers' modeling code is never run)",
        "accepted as auto or vllm: aserve's own model code",
    ),
    "config_format": FixedArg(
        _is("auto", "hf"),
        "checkpoints are read from transformers' config.json (no Mistral params.json)",
        "accepted as auto or hf: transformers' config.json",
    ),
    "code_revision": FixedArg(_any, "", "accepted: a checkpoint's own code is never run"),
    "disable_sliding_window": FixedArg(
        _is(False),
        "sliding-window layers attend within their windows (Mistral, Gemma 2 / 3), over any --max-model-len",
        "accepted off: sliding-window layers attend within their windows",
    ),
    "disable_cascade_attn": FixedArg(
        _any, "", "accepted: there is no cascade attention (a shared prefix's blocks are read by each request)"
    ),
    "calculate_kv_scales": FixedArg(
        _is(False),
        "an FP8 KV cache's scales are the checkpoint's or 1.0 (aserve computes none)",
        "accepted off: FP8 KV cache scales are the checkpoint's or 1.0",
    ),
    "enable_expert_parallel": FixedArg(
        _is(False),
        "experts split across GPUs by tensor parallelism (each expert's width), never placed whole on different GPUs",
        "accepted off: experts split by tensor parallelism",
    ),
    "kv_transfer_config": FixedArg(
        _is(None), "no KV cache is sent between instances (no disaggregated prefill)", "accepted unset"
    ),
    "mm_processor_kwargs": FixedArg(
        lambda v: v is None or v == {},
        "prompts are text only (no multimodal processor)",
        "accepted unset or {}: prompts are text only",
    ),
    "hf_token": FixedArg(_any, "", "accepted: aserve downloads nothing (local checkpoints, the embedded model)"),
    "max_num_partial_prefills": FixedArg(
        _is(1),
        "prompts are scheduled as vLLM v1 schedules them, with no cap of their own on partly computed prompts "
        "(--long-prefill-token-threshold bounds a prompt's share of a step)",
        "accepted as 1: vLLM v1's scheduling",
    ),
    "max_long_partial_prefills": FixedArg(
        _is(1),
        "prompts are scheduled as vLLM v1 schedules them, with no cap of their own on partly computed long prompts",
        "accepted as 1: vLLM v1's scheduling",
    ),
    "kv_events_config": FixedArg(_is(None), "aserve publishes no KV cache events", "accepted unset"),
    "disable_hybrid_kv_cache_manager": FixedArg(
        _is(False),
        "models with sliding-window and full-attention layers keep a block table per kind (the hybrid manager)",
        "accepted off: the hybrid KV cache manager for sliding-window models",
    ),
    "kv_sharing_fast_prefill": FixedArg(
        _is(False), "every layer computes its own KV for every prompt token", "accepted off"
    ),
    "kv_offloading_size": FixedArg(_is(None), "the KV cache stays on the device (no CPU offloading)", "accepted unset"),
    "enable_eplb": FixedArg(
        _is(False), "no expert-parallel load balancing: experts split by tensor parallelism", "accepted off"
    ),
    "max_parallel_loading_workers": FixedArg(
        lambda v: v is None or (isinstance(v, int) and v >= 1),
        "a worker count is at least 1",
        "accepted: each process loads its weights file by file",
    ),
}


def check_fixed_engine_args(args) -> None:
    """ValueError naming the argument (and its flag) whose value aserve does not honour."""
    for name, rule in FIXED_ENGINE_ARGS.items():
        value = getattr(args, name)
        if not rule.accepts(value):
            raise ValueError(f"{name}={value!r} (--{name.replace('_', '-')}) is not supported: {rule.reason}")
    if args.distributed_executor_backend == "uni" and args.tensor_parallel_size != 1:
        raise ValueError(f"distributed_executor_backend='uni' (--distributed-executor-backend) is not supported: one "
                         f"process cannot split the model {args.tensor_parallel_size} ways (use mp)")  # fmt: skip
