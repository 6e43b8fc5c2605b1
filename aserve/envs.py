"""Every environment variable aserve reads, in one place (vLLM's envs.py).

Read one as an attribute, `envs.ASERVE_PDL`, at the point of use: each read parses os.environ afresh, so a test can
monkeypatch the environment. The switches are for A/B runs and for machines where a fast path misbehaves; the
defaults are what aserve runs. A switch "turned off" is set to 0.

    ASERVE_CACHE          where aserve caches what it builds once per machine: GGUF files converted to HF
                          directories (aserve/models/model_path.py) and the compiled CPU kernels
                          (aserve/kernels/cpu_build.py). Default ~/.cache/aserve.
    HF_HUB_CACHE          the Hugging Face cache where a model given as a repo id (org/name) is looked for
                          (aserve/models/hub_cache.py; --download-dir names another), as huggingface_hub finds it:
                          $HF_HUB_CACHE (or its older name HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else
                          $XDG_CACHE_HOME/huggingface/hub. Default ~/.cache/huggingface/hub.
    ASERVE_CPU_KERNELS    CPU: build (at engine start) and use aserve's C++ kernels (attention, element-wise, GEMV,
                          sampling: aserve/kernels/cpu_build.py); 0 runs the torch paths everywhere. Default on.
    CXX                   the C++ compiler those kernels are built with (torch.utils.cpp_extension's choice too).
                          Default c++.
    ASERVE_CPU_AMX        CPU: the decode attention kernel's AMX tile path where the CPU has AMX (read by
                          aserve/kernels/csrc/attention.cpp with getenv, once per process; 0, or any value starting
                          with 0, keeps it on AVX-512). Default on.
    ASERVE_CPU_MV         CPU, bf16: one-row inputs of a linear layer (batch-1 decode) as a GEMV on the plain weight
                          instead of oneDNN's prepacked copy (aserve/layers/linear.py). Default on.
    ASERVE_CPU_ONE_TOKEN  CPU, bf16: steps of one token through the flat loop of C kernel calls
                          (aserve/models/cpu_one_token.py) instead of the module forward. Default on.
    ASERVE_CPU_MALLOC     CPU: keep freed memory in the process instead of returning it to the OS after every step
                          (aserve/worker/host_memory.py). Default on.
    ASERVE_GEMV           GPU, 16-bit: one-row inputs of a linear layer (batch-1 decode) through the Triton GEMV
                          (aserve/kernels/gemv.py) instead of cuBLAS. Default on.
    ASERVE_PDL            GPU (Hopper and newer): programmatic dependent launch of aserve's Triton kernels
                          (aserve/kernels/pdl.py). Default on.
    ASERVE_PIECEWISE_GRAPHS  GPU: steps with prompts of up to 1,024 tokens replay CUDA graphs in pieces around
                          attention (aserve/worker/piecewise_graphs.py) instead of an eager forward. Default on.
    ASERVE_STREAM_BUFFER  the server: how many bytes of events may wait for a streaming client that stopped reading
                          (its TCP window full) before its requests are ended and its connection closed
                          (aserve/entrypoints/openai/event_stream.py). Default 4 MiB.
    ASERVE_STREAM_STALL_TIMEOUT  the server: how many seconds a streaming client that stopped reading may keep
                          its requests paused (left out of the batch, waiting for it to read) before they are ended
                          and its connection closed (aserve/entrypoints/openai/event_stream.py). Default 60.
    VLLM_SERVER_DEV_MODE  vLLM's: 1 serves the development routes (/reset_prefix_cache, /server_info, ...:
                          aserve/entrypoints/openai/dev_routes.py). Default off.
    VLLM_TORCH_PROFILER_DIR  vLLM's older switch for its profiler hooks: without --profiler-config, the torch
                          profiler writing its traces here (aserve/worker/profiler_hooks.py). Default unset.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    ASERVE_CACHE: str
    HF_HUB_CACHE: str
    ASERVE_CPU_KERNELS: bool
    CXX: str
    ASERVE_CPU_AMX: bool
    ASERVE_CPU_MV: bool
    ASERVE_CPU_ONE_TOKEN: bool
    ASERVE_CPU_MALLOC: bool
    ASERVE_GEMV: bool
    ASERVE_PDL: bool
    ASERVE_PIECEWISE_GRAPHS: bool
    ASERVE_STREAM_BUFFER: int
    ASERVE_STREAM_STALL_TIMEOUT: float
    VLLM_SERVER_DEV_MODE: bool
    VLLM_TORCH_PROFILER_DIR: str


def _switch(name: str) -> Callable[[], bool]:
    """On unless the variable is 0."""
    return lambda: os.environ.get(name, "1") != "0"


def _hf_hub_cache() -> str:
    """As huggingface_hub's constants read it (at each call here, not once at import)."""
    home = _path(os.getenv("HF_HOME", os.path.join(os.getenv("XDG_CACHE_HOME", "~/.cache"), "huggingface")))
    return _path(os.getenv("HF_HUB_CACHE", os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))))


def _path(value: str) -> str:
    return os.path.expandvars(os.path.expanduser(value))


environment_variables: dict[str, Callable[[], Any]] = {
    "ASERVE_CACHE": lambda: os.environ.get("ASERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "aserve")),
    "HF_HUB_CACHE": _hf_hub_cache,
    "ASERVE_CPU_KERNELS": _switch("ASERVE_CPU_KERNELS"),
    "CXX": lambda: os.environ.get("CXX", "c++"),
    # as the C source reads it: off when the value starts with 0
    "ASERVE_CPU_AMX": lambda: not os.environ.get("ASERVE_CPU_AMX", "1").startswith("0"),
    "ASERVE_CPU_MV": _switch("ASERVE_CPU_MV"),
    "ASERVE_CPU_ONE_TOKEN": _switch("ASERVE_CPU_ONE_TOKEN"),
    "ASERVE_CPU_MALLOC": _switch("ASERVE_CPU_MALLOC"),
    "ASERVE_GEMV": _switch("ASERVE_GEMV"),
    "ASERVE_PDL": _switch("ASERVE_PDL"),
    "ASERVE_PIECEWISE_GRAPHS": _switch("ASERVE_PIECEWISE_GRAPHS"),
    "ASERVE_STREAM_BUFFER": lambda: int(os.environ.get("ASERVE_STREAM_BUFFER", str(4 << 20))),
    "ASERVE_STREAM_STALL_TIMEOUT": lambda: float(os.environ.get("ASERVE_STREAM_STALL_TIMEOUT", "60")),
    "VLLM_SERVER_DEV_MODE": lambda: os.environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"),
    "VLLM_TORCH_PROFILER_DIR": lambda: os.environ.get("VLLM_TORCH_PROFILER_DIR", ""),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
