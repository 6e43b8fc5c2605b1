"""Engine arguments (vLLM's names) and what they resolve to once the model's config is known."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from aserve.fixed_engine_args import check_fixed_engine_args, compilation_level

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # aserve/layers/attention/backend.py


# generation_config.json's keys that set sampling defaults (vLLM's), each -> the SamplingParams field it sets
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass
class EngineArgs:
    # HF directory, .gguf file, or a Hugging Face repo id in the local cache; None = the embedded SmolLM2-135M-Instruct
    model: str | None = None
    tokenizer: str | None = None  # a directory or a cached repo id; None: the model's
    # A repo id's branch, tag or commit (None: main), and the Hugging Face cache it is read from (None: $HF_HOME's);
    # nothing is downloaded (aserve/models/hub_cache.py)
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 8192 on GPU, 2048 on CPU
    # The decode steps' CUDA graph sizes, vLLM's: N alone is 1, 2, 4 and each multiple of 8 up to N; several are those
    # (aserve/worker/cuda_graphs.py capture_sizes); None: aserve's buckets up to max_num_seqs
    cuda_graph_sizes: list[int] | None = None
    # A prompt longer than this computes at most this many tokens per step (0: as many as the budget leaves), so a
    # long prompt joining running decodes lengthens their steps less (vLLM's flag)
    long_prefill_token_threshold: int = 0
    # A step that decodes takes only the prompt tokens that keep it within this many times a decode step's time
    # (aserve/core/prompt_cap.py); 0: no cap but the budget
    max_decode_slowdown: float = 0.0
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float | None = None  # KV budget; default on CPU: 2 GiB (capped to what can be used)
    kv_cache_memory_bytes: int | None = None  # the KV budget in bytes (vLLM's argument), instead of kv_cache_memory_gb
    num_gpu_blocks_override: int | None = None  # exact number of KV blocks (tests, experiments)
    load_format: str = "auto"  # auto | dummy
    quantization: str | None = None  # awq / gptq / compressed-tensors / fp8: the checkpoint must be so; fp8 / int8 on
    # a 16-bit checkpoint: quantise weights at load
    # The lm_head rounded at load: int8 (unquantised / int8 models), fp8 (FP8 models), int4 (AWQ / GPTQ)
    quantize_lm_head: bool = False
    seed: int | None = 0  # None: a random seed
    device: str = "auto"  # auto | cpu | cuda
    speculative_config: str | dict | None = None  # JSON or dict, vLLM's shape (see aserve/spec/config.py)
    attention_backend: str = "auto"  # auto (triton on GPU, torch on CPU) | torch | triton
    enforce_eager: bool = False  # no CUDA graphs (GPU) / no torch.compile of element-wise work (CPU)
    # Schedule and launch step N+1 while step N runs (hides the host's per-step work behind the GPU's).
    # None: on for CUDA.
    async_scheduling: bool | None = None
    debug_invariants: bool = False  # check block/queue invariants after every step (slow)
    # Serving: at most this many sequences waiting to be scheduled; more get HTTP 429 (None: unbounded).
    max_queue_len: int | None = None
    # Bitwise-reproducible outputs whatever the batch, chunking, prefix cache, preemption or speculation:
    # batch-invariant kernels and position-keyed seeded sampling (aserve/layers/batch_invariant.py)
    deterministic: bool = False
    # Ranks the model is split across (one process, one GPU each; CPU processes on CPU): aserve/distributed
    tensor_parallel_size: int = 1
    # The KV cache's element type: auto (the model's dtype) | fp8 / fp8_e4m3 (aserve/layers/attention/backend.py)
    kv_cache_dtype: str = "auto"
    # The most logprobs a request may ask for per token (logprobs, prompt_logprobs; -1: the whole vocabulary)
    max_logprobs: int = 20
    # Sampling defaults: auto (the model's generation_config.json), vllm (aserve's own) or a directory holding one
    generation_config: str = "auto"
    # Sampling defaults set over generation_config's (vLLM's override_generation_config; GENERATION_DEFAULTS' keys)
    override_generation_config: dict | None = None
    # Fields merged into the checkpoint's config.json before it is read (vLLM's hf_overrides), e.g. a YaRN
    # rope_scaling for a longer context (aserve/engine/config.py load_hf_config)
    hf_overrides: dict | None = None
    # vLLM's arguments for what aserve does one way: a value meaning that way is accepted, others refused
    # (aserve/fixed_engine_args.py says which and why)
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"
    swap_space: float | None = None
    enable_chunked_prefill: bool | None = True
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    distributed_executor_backend: str | None = None
    max_seq_len_to_capture: int = 8192
    compilation_config: int | dict | None = None  # the level: 0 is enforce_eager
    task: str = "auto"
    runner: str = "auto"
    limit_mm_per_prompt: dict | None = None
    enable_lora: bool = False
    enable_sleep_mode: bool = False
    skip_tokenizer_init: bool = False
    cpu_offload_gb: float = 0
    logprobs_mode: str = "raw_logprobs"
    scheduling_policy: str = "fcfs"
    model_impl: str = "auto"
    config_format: str = "auto"
    code_revision: str | None = None
    disable_sliding_window: bool = False
    disable_cascade_attn: bool = False
    calculate_kv_scales: bool = False
    enable_expert_parallel: bool = False
    kv_transfer_config: dict | None = None
    mm_processor_kwargs: dict | None = None
    hf_token: str | None = None
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    kv_events_config: dict | None = None
    disable_hybrid_kv_cache_manager: bool = False
    kv_sharing_fast_prefill: bool = False
    kv_offloading_size: float | None = None
    enable_eplb: bool = False
    profiler_config: dict | None = None  # vLLM's {"profiler": "torch", ...} (worker/profiler_hooks.py)
    max_parallel_loading_workers: int | None = None

    @property
    def kv_cache_budget_bytes(self) -> int | None:
        """The KV cache budget asked for, kv_cache_memory_bytes or kv_cache_memory_gb (None: the default)."""
        if self.kv_cache_memory_bytes is not None:
            return int(self.kv_cache_memory_bytes)
        return None if self.kv_cache_memory_gb is None else int(self.kv_cache_memory_gb * (1 << 30))

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def validate(self) -> None:
        check_fixed_engine_args(self)
        if compilation_level(self.compilation_config) == 0:  # vLLM's "no compilation, no CUDA graphs"
            self.enforce_eager = True
        if self.seed is None:  # vLLM's "no seed": a fresh one per engine
            self.seed = int.from_bytes(os.urandom(4), "little")
        if isinstance(self.dtype, torch.dtype):  # LLM(dtype=torch.float16), as vLLM takes it
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.load_format == "safetensors":  # the only weights format aserve reads: the same as auto
            self.load_format = "auto"
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_cache_memory_bytes is not None:
            if self.kv_cache_memory_gb is not None:
                raise ValueError("give kv_cache_memory_bytes or kv_cache_memory_gb, not both")
            if not self.kv_cache_memory_bytes > 0:
                raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        unknown = sorted(set(self.override_generation_config or ()) - set(GENERATION_DEFAULTS))
        if unknown:
            raise ValueError(f"override_generation_config: {unknown[0]!r} is not a sampling default (one of "
                             f"{', '.join(GENERATION_DEFAULTS)})")  # fmt: skip
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object of config fields, got "
                             f"{type(self.hf_overrides).__name__}")  # fmt: skip
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary, got {self.max_logprobs}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.cuda_graph_sizes is not None and (not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1):
            raise ValueError(f"cuda_graph_sizes must be sizes >= 1, got {self.cuda_graph_sizes}")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1 (or unset for no limit), got {self.max_queue_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_decode_slowdown != 0 and not self.max_decode_slowdown > 1:
            raise ValueError(f"max_decode_slowdown must be 0 (off) or > 1, got {self.max_decode_slowdown}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto (safetensors, or a .gguf file) or dummy, got "
                             f"{self.load_format!r}")  # fmt: skip
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.quantize_lm_head and self.deterministic:
            raise ValueError("--quantize-lm-head cannot run in deterministic mode (its batch-invariant kernels are "
                             "for unquantised weights): turn one of them off")  # fmt: skip
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            hint = " (e5m2 is not supported: fp8 means e4m3)" if self.kv_cache_dtype == "fp8_e5m2" else ""
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}{hint}")  # fmt: skip
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA GPU here (use auto or cpu)")
    return resolved


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype.removeprefix("torch."), torch.float32)
    if config_dtype is None:
        config_dtype = torch.float32
    if config_dtype == torch.float32 and device.type == "cuda":
        return torch.bfloat16  # fp32 checkpoints run in bf16 on GPU, as in vLLM
    return config_dtype


def resolve_max_model_len(requested: int | None, limit: int) -> int:
    """The context length: `requested`, at most the model's `limit` (aserve/layers/rotary.py context_length)."""
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len {requested} exceeds what the model supports ({limit}, from max_position_embeddings and "
            "its rope scaling); lower --max-model-len"
        )
    return requested
