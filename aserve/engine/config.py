"""EngineArgs resolved against the model: where it lives, its HF config and tokenizer, device, dtype, context length and
the step's token budget. Built once per engine; the engine core and the input / output processors read it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from aserve.config import GENERATION_DEFAULTS, EngineArgs, resolve_device, resolve_dtype, resolve_max_model_len
from aserve.layers.batch_invariant import check_supported
from aserve.layers.rotary import context_length, longrope_switch_length
from aserve.models.model_path import resolve_model, resolve_tokenizer
from aserve.models.registry import architecture_of
from aserve.models.vision_language import text_side
from aserve.spec.config import SpeculativeConfig
from aserve.worker.profiler_hooks import ProfilerSettings

logger = logging.getLogger("aserve")


@dataclass
class EngineConfig:
    args: EngineArgs
    model_dir: str
    served_model_name: str
    hf_config: object
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    max_num_batched_tokens: int
    eos_token_id: int | None
    vocab_size: int
    spec_config: SpeculativeConfig | None
    async_scheduling: bool  # launch step N+1 before step N is processed (see aserve/engine/core.py)
    max_chars_per_token: int  # the most characters one token stands for (the function of that name)
    # No text longer than max_model_len x max_chars_per_token characters fits in max_model_len tokens, however it is
    # tokenised: a prompt beyond it is refused before any tokenising (which holds ~350 bytes per token while it runs).
    max_prompt_chars: int
    # generation_config.json's other end-of-sequence ids (Gemma 3's <end_of_turn>, Llama 3's <|eot_id|>): sequences
    # stop at them too unless ignore_eos, as with transformers' generate (and vLLM)
    extra_eos_token_ids: tuple[int, ...] = ()
    # Prompts longer than this are computed with other rotary tables (LongRoPE's long factors, aserve/models/phi3.py):
    # their blocks are cached apart from those of shorter prompts. None: every prompt alike.
    long_prompt_len: int | None = None
    # The model's recommended sampling (generation_config.json's temperature, top_p, top_k, min_p,
    # repetition_penalty: what it sets other than transformers' defaults, as vLLM reads it under --generation-config
    # auto): the defaults of requests that leave them unset (server) or of generate() given no SamplingParams
    default_sampling: dict = field(default_factory=dict)
    profiler: ProfilerSettings | None = None  # --profiler-config (worker/profiler_hooks.py); None: no profiler

    @property
    def architecture(self) -> str:
        return architecture_of(self.hf_config)

    # vLLM's ModelConfig names, for code reading `llm.llm_engine.model_config`
    @property
    def model(self) -> str:
        """The model as given (a directory, .gguf file or repo id); the default model's directory when none was."""
        return self.args.model or self.model_dir

    @property
    def max_logprobs(self) -> int:
        return self.args.max_logprobs

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def cache_metrics_info(self, num_gpu_blocks: int) -> dict:
        """The KV cache's settings (with the engine's `num_gpu_blocks`), as vLLM's cache_config_info metric labels
        them."""
        args = self.args
        return {"block_size": self.block_size, "num_gpu_blocks": num_gpu_blocks, "cache_dtype": args.kv_cache_dtype,
                "enable_prefix_caching": args.enable_prefix_caching,
                "gpu_memory_utilization": args.gpu_memory_utilization}  # fmt: skip

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> EngineConfig:
        args.validate()
        model_dir, default_name = resolve_model(args.model, args.revision, args.download_dir)
        hf_config = text_side(load_hf_config(model_dir, args.hf_overrides), model_dir)
        if args.deterministic:
            check_supported(architecture_of(hf_config), args.quantization)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(args, model_dir))
        device = resolve_device(args.device)
        profiler = ProfilerSettings.parse(args.profiler_config, device)
        spec_config = SpeculativeConfig.parse(args.speculative_config)
        async_scheduling = args.async_scheduling if args.async_scheduling is not None else device.type == "cuda"
        max_model_len = resolve_max_model_len(args.max_model_len, context_length(hf_config))
        chars_per_token = max_chars_per_token(tokenizer)
        eos_token_id = _eos_token_id(hf_config, tokenizer)
        return cls(
            args=args,
            model_dir=model_dir,
            served_model_name=args.served_model_name or default_name,
            hf_config=hf_config,
            tokenizer=tokenizer,
            device=device,
            dtype=resolve_dtype(args.dtype, hf_config, device),
            max_model_len=max_model_len,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens or (8192 if device.type == "cuda" else 2048),
            eos_token_id=eos_token_id,
            vocab_size=hf_config.vocab_size,
            spec_config=spec_config,
            async_scheduling=async_scheduling,
            max_chars_per_token=chars_per_token,
            max_prompt_chars=max_model_len * chars_per_token,
            extra_eos_token_ids=_extra_eos_token_ids(model_dir, hf_config, eos_token_id),
            default_sampling=default_sampling(args.generation_config, model_dir, args.override_generation_config),
            long_prompt_len=longrope_switch_length(hf_config),
            profiler=profiler,
        )


def tokenizer_dir(args: EngineArgs, model_dir: str) -> str:
    """--tokenizer (a directory or a cached repo id, at --tokenizer-revision), else the model's own: its directory,
    or its repo at --tokenizer-revision where that differs from --revision (as vLLM reads them)."""
    if args.tokenizer is not None:
        return resolve_tokenizer(args.tokenizer, args.tokenizer_revision, args.download_dir)
    if args.tokenizer_revision not in (None, args.revision):
        return resolve_model(args.model, args.tokenizer_revision, args.download_dir)[0]
    return model_dir


def load_hf_config(model_dir: str, overrides: dict | None):
    """config.json as transformers reads it, `overrides` (vLLM's hf_overrides) merged into it first: an object
    merges into the object it names (a sub-config), anything else replaces the field; rope_scaling / rope_theta go
    into rope_parameters where the file keeps them there (transformers 5)."""
    if not overrides:
        return AutoConfig.from_pretrained(model_dir)
    from transformers import CONFIG_MAPPING, PretrainedConfig

    data, _ = PretrainedConfig.get_config_dict(model_dir)
    data = _merged(data, overrides)
    if data.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(f"hf_overrides: model_type {data.get('model_type')!r} is not one transformers knows")
    return CONFIG_MAPPING[data["model_type"]].from_dict(data)


def _merged(data: dict, overrides: dict) -> dict:
    data = dict(data)
    for key, value in overrides.items():
        if key in ("rope_scaling", "rope_theta") and isinstance(data.get("rope_parameters"), dict):
            rope = value if key == "rope_scaling" else {"rope_theta": value}
            rope = {"rope_type": "default"} if rope is None else rope  # rope_scaling null: no scaling
            if isinstance(rope, dict) and "type" in rope:
                rope = {"rope_type": rope["type"], **{k: v for k, v in rope.items() if k != "type"}}
            key, value = "rope_parameters", rope
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            value = _merged(data[key], value)
        data[key] = value
    return data


def max_chars_per_token(tokenizer) -> int:
    """The longest vocabulary entry, added tokens included. An entry is spelled with at least one character per
    character of the text it stands for: byte-level BPE spells each UTF-8 byte as one character, SentencePiece spells
    a space as "\u2581" and unknown bytes as "<0x..>". So a text of C characters needs at least C / this many
    tokens, as long as the normaliser keeps at least one byte per character (Unicode composition does). A normaliser
    that drops characters (stripping runs of spaces) could fit a longer, degenerate text: it is refused all the same.
    """
    return max(1, max((len(piece) for piece in tokenizer.get_vocab()), default=1))


def default_sampling(generation_config: str, model_dir: str, overrides: dict | None = None) -> dict:
    """--generation-config: auto (the model directory's generation_config.json), vllm (none: aserve's own defaults)
    or a directory holding one, then --override-generation-config over it -> the SamplingParams defaults they set
    (EngineConfig.default_sampling; max_new_tokens as max_tokens, a cap on every request's, as vLLM)."""
    diff = {}
    if generation_config != "vllm":
        source = model_dir if generation_config == "auto" else generation_config
        if generation_config != "auto" and not os.path.isfile(os.path.join(source, "generation_config.json")):
            raise ValueError(f"--generation-config {generation_config!r}: no generation_config.json there (auto, "
                             "vllm, or a directory holding one)")  # fmt: skip
        try:
            diff = GenerationConfig.from_pretrained(source).to_diff_dict()
        except OSError:  # none in the model directory
            pass
    diff.update(overrides or {})
    defaults = {field: diff[k] for k, field in GENERATION_DEFAULTS.items() if diff.get(k) is not None}
    if defaults:
        logger.info("Default sampling parameters from the model's generation config: %s (--generation-config vllm: "
                    "aserve's own)", defaults)  # fmt: skip
    return defaults


def _extra_eos_token_ids(model_dir: str, hf_config, eos_token_id: int | None) -> tuple[int, ...]:
    """The end-of-sequence ids transformers' generate stops at (generation_config.json's, else config.json's) other
    than `eos_token_id`."""
    try:
        ids = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: transformers takes the model config's
        ids = getattr(hf_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return tuple(i for i in dict.fromkeys(ids) if i != eos_token_id)


def _eos_token_id(hf_config, tokenizer) -> int | None:
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
    return eos
