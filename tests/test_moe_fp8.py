"""FP8 experts: the fused kernels over e4m3 experts with row scales (Triton's interpreter on CPU) against the
reference on the dequantised experts; `quantization="fp8"` on a 16-bit mixture-of-experts checkpoint (the CPU engine
equal to transformers on the rounded checkpoint, e4m3 experts kept where FP8 runs); pre-quantised FP8 checkpoints of
MoE models as tests/test_fp8_checkpoints.py writes them (per-tensor with static input scales, block-wise,
compressed-tensors per-channel; the CPU engine equal to transformers on the dequantised checkpoint); and the
quantisations experts refuse."""

import logging

import pytest
import test_fp8_checkpoints
import torch
from safetensors.torch import load_file
from test_fp8 import LINEARS, fp8_rounding, rounded_copy
from test_moe import DEVICE, MOE_VARIANTS, prompts, random_moe
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.kernels import fp8_gemv, moe, reference
from aserve.kernels.fp8_reference import dequantize, quantize_per_token
from aserve.layers.moe import FusedMoE
from aserve.layers.quantization import fp8_moe
from aserve.layers.quantization.fp8 import FP8, has_fp8_tensor_cores, quantize_per_channel
from aserve.layers.quantization.fp8_config import Fp8Config
from aserve.layers.quantization.fp8_moe import Fp8CheckpointMoEMethod

MIXTRAL_EXPERTS = ("w1", "w2", "w3")  # Mixtral's expert projections (Qwen3-MoE's are LINEARS' gate/up/down_proj)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=1e-2)}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def per_token_e4m3(rows: torch.Tensor) -> torch.Tensor:
    """Rows rounded to e4m3 with a scale each (the grouped GEMMs' activations over FP8 experts), as values."""
    q, scale = quantize_per_token(rows)
    return q.float() * scale


def fp8_experts(w13, w2, dtype):
    """(e4m3 w13, its scales, e4m3 w2, its scales) and the same experts dequantised to `dtype`."""
    q13, s13 = quantize_per_channel(w13)
    q2, s2 = quantize_per_channel(w2)
    return (q13, s13, q2, s2), (dequantize(q13, s13, dtype), dequantize(q2, s2, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", [(1, 4, 2, 64, 32), (37, 8, 2, 48, 40)])
def test_fused_moe_over_fp8_experts_matches_the_dequantised_reference(dtype, tokens, experts, top_k, hidden, inter,
                                                                      monkeypatch):  # fmt: skip
    """Every kernel path: one token through moe_decode's kernels and the grouped GEMMs' small tiles (16-bit
    activations; with the routing's launch and with the gate/up GEMM routing itself), 37 tokens at BLOCK_M 16
    (activations rounded to e4m3 per row: FP8 MMAs); K not a multiple of the tile (48, 40: the masked loop)."""
    x, w13, w2, logits = random_moe(tokens, experts, hidden, inter, seed=tokens)
    x = x.to(dtype)
    (q13, s13, q2, s2), (d13, d2) = fp8_experts(w13, w2, dtype)
    routing = reference.select_experts(logits, top_k, True)
    ref = reference.fused_moe(x, d13, d2, *routing)
    ref_fp8_activations = reference.fused_moe(x, d13, d2, *routing, round_activations=per_token_e4m3)
    for config in (None, moe.SMALL_CONFIG) if tokens == 1 else (None,):
        out = moe.fused_moe(x, logits, q13, q2, top_k, True, config, s13, s2)
        if tokens <= fp8_gemv.MAX_ROWS:
            torch.testing.assert_close(out, ref, **TOL[dtype])
        else:  # (16-bit: a product rounded the other way moves an activation by one e4m3 step)
            assert relative_error(out, ref_fp8_activations) < (1e-5 if dtype == torch.float32 else 1e-2)
        if config is not None:
            monkeypatch.setattr(moe, "FOLD_ROUTE_MAX_SLOTS", 16)
            assert torch.equal(moe.fused_moe(x, logits, q13, q2, top_k, True, config, s13, s2), out)
            monkeypatch.setattr(moe, "FOLD_ROUTE_MAX_SLOTS", 0)
    unrounded = reference.fused_moe(x, w13.to(dtype), w2.to(dtype), *reference.select_experts(logits, top_k, True))
    assert (out - unrounded).abs().max() > 0  # the e4m3 rounding shows (the kernel did not read 16-bit experts)


def test_fp8_experts_stay_e4m3_where_fp8_runs(monkeypatch):
    """With FP8 support and a 16-bit model the block keeps e4m3 experts (half the bytes) and row scales, and runs
    the fused kernels on them (21 tokens: past fp8_gemv.MAX_ROWS, the activations rounded to e4m3 too)."""
    monkeypatch.setattr(fp8_moe, "has_fp8_tensor_cores", lambda device: True)
    x, w13, w2, _ = random_moe(21, 8, 32, 16, seed=7)
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
        routing = reference.select_experts(layer.gate(x), 2, True)
        ref = reference.fused_moe(x, d13, d2, *routing, round_activations=per_token_e4m3)
    assert relative_error(out, ref) < 1e-2


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
        assert w.dtype == torch.float32 and torch.equal(w, dequantize(*quantize_per_channel(w), torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available() or not has_fp8_tensor_cores(torch.device("cuda")),
                    reason="needs FP8 support")  # fmt: skip
def test_fp8_moe_on_gpu_keeps_e4m3_experts_and_agrees_with_the_rounded_model(tiny_model_factory, tmp_path):
    """Steps of at most 16 tokens keep the dense linears on their weight-only kernels too (more rows quantise the
    activations per token), so the model computes what the rounded checkpoint says, up to bf16 roundings: the
    first-token logprobs agree closely, and the greedy tokens where no near-tie decides them."""
    path = tiny_model_factory("qwen3_moe")
    ps = [{"prompt_token_ids": p} for p in prompts(4, (5, 9, 14))]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    engine = dict(dtype="bfloat16", enforce_eager=True, max_num_batched_tokens=16, max_num_seqs=1)
    # rounded from the bf16 weights the engine loads and quantises (not from the float32 checkpoint's)
    ref = LLM(rounded_copy(path, str(tmp_path / "rounded"), rounding=lambda w: fp8_rounding(w.bfloat16())), **engine)
    want = ref.generate(ps, params)
    del ref
    llm = LLM(path, quantization="fp8", **engine)
    blocks = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert blocks and all(b.w13.dtype == b.w2.dtype == FP8 for b in blocks)
    for g, w in zip(llm.generate(ps, params), want):
        g_lp, w_lp = g.outputs[0].logprobs[0], w.outputs[0].logprobs[0]
        common = set(g_lp) & set(w_lp)
        assert len(common) >= 3
        assert max(abs(g_lp[t].logprob - w_lp[t].logprob) for t in common) < 0.1


@pytest.mark.parametrize("variant, layout", [("qwen3_moe", "fp8-block"), ("qwen3_moe", "ct-channel"),
                                             ("mixtral", "fp8-static")])  # fmt: skip
def test_fp8_moe_checkpoint_matches_transformers_on_dequantized_weights(tiny_model_factory, tmp_path, monkeypatch,
                                                                        caplog, variant, layout):  # fmt: skip
    """The experts' gate and up projections carry different per-tensor scales (the writer scales up_proj up), so
    the fused w13 rows keep each part's own; with chunked prefill."""
    monkeypatch.setattr(test_fp8_checkpoints, "LINEARS", LINEARS + MIXTRAL_EXPERTS)
    monkeypatch.setattr(fp8_moe, "_logged", set())  # (each reason is logged once per process)
    fp8_dir, deq_dir = test_fp8_checkpoints.fp8_checkpoint(tiny_model_factory(variant), str(tmp_path / "fp8"), layout)
    with caplog.at_level(logging.INFO, logger="aserve"):
        llm = LLM(fp8_dir, dtype="float32", enforce_eager=True, max_num_batched_tokens=16)
    blocks = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert blocks and all(type(b.quant_method) is Fp8CheckpointMoEMethod for b in blocks)
    assert blocks[0].w13.dtype == torch.float32  # dequantised on this CPU (one log line says so)
    assert [r for r in caplog.records if "experts dequantised" in r.message]
    ps = prompts(5, (5, 21, 40))
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(deq_dir, ps, 12)


def test_fp8_checkpoint_experts_stay_e4m3_with_each_parts_scales(tiny_model_factory, tmp_path, monkeypatch):
    """Per-tensor scales where FP8 runs: the e4m3 experts as stored, one scale per row taken from its part's
    tensor (gate rows and up rows differ), and the block's output equal to the dequantised reference."""
    monkeypatch.setattr(fp8_moe, "has_fp8_tensor_cores", lambda device: True)
    fp8_dir, deq_dir = test_fp8_checkpoints.fp8_checkpoint(tiny_model_factory("qwen3_moe"), str(tmp_path / "fp8"),
                                                           "fp8-tensor")  # fmt: skip
    llm = LLM(fp8_dir, dtype="float16", enforce_eager=True)
    block = llm.engine.core.runner.model.layers[0].mlp
    assert block.w13.dtype == block.w2.dtype == FP8
    inter = block.intermediate_size
    gate, up = block.w13_scale[0, :inter], block.w13_scale[0, inter:]
    assert (gate == gate[0]).all() and (up == up[0]).all() and not torch.equal(gate[0], up[0])
    deq = load_file(f"{deq_dir}/model.safetensors", device=str(block.w13.device))
    w13 = torch.cat([deq[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] for e in range(block.num_experts)
                     for p in ("gate", "up")]).view(block.num_experts, 2 * inter, -1)  # fmt: skip
    torch.testing.assert_close(dequantize(block.w13.data, block.w13_scale, torch.float32), w13)
    block.use_triton()  # (the GPU's kernel, Triton's interpreter here)
    x = torch.randn(5, w13.shape[-1], generator=torch.Generator().manual_seed(1)).half().to(w13.device)
    w2 = torch.stack([deq[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(block.num_experts)])
    with torch.no_grad():
        logits = block.gate(x)
        routing = reference.select_experts(logits, block.top_k, False)
        ref = reference.fused_moe(x.float(), w13, w2, *routing)  # float32; the kernel rounds to float16 as it goes
        err = (block(x).float() - ref).abs().max() / ref.abs().max()
    assert err < 1e-2, err


def test_random_weights_for_an_fp8_moe_checkpoint(tiny_model_factory, tmp_path):
    """`--load-format dummy` (benchmarks at a real FP8 checkpoint's shapes): e4m3 experts and scales are made up,
    and the model generates."""
    fp8_dir, _ = test_fp8_checkpoints.fp8_checkpoint(tiny_model_factory("qwen3_moe"), str(tmp_path / "fp8"),
                                                     "fp8-block")  # fmt: skip
    llm = LLM(fp8_dir, dtype="float32", enforce_eager=True, load_format="dummy")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    block = llm.engine.core.runner.model.layers[0].mlp
    assert block.w13.abs().max() > 0 and torch.isfinite(block.w13).all()


def test_int8_experts_are_refused(tiny_model_factory):
    with pytest.raises(ValueError, match="int8 quantisation of mixture-of-experts layers is not supported"):
        LLM(tiny_model_factory("qwen3_moe"), dtype="float32", enforce_eager=True, quantization="int8")
