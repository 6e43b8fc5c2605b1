"""FP8 experts (`quantization="fp8"` on a 16-bit mixture-of-experts checkpoint): the fused kernels over e4m3 experts
with row scales (Triton's interpreter on CPU) against the reference on the dequantised experts, the CPU engine equal
to transformers on the rounded checkpoint, e4m3 experts kept where FP8 runs, and the quantisations experts refuse."""

import pytest
import torch
from test_fp8 import LINEARS, rounded_copy
from test_moe import DEVICE, MOE_VARIANTS, prompts, random_moe
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.kernels import moe, reference
from aserve.layers.moe import FusedMoE
from aserve.layers.quantization import fp8_moe
from aserve.layers.quantization.fp8 import FP8, has_fp8_tensor_cores
from aserve.layers.quantization.fp8_config import Fp8Config
from aserve.layers.quantization.fp8_moe import dequantize_rows, quantize_rows

MIXTRAL_EXPERTS = ("w1", "w2", "w3")  # Mixtral's expert projections (Qwen3-MoE's are LINEARS' gate/up/down_proj)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=1e-2)}


def fp8_experts(w13, w2, dtype):
    """(e4m3 w13, its scales, e4m3 w2, its scales) and the same experts dequantised to `dtype`."""
    q13, s13 = quantize_rows(w13)
    q2, s2 = quantize_rows(w2)
    return (q13, s13, q2, s2), (dequantize_rows(q13, s13, dtype), dequantize_rows(q2, s2, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", [(1, 4, 2, 64, 32), (37, 8, 2, 48, 40)])
def test_fused_moe_over_fp8_experts_matches_the_dequantised_reference(dtype, tokens, experts, top_k, hidden, inter):
    """Both launch configurations (one token: the small tiles; 37 tokens at BLOCK_M 16), K not a multiple of the
    tile (48, 40: the masked loop)."""
    x, w13, w2, logits = random_moe(tokens, experts, hidden, inter, seed=tokens)
    x = x.to(dtype)
    (q13, s13, q2, s2), (d13, d2) = fp8_experts(w13, w2, dtype)
    ref = reference.fused_moe(x, d13, d2, *reference.select_experts(logits, top_k, True))
    out = moe.fused_moe(x, logits, q13, q2, top_k, True, None, s13, s2)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    unrounded = reference.fused_moe(x, w13.to(dtype), w2.to(dtype), *reference.select_experts(logits, top_k, True))
    assert (out - unrounded).abs().max() > 0  # the e4m3 rounding shows (the kernel did not read 16-bit experts)


def test_fp8_experts_stay_e4m3_where_fp8_runs(monkeypatch):
    """With FP8 support and a 16-bit model the block keeps e4m3 experts (half the bytes) and row scales, and runs
    the fused kernels on them."""
    monkeypatch.setattr(fp8_moe, "has_fp8_tensor_cores", lambda device: True)
    x, w13, w2, _ = random_moe(9, 8, 32, 16, seed=7)
    layer = FusedMoE(8, 2, 32, 16, renormalize=True, quant_config=Fp8Config()).to(DEVICE, torch.float16)
    with torch.no_grad():
        layer.w13.copy_(w13)
        layer.w2.copy_(w2)
        layer.gate.weight.copy_(torch.randn(8, 32, generator=torch.Generator().manual_seed(8)))
    layer.process_weights_after_loading()
    if DEVICE == "cpu":
        layer.use_triton()  # (a GPU picks it itself)
    assert layer.w13.dtype == layer.w2.dtype == FP8
    assert layer.w13_scale.shape == (8, 32) and layer.w2_scale.shape == (8, 32)
    _, (d13, d2) = fp8_experts(w13.half(), w2.half(), torch.float16)  # rounded from the 16-bit experts it loaded
    x = x.half()
    with torch.no_grad():
        out = layer(x)
        ref = reference.fused_moe(x, d13, d2, *reference.select_experts(layer.gate(x), 2, True))
    torch.testing.assert_close(out, ref, **TOL[torch.float16])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dequantised path is the CPU's")
@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_fp8_moe_on_cpu_equals_transformers_on_the_rounded_weights(tiny_model_factory, tmp_path, variant):
    """Every linear and every expert's projection rounded to e4m3 per output row (the router stays 16-bit, as in
    vLLM), with chunked prefill: the same greedy tokens as transformers on that rounded checkpoint."""
    path = tiny_model_factory(variant)
    ps = prompts(3, (5, 21, 40))
    rounded = rounded_copy(path, str(tmp_path / "rounded"), linears=LINEARS + MIXTRAL_EXPERTS)
    expected = hf_greedy(rounded, ps, 12)
    llm = LLM(path, dtype="float32", enforce_eager=True, quantization="fp8", max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected
    blocks = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    for w in [b.w13 for b in blocks] + [b.w2 for b in blocks]:  # dequantised e4m3: rounding again changes nothing
        assert w.dtype == torch.float32 and torch.equal(w, dequantize_rows(*quantize_rows(w), torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available() or not has_fp8_tensor_cores(torch.device("cuda")),
                    reason="needs FP8 support")  # fmt: skip
def test_fp8_moe_on_gpu_keeps_e4m3_experts_and_agrees_with_the_rounded_model(tiny_model_factory, tmp_path):
    path = tiny_model_factory("qwen3_moe")
    ps = [{"prompt_token_ids": p} for p in prompts(4, (5, 21, 40))]
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = LLM(rounded_copy(path, str(tmp_path / "rounded")), dtype="bfloat16", enforce_eager=True)
    want = [o.outputs[0].token_ids for o in ref.generate(ps, params)]
    del ref
    llm = LLM(path, dtype="bfloat16", enforce_eager=True, quantization="fp8")
    blocks = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert blocks and all(b.w13.dtype == b.w2.dtype == FP8 for b in blocks)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    # The dense linears quantise their activations too (per token): the first tokens agree, later ones may drift.
    assert [g[:2] for g in got] == [w[:2] for w in want]


def test_int8_experts_are_refused(tiny_model_factory):
    with pytest.raises(ValueError, match="int8 quantisation of mixture-of-experts layers is not supported"):
        LLM(tiny_model_factory("qwen3_moe"), dtype="float32", enforce_eager=True, quantization="int8")
