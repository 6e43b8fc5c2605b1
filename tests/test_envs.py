"""aserve/envs.py: every switch's default and parsing, and that turning one off changes the path it controls."""

import os
import subprocess
import sys

import pytest
import torch

from aserve import LLM, envs
from aserve.kernels import cpu, cpu_build
from aserve.layers.linear import Linear
from aserve.models import model_path
from aserve.worker import host_memory

SWITCHES = ["ASERVE_CPU_KERNELS", "ASERVE_CPU_AMX", "ASERVE_CPU_MV", "ASERVE_CPU_ONE_TOKEN", "ASERVE_CPU_MALLOC",
            "ASERVE_GEMV", "ASERVE_PDL", "ASERVE_PIECEWISE_GRAPHS"]  # fmt: skip
HAS_C_GEMV = cpu.gemv_supports(torch.empty(1, 32, dtype=torch.bfloat16))


@pytest.fixture
def clean_env(monkeypatch):
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_every_variable_is_listed_and_documented():
    others = ["ASERVE_CACHE", "HF_HUB_CACHE", "CXX", "ASERVE_STREAM_BUFFER", "ASERVE_STREAM_STALL_TIMEOUT",
              "VLLM_SERVER_DEV_MODE", "VLLM_TORCH_PROFILER_DIR"]  # fmt: skip
    assert sorted(dir(envs)) == sorted(SWITCHES + others)
    for name in envs.environment_variables:
        assert f"    {name} " in envs.__doc__, name
    with pytest.raises(AttributeError):
        envs.ASERVE_NO_SUCH_SWITCH  # noqa: B018


def test_defaults(clean_env):
    assert all(getattr(envs, name) is True for name in SWITCHES)
    assert envs.CXX == "c++"
    assert envs.ASERVE_STREAM_BUFFER == 4 << 20
    assert envs.ASERVE_STREAM_STALL_TIMEOUT == 60.0
    assert envs.ASERVE_CACHE == os.path.join(os.path.expanduser("~"), ".cache", "aserve")
    assert envs.VLLM_SERVER_DEV_MODE is False and envs.VLLM_TORCH_PROFILER_DIR == ""


def test_vllm_dev_mode_is_on_for_any_value_but_0(clean_env):
    for value, on in (("0", False), ("", False), ("1", True), ("true", True)):
        clean_env.setenv("VLLM_SERVER_DEV_MODE", value)
        assert envs.VLLM_SERVER_DEV_MODE is on, value


@pytest.mark.parametrize("name", SWITCHES)
def test_switches_turn_off_at_zero_only(clean_env, name):
    for value, on in (("0", False), ("1", True), ("", True), ("yes", True)):
        clean_env.setenv(name, value)
        assert getattr(envs, name) is on, (name, value)


def test_amx_reads_like_the_c_source(clean_env):
    clean_env.setenv("ASERVE_CPU_AMX", "00")  # getenv: off when the value starts with 0
    assert envs.ASERVE_CPU_AMX is False


def test_hugging_face_cache_as_huggingface_hub_finds_it(clean_env, tmp_path):
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        clean_env.delenv(name, raising=False)
    assert envs.HF_HUB_CACHE == os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")
    clean_env.setenv("HF_HOME", str(tmp_path))
    assert envs.HF_HUB_CACHE == str(tmp_path / "hub")
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert envs.HF_HUB_CACHE == str(tmp_path / "elsewhere")


def test_paths_and_compiler(clean_env, tmp_path):
    clean_env.setenv("ASERVE_CACHE", str(tmp_path))
    clean_env.setenv("CXX", "clang++")
    assert envs.ASERVE_CACHE == str(tmp_path) and envs.CXX == "clang++"


# -- each switch changes its path ---------------------------------------------------------------------------------


def test_cache_holds_converted_gguf(clean_env, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    clean_env.setenv("ASERVE_CACHE", str(tmp_path / "cache"))
    assert model_path.gguf_cache_dir(str(gguf)).startswith(str(tmp_path / "cache" / "gguf"))


def test_cpu_kernels_off_means_no_library(clean_env):
    clean_env.setattr(cpu_build, "_loaded", {})
    clean_env.setattr(cpu, "extension", cpu.NOT_LOADED)
    clean_env.setenv("ASERVE_CPU_KERNELS", "0")
    assert not cpu.available()
    # (CXX: tests/test_cpu_build.py builds with a compiler that fails and gets the torch fallback)


@pytest.mark.skipif(not HAS_C_GEMV, reason="no compiler or no AVX512-BF16")
@pytest.mark.parametrize("on", [True, False])
def test_cpu_mv_routes_one_row_inputs(clean_env, on):
    if not on:
        clean_env.setenv("ASERVE_CPU_MV", "0")
    calls = []
    gemv = cpu.gemv
    clean_env.setattr(cpu, "gemv", lambda w, x: calls.append(1) or gemv(w, x))
    lin = Linear(64, 48, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_()
    lin.process_weights_after_loading()
    with torch.inference_mode():
        lin(torch.randn(1, 64, dtype=torch.bfloat16))
    assert calls == ([1] if on else [])


@pytest.mark.skipif(not HAS_C_GEMV, reason="no compiler or no AVX512-BF16")
@pytest.mark.parametrize("on", [True, False])
def test_cpu_one_token_path(clean_env, tiny_model, on):
    if not on:
        clean_env.setenv("ASERVE_CPU_ONE_TOKEN", "0")
    model = LLM(tiny_model, dtype="bfloat16", enforce_eager=True, device="cpu").engine.core.runner.model
    assert (model.cpu_one_token is not None) == on


def test_cpu_malloc_off_leaves_glibc_defaults(clean_env):
    clean_env.setattr(host_memory, "_applied", False)
    clean_env.setenv("ASERVE_CPU_MALLOC", "0")
    assert host_memory.retain_freed_memory() is False


@pytest.mark.skipif(not (cpu.available() and "amx_bf16" in open("/proc/cpuinfo").read()),
                    reason="no compiler or no AMX")  # fmt: skip
def test_cpu_amx_off_keeps_the_decode_kernel_off_tiles():
    """The bf16 decode kernel asks Linux for the AMX tile state before its tile path runs; with ASERVE_CPU_AMX=0 it
    never does (each case in a fresh process that runs nothing else on AMX: the C source reads the switch once)."""
    script = (
        "import ctypes, torch\n"
        "from aserve.kernels import cpu\n"
        "assert cpu.load() is not None\n"
        "q = torch.randn(2, 8, 64).to(torch.bfloat16)\n"
        "cache = torch.randn(2, 4, 16, 2, 64).to(torch.bfloat16)\n"
        "tables, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 31], dtype=torch.int32)\n"
        "cpu.paged_decode_attention(q, cache[0], cache[1], tables, lens, torch.empty_like(q))\n"
        "mask = ctypes.c_uint64(0)\n"
        "ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask))  # arch_prctl(ARCH_GET_XCOMP_PERM)\n"
        "print(mask.value >> 18 & 1)  # XFEATURE_XTILEDATA\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    granted = {}
    for amx in ("1", "0"):
        env = {**os.environ, "ASERVE_CPU_AMX": amx}
        run = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        granted[amx] = run.stdout.strip()
    assert granted == {"1": "1", "0": "0"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton GEMV and PDL run on GPUs")
@pytest.mark.parametrize("on", [True, False])
def test_gemv_and_pdl_switches(clean_env, tiny_model, on):
    from aserve.kernels import pdl

    if not on:
        clean_env.setenv("ASERVE_GEMV", "0")
        clean_env.setenv("ASERVE_PDL", "0")
    model = LLM(tiny_model, dtype="bfloat16", enforce_eager=True).engine.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert any(m.gemv_config is not None for m in linears) == on
    assert pdl.ENABLED == (on and torch.cuda.get_device_capability()[0] >= 9)
