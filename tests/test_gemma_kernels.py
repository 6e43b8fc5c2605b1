"""Gemma's Triton kernels (aserve/kernels/gemma.py; Triton's interpreter on CPU) against the torch ops they replace
(aserve/models/gemma2.py GemmaTorchOps): exact in float32 up to float32 rounding, op by op in float16 (the
interpreter's bfloat16 arithmetic is not a GPU's), and a Gemma model on the Triton ops equal to transformers."""

import pytest
import torch
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.kernels import gemma
from aserve.models.gemma2 import GemmaTorchOps, GemmaTritonOps

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
REF = GemmaTorchOps()


def rand(*shape, dtype, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, n", [(1, 64), (5, 100), (3, 2048)])
def test_norms_match_torch(dtype, rows, n):
    """The plain norm, the post-norm + residual add, and that followed by the next pre-norm (n not a power of 2:
    masked lanes)."""
    h, x = rand(rows, n, dtype=dtype, seed=1, scale=3.0), rand(rows, n, dtype=dtype, seed=2)
    w_post, w_pre = rand(n, dtype=dtype, seed=3, scale=0.5), rand(n, dtype=dtype, seed=4, scale=0.5)
    torch.testing.assert_close(gemma.gemma_norm(x, w_pre, 1e-6), REF.norm(x, w_pre, 1e-6), **TOL[dtype])
    torch.testing.assert_close(gemma.gemma_add_norm(h, x, w_post, 1e-6), REF.add_norm(h, x, w_post, 1e-6),
                               **TOL[dtype])  # fmt: skip
    y, x_new = gemma.gemma_add_norm(h, x, w_post, 1e-6, w_pre)
    y_ref, x_ref = REF.add_norm(h, x, w_post, 1e-6, w_pre)
    torch.testing.assert_close(x_new, x_ref, **TOL[dtype])
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_norm_matches_torch_in_place(dtype):
    heads, kv_heads, d = 4, 2, 32
    qkv = rand(7, (heads + 2 * kv_heads) * d, dtype=dtype, seed=5, scale=2.0)
    qw, kw = rand(d, dtype=dtype, seed=6), rand(d, dtype=dtype, seed=7)
    want = REF.head_norm(qkv.clone(), qw, kw, 1e-6, heads, kv_heads, d)
    got = gemma.gemma_head_norm_(qkv, qw, kw, 1e-6, heads, kv_heads, d)
    assert got.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh_and_mul_matches_torch(dtype):
    gate_up = rand(6, 2 * 1500, dtype=dtype, seed=8, scale=3.0)  # two column blocks, the second masked
    torch.testing.assert_close(gemma.gelu_tanh_and_mul(gate_up), REF.gelu_and_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_gemma_on_the_triton_ops_equals_transformers(tiny_model_factory, monkeypatch, variant):
    """The model built with the GPU's Gemma ops (Triton's interpreter here), chunked prefill: greedy parity."""
    monkeypatch.setattr("aserve.models.gemma2.gemma_ops", lambda ops: GemmaTritonOps())
    monkeypatch.setattr("aserve.models.gemma3.gemma_ops", lambda ops: GemmaTritonOps())
    path = tiny_model_factory(variant)
    prompts = [[5, 17, 99, 3, 8, 21, 40, 2, 11, 13], [200, 201, 202, 10, 11]]
    llm = LLM(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=8)
    layer = llm.engine.core.runner.model.layers[0]
    assert isinstance(layer.gemma_ops, GemmaTritonOps)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 8)


def test_a_row_gets_the_same_bits_in_any_batch():
    """What deterministic mode relies on to keep these kernels on a GPU: one program per row (or element)."""
    h, x = rand(9, 200, dtype=torch.float32, seed=11, scale=3.0), rand(9, 200, dtype=torch.float32, seed=12)
    w_post, w_pre = rand(200, dtype=torch.float32, seed=13), rand(200, dtype=torch.float32, seed=14)
    full = gemma.gemma_add_norm(h, x, w_post, 1e-6, w_pre)
    gate_up = rand(9, 2 * 300, dtype=torch.float32, seed=15)
    act = gemma.gelu_tanh_and_mul(gate_up)
    for rows in (slice(8, 9), slice(3, 9), slice(0, 1)):
        y, x_new = gemma.gemma_add_norm(h[rows], x[rows], w_post, 1e-6, w_pre)
        assert torch.equal(y, full[0][rows]) and torch.equal(x_new, full[1][rows])
        assert torch.equal(gemma.gelu_tanh_and_mul(gate_up[rows]), act[rows])
