"""vLLM's profiler hooks (aserve/worker/profiler_hooks.py) as a vLLM user drives them: `LLM(profiler_config=...)` with
start_profile / stop_profile, `aserve serve --profiler-config` with POST /start_profile and /stop_profile driven by
`aserve bench serve --profile`, `aserve bench latency --profile`, and $VLLM_TORCH_PROFILER_DIR; each run leaves a
trace of the model's ops that Perfetto reads, and bad settings are refused naming what is wrong."""

import glob
import gzip
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch
from aserve_server import running_server

from aserve import LLM, SamplingParams


def trace_ops(directory) -> set[str]:
    """The op names of the one trace rank 0's profiler wrote to `directory`."""
    traces = glob.glob(f"{directory}/aserve-[0-9]*.pt.trace.json*")
    assert len(traces) == 1, traces
    opener = gzip.open if traces[0].endswith(".gz") else open
    with opener(traces[0], "rt") as f:
        return {event.get("name", "") for event in json.load(f)["traceEvents"]}


def test_llm_start_and_stop_profile_write_a_trace(tiny_model, tmp_path):
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces"), "torch_profiler_with_stack": False}
    llm = LLM(tiny_model, dtype=torch.float32, max_model_len=128, profiler_config=config)
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    out = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    llm.stop_profile()
    assert len(out[0].outputs[0].token_ids) == 4
    ops = trace_ops(tmp_path / "traces")
    assert {"aten::mm", "aten::addmm", "aten::linear"} & ops and "aten::embedding" in ops
    (table,) = glob.glob(f"{tmp_path}/traces/profiler_out_*.txt")
    assert "Self CPU" in open(table).read()
    # a second run writes a second trace
    llm.start_profile()
    llm.generate("Hi", SamplingParams(max_tokens=2))
    llm.stop_profile()
    assert len(glob.glob(f"{tmp_path}/traces/aserve-*.pt.trace.json*")) == 2


def test_every_tensor_parallel_rank_writes_its_trace(tiny_model, tmp_path):
    """Two ranks: rank 0's trace and the worker's (aserve-rank1-PID), each of the model's ops; a second start while
    one runs is refused on rank 0 and the worker keeps serving."""
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_with_stack": False}
    llm = LLM(tiny_model, dtype=torch.float32, max_model_len=128, enforce_eager=True, tensor_parallel_size=2,
              profiler_config=config)  # fmt: skip
    try:
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile()
        llm.generate("Hello", SamplingParams(max_tokens=3))
        llm.stop_profile()
        assert len(llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    finally:
        llm.engine.shutdown()
    worker = glob.glob(f"{tmp_path}/aserve-rank1-*.pt.trace.json*")
    assert len(worker) == 1 and len(glob.glob(f"{tmp_path}/aserve-*.pt.trace.json*")) == 2
    with gzip.open(worker[0], "rt") as f:
        assert "aten::embedding" in {event.get("name", "") for event in json.load(f)["traceEvents"]}
    assert len(glob.glob(f"{tmp_path}/profiler_out_*.txt")) == 2


def test_without_a_profiler_config_the_hooks_say_how_to_arm_them(tiny_model, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(tiny_model, dtype=torch.float32, max_model_len=128)
    with pytest.raises(RuntimeError, match="the profiler is off: .*--profiler-config"):
        llm.start_profile()


def test_vllm_torch_profiler_dir_arms_the_torch_profiler(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    llm = LLM(tiny_model, dtype=torch.float32, max_model_len=128)
    llm.start_profile()
    llm.generate("Hello", SamplingParams(max_tokens=2))
    llm.stop_profile()
    assert "aten::embedding" in trace_ops(tmp_path)


@pytest.mark.parametrize("config, message", [
    ({"profiler": "nvtx"}, 'profiler must be "torch" or "cuda"'),
    ({"profiler": "torch"}, "needs torch_profiler_dir"),
    ({"profiler": "torch", "torch_profiler_dir": "/tmp/p", "delay_iterations": 2}, "'delay_iterations' is not"),
    ({"profiler": "torch", "torch_profiler_dir": "/tmp/p", "torch_profiler_with_stack": "no"}, "true or false"),
    ({"torch_profiler_with_stack": False}, "name the profiler"),
    ({"profiler": "cuda"}, "needs a GPU"),
])  # fmt: skip
def test_bad_profiler_configs_are_refused(tiny_model, config, message):
    if torch.cuda.is_available() and config.get("profiler") == "cuda":
        pytest.skip("a GPU runs the cuda profiler")
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, dtype=torch.float32, max_model_len=128, profiler_config=config)


def post(url: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_bench_serve_profiles_a_server_started_with_a_profiler_config(tiny_model, tmp_path):
    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": False})
    with running_server("--model", tiny_model, "--enforce-eager", "--max-model-len", "256", "--profiler-config",
                        config) as url:  # fmt: skip
        assert post(f"{url}/stop_profile") == 400  # none running
        proc = subprocess.run(
            [sys.executable, "-m", "aserve", "bench", "serve", "--base-url", url, "--num-prompts", "2",
             "--random-input-len", "8", "--random-output-len", "4", "--ignore-eos", "--profile", "--disable-tqdm"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "Profiler started" in proc.stdout and "Profiler stopped" in proc.stdout
        assert "Successful requests:" in proc.stdout
    assert glob.glob(f"{tmp_path}/aserve-*.pt.trace.json")  # not gzipped, as asked
    assert "aten::embedding" in trace_ops(tmp_path)  # the model's ops, from the step thread


def test_a_server_without_a_profiler_has_no_profiler_routes(tiny_model):
    with running_server("--model", tiny_model, "--enforce-eager", "--max-model-len", "256") as url:
        assert post(f"{url}/start_profile") == 404
        proc = subprocess.run(
            [sys.executable, "-m", "aserve", "bench", "serve", "--base-url", url, "--num-prompts", "1",
             "--random-input-len", "8", "--random-output-len", "2", "--profile", "--disable-tqdm"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert proc.returncode != 0 and "start the server with --profiler-config" in proc.stderr


def test_bench_latency_profiles_one_iteration(tiny_model, tmp_path):
    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    proc = subprocess.run(
        [sys.executable, "-m", "aserve", "bench", "latency", "--model", tiny_model, "--enforce-eager", "--input-len",
         "8", "--output-len", "4", "--batch-size", "2", "--num-iters-warmup", "1", "--profile", "--profiler-config",
         config],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Profiling one iteration" in proc.stdout and "Avg latency" not in proc.stdout
    assert "aten::embedding" in trace_ops(tmp_path)
