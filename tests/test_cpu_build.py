"""aserve/kernels/cpu_build.py: load_all() compiles once and later loads come from the cache (in this process and in a
fresh one: no compiler run but the -march=native probe); the cache is keyed on the CPU's target macros; once loaded,
aserve/kernels/cpu.py's checks read the extension it keeps without calling into the build code; without a working
compiler, or with ASERVE_CPU_KERNELS=0, the kernels are off with a warning and the engine's torch paths give
transformers' tokens."""

import os
import subprocess
import sys

import pytest
import torch
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.kernels import cpu, cpu_build

built = pytest.mark.skipif(cpu_build.load_all() is None, reason="no working C++ compiler")


def write_compiler(path, log, compiles: bool) -> str:
    """A CXX that logs its arguments and runs c++; unless `compiles`, compiling a source fails, and its -march=native
    probe adds a macro (a cache key no build in this process has used)."""
    fail = 'case "$*" in *-dM*) c++ "$@" && echo "#define __ASERVE_FAILING_CXX__ 1"; exit;; *" -c "*) exit 1;; esac'
    path.write_text(f'#!/bin/sh\necho "$@" >> {log}\n{"" if compiles else fail}\nexec c++ "$@"\n')
    path.chmod(0o755)
    return str(path)


@built
def test_load_all_then_kernels_run_without_compiling(monkeypatch):
    module = cpu_build.load_all()
    monkeypatch.setattr(cpu_build, "_compile", lambda *a: pytest.fail("compiled again"))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    assert cpu_build.load_all() is module  # from the cache (the same library, already loaded)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    gate_up = torch.randn(3, 128, generator=gen)
    out, res = cpu.add_rms_norm(x, None, torch.ones(64), 1e-6)
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert res is x
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    idx, bad = cpu.greedy_pick(x)
    assert torch.equal(idx, x.argmax(-1)) and not bad.any()
    # the build's directory is named after the key and keeps the target macros beside the library
    final = os.path.join(cpu_build.cache_dir(), module.__name__)
    assert os.path.exists(os.path.join(final, f"{module.__name__}.so"))
    with open(os.path.join(final, "target_macros.txt")) as f:
        assert f.read() == cpu_build.target_macros(os.environ.get("CXX", "c++"))


@built
def test_checks_read_the_loaded_extension(monkeypatch):
    """Once loaded, the kernels' availability checks (some run every step: the sampler's) read the extension cpu.py
    keeps and never call into the build code."""
    module = cpu.load()
    monkeypatch.setattr(cpu_build, "load_all", lambda: pytest.fail("called into the build code"))
    logits = torch.randn(2, 8)
    assert cpu.library() is module and cpu.available() and cpu.elementwise_supports(torch.bfloat16)
    assert cpu.sample_supports(logits) and torch.equal(cpu.greedy_pick(logits)[0], logits.argmax(-1))


@built
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_kernels_share_torchs_openmp_runtime():
    """-fopenmp links libgomp.so.1, which resolves to the one torch loaded: one OpenMP runtime, one thread pool."""
    cpu_build.load_all()
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


@built
def test_a_fresh_process_loads_the_cache_without_compiling(tmp_path):
    cpu_build.load_all()  # the cache is warm
    log = tmp_path / "cxx.log"
    env = {**os.environ, "CXX": write_compiler(tmp_path / "cxx", log, compiles=True)}
    code = "from aserve.kernels import cpu_build; assert cpu_build.load_all() is not None"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and "-dM" in calls[0]  # the target probe only


def test_target_macros_key_the_build(monkeypatch, tmp_path):
    """Two CPUs whose -march=native differs (here: the probe's answer, as on a machine without AVX-512 or AMX) get
    different builds."""
    monkeypatch.setenv("ASERVE_CACHE", str(tmp_path))
    names = []

    def fake_compile(name, csrc, macros, final_dir):
        names.append(name)
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(cpu_build, "_compile", fake_compile)
    for macros in ("#define __AVX512F__ 1\n#define __AMX_TILE__ 1\n", "#define __AVX2__ 1\n"):
        monkeypatch.setattr(cpu_build, "target_macros", lambda cxx, m=macros: m)
        with pytest.raises(RuntimeError):
            cpu_build.build()
    assert len(set(names)) == 2


@pytest.mark.parametrize("compiler", ["missing", "fails"])
def test_no_working_compiler_turns_the_kernels_off(compiler, monkeypatch, tmp_path, caplog):
    """The build fails for real (a compiler that is not there, or one that fails every compile) in an empty cache:
    a warning, nothing left in the cache, and every kernel reports itself unavailable."""
    log = tmp_path / "cxx.log"
    cxx = tmp_path / "no-such-c++" if compiler == "missing" else write_compiler(tmp_path / "cxx", log, False)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("ASERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu, "extension", cpu.NOT_LOADED)
    with caplog.at_level("WARNING", logger="aserve"):
        assert cpu_build.load_all() is None
    assert "unavailable" in caplog.text
    if compiler == "fails":  # the probe worked: the sources went to the compiler
        assert any(" -c " in line for line in log.read_text().splitlines())
    assert not any((tmp_path / "cache").rglob("*.so")) and not any((tmp_path / "cache").rglob("*.build-*"))
    assert not cpu.available() and not cpu.elementwise_supports(torch.float32)
    assert not cpu.attention_supports(torch.empty(2, 4, 16), torch.empty(8, 16, 2, 16))
    assert not cpu.gemv_supports(torch.empty(16, 32, dtype=torch.bfloat16))
    assert not cpu.sample_supports(torch.empty(2, 8))


def test_without_the_kernels_the_engine_runs_the_torch_paths(tiny_model, monkeypatch, tmp_path):
    """No compiler: the model's element-wise work, decode attention and greedy pick run in torch, and greedy tokens
    equal transformers'."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("ASERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu, "extension", cpu.NOT_LOADED)
    prompts = [[5, 17, 99, 3, 250], list(range(40, 73))]
    expected = hf_greedy(tiny_model, prompts, 12)
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, device="cpu")
    model = llm.engine.core.runner.model
    assert cpu_build.load_all() is None and model.ops.kind != "native" and model.cpu_one_token is None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_switched_off(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ASERVE_CPU_KERNELS", "0")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu, "extension", cpu.NOT_LOADED)
    with caplog.at_level("WARNING", logger="aserve"):
        assert cpu_build.load_all() is None and not cpu.available()
    assert not caplog.text  # off by request: no build tried, nothing to warn about


@built
def test_the_engine_builds_the_kernels_at_start(tiny_model, monkeypatch):
    """A CPU engine loads (or compiles) the kernels while it starts, so the first request never waits for a compile."""
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu, "extension", cpu.NOT_LOADED)
    calls = []
    real_build = cpu_build.build
    monkeypatch.setattr(cpu_build, "build", lambda *a, **kw: calls.append(1) or real_build(*a, **kw))
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, device="cpu")
    assert calls == [1] and cpu_build._loaded["module"] is not None
    assert cpu.extension is cpu_build._loaded["module"]  # what the kernels' checks read from then on
    llm.generate([{"prompt_token_ids": [5, 17, 99]}], SamplingParams(temperature=0, max_tokens=4))
    assert calls == [1]
