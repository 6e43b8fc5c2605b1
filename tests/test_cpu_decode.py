"""The CPU one-token forward (aserve/models/cpu_one_token.py) against the module forward it replaces, inside the engine:
every batch-1 decode step computed both ways on the same cache (both write the same K/V to the same slot)."""

import pytest
import torch
from torch import nn

from aserve import LLM, SamplingParams
from aserve.kernels import cpu
from aserve.layers.attention.backend import FP8
from aserve.layers.linear import Linear
from aserve.models.cpu_one_token import OneTokenForward

needs_c_gemv = pytest.mark.skipif(
    not cpu.gemv_supports(torch.empty(1, 32, dtype=torch.bfloat16)), reason="no compiler or no AVX512-BF16"
)
PROMPT = [3, 50, 7, 99, 12] * 7


def compare_every_step(model) -> list[float]:
    """Makes every one-token step of `model` run both paths (the one-token forward's result is kept) and record their
    largest relative difference."""
    fast = model.cpu_one_token
    diffs = []

    def both(x, cos, sin, kv_caches, meta, num_layers):
        got = fast(x, cos, sin, kv_caches, meta, num_layers).clone()
        model.cpu_one_token = None
        try:
            residual = None
            h = x
            for i, layer in enumerate(model.layers[:num_layers]):
                h, residual = layer((cos, sin), h, residual, kv_caches[i], meta)
            expected = h + residual
        finally:
            model.cpu_one_token = both
        # The same kernels in the same order, except SiLU·mul (C here, eager torch there): equal up to the odd
        # bf16 rounding step.
        diffs.append(((got.float() - expected.float()).abs() / (expected.float().abs() + 1e-2)).max().item())
        return got

    model.cpu_one_token = both
    return diffs


@needs_c_gemv
def test_one_token_forward_matches_module_forward(tiny_model):
    llm = LLM(tiny_model, dtype="bfloat16", enforce_eager=True, device="cpu")
    model = llm.engine.core.runner.model
    assert isinstance(model.cpu_one_token, OneTokenForward)
    diffs = compare_every_step(model)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT}], params)
    assert len(diffs) == 9 and max(diffs) < 2**-5


@needs_c_gemv
def test_one_token_forward_matches_module_forward_over_an_fp8_cache(tiny_model):
    """--kv-cache-dtype fp8: the one-token forward quantises k / v into the slot (the bytes the module forward's
    cache write then writes again) and attends over the e4m3 pages; the same tokens as with it turned off."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(tiny_model, dtype="bfloat16", enforce_eager=True, device="cpu", kv_cache_dtype="fp8")
    model = llm.engine.core.runner.model
    assert isinstance(model.cpu_one_token, OneTokenForward) and llm.engine.core.runner.kv_caches.dtype == FP8
    diffs = compare_every_step(model)
    got = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    assert len(diffs) == 9 and max(diffs) < 2**-5
    model.cpu_one_token = None
    llm.engine.reset_prefix_cache()
    assert llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids == got


@needs_c_gemv
def test_one_token_forward_follows_weights_replaced_after_build(tiny_model):
    """New weight tensors (new addresses) in a layer's norm and linears after the engine is built: the one-token
    forward, built before, reads them as the module forward does. The old tensors stay alive, so a path that kept
    their addresses would read the old weights (not garbage) and differ by far more than the tolerance."""
    llm = LLM(tiny_model, dtype="bfloat16", enforce_eager=True, device="cpu")
    model = llm.engine.core.runner.model
    fast = model.cpu_one_token
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    before = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    layer = model.layers[1]
    old = []
    for module, scale in ((layer.input_layernorm, 1.5), (layer.self_attn.qkv_proj, 2.0), (layer.mlp.down_proj, -3.0)):
        old.append(module.weight)
        module.weight = nn.Parameter(module.weight.detach() * scale, requires_grad=False)
        if isinstance(module, Linear):
            module.process_weights_after_loading()  # the module forward's own prepacked copy follows
    assert model.cpu_one_token is fast and all(w.data_ptr() != m.weight.data_ptr() for w, m in zip(old, (
        layer.input_layernorm, layer.self_attn.qkv_proj, layer.mlp.down_proj)))  # fmt: skip
    llm.engine.reset_prefix_cache()
    diffs = compare_every_step(model)
    after = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids
    assert len(diffs) == 9 and max(diffs) < 2**-5
    assert after != before  # the new weights changed the model


def test_not_built_for_float32(tiny_model):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, device="cpu")
    assert llm.engine.core.runner.model.cpu_one_token is None
