"""The CPU one-token forward (aserve/models/cpu_one_token.py) against the module forward it replaces, inside the engine:
every batch-1 decode step computed both ways on the same cache (both write the same K/V to the same slot)."""

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.kernels import cpu_gemv
from aserve.models.cpu_one_token import OneTokenForward


@pytest.mark.skipif(
    not cpu_gemv.supports(torch.empty(1, 32, dtype=torch.bfloat16)), reason="no compiler or no AVX512-BF16"
)
def test_one_token_forward_matches_module_forward(tiny_model):
    llm = LLM(tiny_model, dtype="bfloat16", enforce_eager=True)
    model = llm.engine.runner.model
    fast = model.cpu_one_token
    assert isinstance(fast, OneTokenForward)
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
            model.cpu_one_token = wrapper
        # The same kernels in the same order, except SiLU·mul (C here, eager torch there): equal up to the odd
        # bf16 rounding step.
        diffs.append(((got.float() - expected.float()).abs() / (expected.float().abs() + 1e-2)).max().item())
        return got

    wrapper = model.cpu_one_token = both
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [3, 50, 7, 99, 12] * 7}], params)
    assert len(diffs) == 9 and max(diffs) < 2**-5


def test_not_built_for_float32(tiny_model):
    assert LLM(tiny_model, dtype="float32", enforce_eager=True).engine.runner.model.cpu_one_token is None
