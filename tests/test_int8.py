"""INT8 weight-only layers quantised at load (`quantization="int8"`): the per-channel rounding, the kernels against
the pure-torch reference (the C kernel on CPU, both its AVX-512 and portable loops; the Triton kernels under
Triton's interpreter), and the model end to end: greedy tokens equal transformers' on the same rounded weights, and
the CPU one-token forward runs the int8 GEMV."""

import pytest
import torch
from test_cpu_decode import compare_every_step
from test_fp8 import PROMPTS, rounded_copy
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.kernels import cpu
from aserve.kernels.int8_reference import dequantize, int8_linear
from aserve.layers.linear import Linear
from aserve.layers.quantization import int8 as int8_method
from aserve.layers.quantization.int8 import Int8Config, quantize_per_channel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_c_kernels = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the CPU kernels")


def int8_rounding(t: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize_per_channel(t), t.dtype)


def int8_linear_layer(bias: bool, dtype: torch.dtype = torch.float32) -> Linear:
    """A 64 -> 48 Linear with random weights, quantised (process_weights_after_loading: the device's kernel)."""
    gen = torch.Generator().manual_seed(7)
    layer = Linear(64, 48, bias=bias, quant_config=Int8Config())
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(48, generator=gen))
    layer.to(dtype).process_weights_after_loading()
    return layer


def random_int8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) * 0.01


def test_per_channel_rounding():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64)[:, None]
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (64,) and q.abs().max() == 127
    assert torch.equal(q.abs().amax(dim=1), torch.full((64,), 127, dtype=torch.int8))  # each row's largest -> 127
    assert ((dequantize(q, scale, torch.float32) - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()


@needs_c_kernels
@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m, n, k", [(1, 960, 576), (3, 37, 1536), (6, 16, 16), (2, 7, 40), (9, 100, 4096), (2, 20, 14336)]
)
def test_cpu_kernel_matches_reference(m, n, k, dtype, generic):
    q, scale = random_int8(n, k, m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = cpu.gemm_int8(q, scale, x, generic)
    # float32 sums in another order: within float32 rounding of the sums (bf16: of the rounded outputs)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2**-7)
    torch.testing.assert_close(got, int8_linear(x, q, scale), **tol)
    x_strided = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(2)).to(dtype)[:, ::2]  # copied first
    torch.testing.assert_close(cpu.gemm_int8(q, scale, x_strided), int8_linear(x_strided, q, scale), **tol)


@needs_c_kernels
@pytest.mark.parametrize("native_16_bit_gemm", [True, False])
def test_cpu_linear_runs_the_kernel_for_few_rows_and_a_gemm_for_more(monkeypatch, native_16_bit_gemm):
    """More than CPU_KERNEL_MAX_ROWS rows: q widened to bf16 through oneDNN's GEMM where the CPU has a bf16 one, else
    float32 GEMMs over q's slices (linear.widens)."""
    monkeypatch.setattr(int8_method, "widens", lambda dtype: not native_16_bit_gemm)
    layer = int8_linear_layer(bias=True, dtype=torch.bfloat16)
    assert layer.weight.dtype == torch.int8 and layer.cpu_gemv and layer.kernel is int8_method._cpu
    assert layer.many_rows is (int8_method._widened if native_16_bit_gemm else int8_method._float32)
    for rows in (1, int8_method.CPU_KERNEL_MAX_ROWS, int8_method.CPU_KERNEL_MAX_ROWS + 3):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        want = int8_linear(x, layer.weight, layer.weight_scale, layer.bias)
        torch.testing.assert_close(layer(x), want, atol=2e-2, rtol=2**-6)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k", [(37, 256), (8, 64)])
def test_triton_gemv_matches_reference(n, k, bias):
    from aserve.kernels.int8 import int8_gemv

    q, scale = random_int8(n, k, n + k)
    x = torch.randn(1, k)
    b = torch.randn(n) if bias else None
    cfg = dict(BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=2)
    got = int8_gemv(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), None if b is None else b.to(DEVICE), cfg)
    torch.testing.assert_close(got.cpu(), int8_linear(x, q, scale, b), atol=1e-4, rtol=1e-4)


def test_triton_gemv_fused_silu_mul_matches_unfused():
    from aserve.kernels.fused import silu_and_mul
    from aserve.kernels.int8 import int8_gemv

    q, scale = random_int8(40, 128, 3)
    gate_up = torch.randn(1, 256).to(DEVICE)
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    cfg = dict(BLOCK_N=8, BLOCK_K=64, num_warps=4, num_stages=2)
    fused = int8_gemv(gate_up, q, scale, config=cfg, silu_mul=True)
    torch.testing.assert_close(fused, int8_gemv(silu_and_mul(gate_up), q, scale, config=cfg), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, config", [
    (5, 48, 96, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2)),  # K tail masked
    (37, 70, 64, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2)),  # M, N tails
])  # fmt: skip
def test_triton_matmul_matches_reference(m, n, k, config, dtype):
    from aserve.kernels.int8 import dequantized_matmul, int8_matmul

    q, scale = random_int8(n, k, m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(n).to(dtype)
    want = int8_linear(x, q, scale, bias)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-3)
    args = [t.to(DEVICE) for t in (x, q, scale, bias)]
    torch.testing.assert_close(int8_matmul(*args, config=config).cpu(), want, **tol)
    if dtype == torch.float32:  # the dequantised weights (q * scale) rounded once more: float32 only
        torch.testing.assert_close(dequantized_matmul(*args).cpu(), want, **tol)


def test_layer_on_the_triton_kernels_dispatches_by_rows(monkeypatch):
    from aserve.kernels import int8

    layer = int8_linear_layer(bias=True)
    layer.to(DEVICE).quant_method.use_triton(layer)
    monkeypatch.setattr(int8, "DEQUANT_MIN_ROWS", 8)
    calls = []
    for name in ("int8_gemv", "int8_matmul", "dequantized_matmul"):
        kernel = getattr(int8, name)
        monkeypatch.setattr(int8, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    for rows in (1, 3, 9):
        x = torch.randn(rows, 64, device=DEVICE)
        want = int8_linear(x, layer.weight, layer.weight_scale, layer.bias)
        torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)
    assert calls == ["int8_gemv", "int8_matmul", "dequantized_matmul"]
    assert layer.fuses_silu_mul_in(torch.empty(1, 96)) and not layer.fuses_silu_mul_in(torch.empty(2, 96))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the C kernel path is the CPU's")
def test_int8_on_cpu_equals_transformers_on_the_rounded_weights(tiny_model_factory, tmp_path):
    path = tiny_model_factory("qwen2")  # q/k/v biases
    expected = hf_greedy(rounded_copy(path, str(tmp_path / "rounded"), int8_rounding), PROMPTS, 16)
    llm = LLM(path, dtype="float32", enforce_eager=True, quantization="int8")
    model = llm.engine.core.runner.model
    assert all(layer.mlp.down_proj.weight.dtype == torch.int8 for layer in model.layers)
    assert model.lm_head.weight.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=16)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == expected


@needs_c_kernels
@pytest.mark.skipif(not cpu.gemv_supports(torch.empty(1, 32, dtype=torch.bfloat16)), reason="no AVX512-BF16")
def test_one_token_forward_runs_the_int8_kernel(tiny_model):
    llm = LLM(tiny_model, dtype="bfloat16", enforce_eager=True, device="cpu", quantization="int8")
    model = llm.engine.core.runner.model
    assert model.cpu_one_token is not None and model.cpu_one_token.gemv == model.cpu_one_token._gemv_int8
    diffs = compare_every_step(model)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [3, 50, 7, 99, 12] * 7}], params)
    assert len(diffs) == 9 and max(diffs) < 2**-5
