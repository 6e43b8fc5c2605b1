"""vLLM's profiler hooks: `--profiler-config` (or `$VLLM_TORCH_PROFILER_DIR`) arms them, `LLM.start_profile()` /
`stop_profile()` and the server's POST /start_profile and /stop_profile run them, `aserve bench serve --profile` and
`aserve bench latency / throughput --profile` call them around the measured run; the model runner of every rank
runs one (ModelRunner.start_profile).

    {"profiler": "torch", "torch_profiler_dir": DIR, ...}   torch.profiler over the engine's steps (CPU ops of the
        thread that runs the model, and every GPU kernel); stop writes a trace (Perfetto / chrome://tracing) to DIR,
        `aserve-PID.TIMESTAMP.pt.trace.json[.gz]`, and, with torch_profiler_dump_cuda_time_total, the op table
        sorted by device time (by CPU time without a GPU) to `profiler_out_PID.txt`
    {"profiler": "cuda"}   cudaProfilerStart / cudaProfilerStop, for Nsight Systems' capture range
                           (`nsys profile --capture-range=cudaProfilerApi`); a GPU only

The torch keys and their defaults are vLLM's ProfilerConfig's: torch_profiler_with_stack (true),
torch_profiler_with_flops (false), torch_profiler_use_gzip (true), torch_profiler_dump_cuda_time_total (true),
torch_profiler_record_shapes (false), torch_profiler_with_memory (false). Any other key is refused, naming it. With
tensor parallelism every rank writes its own trace and table.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from aserve import envs


@dataclass(frozen=True)
class ProfilerSettings:
    kind: str  # "torch" or "cuda"
    directory: str = ""  # torch: where traces go (absolute)
    # the torch profiler's switches, vLLM's keys torch_profiler_<name> with vLLM's defaults
    with_stack: bool = True
    with_flops: bool = False
    use_gzip: bool = True
    dump_cuda_time_total: bool = True
    record_shapes: bool = False
    with_memory: bool = False

    @classmethod
    def parse(cls, config: dict | None, device: torch.device) -> ProfilerSettings | None:
        """EngineArgs.profiler_config (else $VLLM_TORCH_PROFILER_DIR as {"profiler": "torch", "torch_profiler_dir":
        ...}) -> the settings, or None: no profiler. ValueError naming what is wrong."""
        if config is None:
            if not envs.VLLM_TORCH_PROFILER_DIR:
                return None
            config = {"profiler": "torch", "torch_profiler_dir": envs.VLLM_TORCH_PROFILER_DIR}
        if not isinstance(config, dict):
            raise ValueError(f"profiler_config must be a JSON object, got {type(config).__name__}")
        kind = config.get("profiler")
        if kind is None:  # vLLM's default: no profiler; a directory alone means the torch one
            if not config.get("torch_profiler_dir"):
                if set(config) - {"profiler"}:
                    raise ValueError(f'profiler_config {config}: name the profiler, "torch" or "cuda"')
                return None
            kind = "torch"
        if kind not in ("torch", "cuda"):
            raise ValueError(f'profiler_config: profiler must be "torch" or "cuda", got {kind!r}')
        switches = {f"torch_profiler_{f.name}": f.name for f in dataclasses.fields(cls) if f.type == "bool"}
        unknown = sorted(set(config) - {"profiler", "torch_profiler_dir", *switches})
        if unknown:
            raise ValueError(f"profiler_config: {unknown[0]!r} is not a profiler setting aserve takes (profiler, "
                             f"torch_profiler_dir, {', '.join(switches)})")  # fmt: skip
        for key in switches:
            if key in config and not isinstance(config[key], bool):
                raise ValueError(f"profiler_config: {key} must be true or false, got {config[key]!r}")
        if kind == "cuda":
            if device.type != "cuda":
                raise ValueError("profiler_config: the cuda profiler (cudaProfilerStart) needs a GPU")
            return cls("cuda")
        directory = config.get("torch_profiler_dir")
        if not isinstance(directory, str) or not directory:
            raise ValueError("profiler_config: the torch profiler needs torch_profiler_dir, where its traces go")
        return cls("torch", os.path.abspath(os.path.expanduser(directory)),
                   **{name: config[key] for key, name in switches.items() if key in config})  # fmt: skip


def require(settings: ProfilerSettings | None) -> ProfilerSettings:
    """The engine's profiler settings; RuntimeError saying how to arm them where there are none."""
    if settings is None:
        raise RuntimeError(
            'the profiler is off: start the engine with profiler_config {"profiler": "torch", '
            '"torch_profiler_dir": DIR} (--profiler-config), or with $VLLM_TORCH_PROFILER_DIR set'
        )
    return settings


class Profiler:
    """One profiling run of one rank: start(), its steps, stop() (ModelRunner.start_profile / stop_profile, in the
    thread that runs the model: the torch profiler records the CPU ops of the thread it starts in). Rank r > 0 of a
    tensor-parallel engine names its trace aserve-rankR-PID.*."""

    def __init__(self, settings: ProfilerSettings, rank: int = 0) -> None:
        self.settings = settings
        self.name = f"aserve-rank{rank}-{os.getpid()}" if rank else f"aserve-{os.getpid()}"
        self._prof: torch.profiler.profile | None = None

    def start(self) -> None:
        s = self.settings
        if s.kind == "cuda":
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            return
        os.makedirs(s.directory, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(s.directory, self.name, use_gzip=s.use_gzip)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=s.record_shapes,
                                            profile_memory=s.with_memory, with_stack=s.with_stack,
                                            with_flops=s.with_flops, on_trace_ready=handler)  # fmt: skip
        self._prof.start()

    def stop(self) -> None:
        """Ends the run; the torch profiler writes its trace (and op table) before this returns."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self.settings.kind == "cuda":
            torch.cuda.profiler.stop()
            return
        prof, self._prof = self._prof, None
        prof.stop()
        if self.settings.dump_cuda_time_total:
            sort_by = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort_by, row_limit=50)
            with open(os.path.join(self.settings.directory, f"profiler_out_{os.getpid()}.txt"), "w") as f:
                f.write(table + "\n")
