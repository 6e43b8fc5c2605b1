"""AWQ and GPTQ int4 experts of mixture-of-experts models (aserve/layers/quantization/int4_moe.py): the block's
loading path alone (every projection's int4 tensors converted as they come, then dequantised into the 16-bit stacks
as a CPU holds them; missing and misshapen tensors named as the checkpoint names them), and end to end, aserve's
greedy tokens on tiny Mixtral and Qwen3-MoE checkpoints whose experts and linears are int4 equal transformers' on the
float checkpoint of the weights they dequantise to, with chunked prefill. The checkpoints come from the independent
writers of tests/test_awq_model.py (AutoAWQ's) and tests/test_gptq.py (AutoGPTQ's), the Mixtral expert projections
w1 / w3 / w2 added to the linears they quantise."""

import logging
import os

import pytest
import test_awq_model
import test_gptq
import torch
from safetensors.torch import load_file, save_file
from test_awq_model import autoawq_checkpoint, dequantized_checkpoint
from test_moe import prompts
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.kernels import reference
from aserve.kernels.awq_reference import dequantize
from aserve.layers.moe import FusedMoE, UnquantizedMoEMethod
from aserve.layers.quantization import gptq_format, int4_moe
from aserve.layers.quantization.awq import AWQConfig
from aserve.layers.quantization.awq_format import pack_linear
from aserve.layers.quantization.gptq import GPTQConfig
from aserve.layers.quantization.int4_moe import Int4MoEMethod

MIXTRAL_EXPERTS = ("w1", "w3", "w2")  # gate, up, down
NAMES = tuple(f"model.layers.0.mlp.experts.0.{p}_proj" for p in ("gate", "up", "down"))
PROJECTIONS = (("w13", 0), ("w13", 1), ("w2", None))


@pytest.fixture
def with_mixtral_experts(monkeypatch):
    """The test writers quantise Mixtral's expert projections too (GPTQ act order: w1 / w3 read the block's input,
    w2 the expert's inner activations)."""
    monkeypatch.setattr(test_awq_model, "LINEARS", test_awq_model.LINEARS + MIXTRAL_EXPERTS)
    monkeypatch.setattr(test_gptq, "LINEARS", test_awq_model.LINEARS + MIXTRAL_EXPERTS)
    monkeypatch.setattr(test_gptq, "_INPUT_OF", {**test_gptq._INPUT_OF, "w1": "mlp", "w3": "mlp", "w2": "down"})
    monkeypatch.setattr(int4_moe, "_logged", set())  # (the log line comes once per process)


def greedy(path: str, ps: list[list[int]], max_tokens: int = 12, **engine_args) -> tuple[LLM, list[list[int]]]:
    llm = LLM(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=16, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=max_tokens))
    return llm, [o.outputs[0].token_ids for o in outs]


def moe_blocks(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]


def gptq_tensors(w: torch.Tensor, group_size: int, act_order: bool, gen: torch.Generator) -> dict:
    """W [out, in] -> GPTQ v1 tensors (aserve's packer) of its round-to-nearest grid (group_size -1: one group);
    with act order the groups are scattered over the inputs."""
    k = w.shape[1]
    group_size = k if group_size == -1 else group_size
    g_idx = (torch.randperm(k, generator=gen) if act_order else torch.arange(k)) // group_size
    q, z, s = test_gptq.quantize_linear(w, group_size, sym=False, g_idx=g_idx)
    return gptq_format.pack(q.t(), z.t(), s.t(), g_idx, version=1)


@pytest.mark.parametrize("fmt, act_order, group", [("awq", False, 16), ("gptq", False, -1), ("gptq", True, 16)])
def test_int4_expert_tensors_are_dequantized_into_the_stacks(fmt, act_order, group):
    """The loading path alone: each projection's tensors in any order, converted once its last one is in (act
    order: dequantised then), the stacks dequantised on this CPU; the block then computes what the reference computes
    on those values, on the CPU's kernel and the 16-bit experts' GPU kernel (Triton's interpreter here). Packed
    experts: tests/test_moe_int4_kernels.py."""
    experts, hidden, inter = 4, 64, 48
    gen = torch.Generator().manual_seed(3)
    config = AWQConfig(group_size=group) if fmt == "awq" else GPTQConfig(group_size=group, desc_act=act_order)
    layer = FusedMoE(experts, 2, hidden, inter, renormalize=True, quant_config=config, expert_names=NAMES)
    assert type(layer.quant_method) is Int4MoEMethod
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / 8
    w2 = torch.randn(experts, hidden, inter, generator=gen) / 8
    want13, want2 = torch.empty_like(w13), torch.empty_like(w2)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.randn(experts, hidden, generator=gen))
    for e in range(experts):
        for param_name, shard in PROJECTIONS:
            rows = slice(None) if shard is None else slice(shard * inter, (shard + 1) * inter)
            w = (w13 if param_name == "w13" else w2)[e, rows]
            packed = pack_linear(w, group) if fmt == "awq" else gptq_tensors(w, group, act_order, gen)
            want = (dequantize(packed["qweight"], packed["qzeros"], packed["scales"], group).t() if fmt == "awq"
                    else gptq_format.dequantize(*packed.values(), version=1))  # fmt: skip
            (want13 if param_name == "w13" else want2)[e, rows] = want
            done = [layer.load_expert_packed(param_name, e, shard, part, t) for part, t in reversed(packed.items())]
            assert done == [False] * (len(packed) - 1) + [True]
    assert layer.quant_method.missing_tensors(layer) == []
    layer.process_weights_after_loading()
    assert torch.equal(layer.w13, want13) and torch.equal(layer.w2, want2)
    x = torch.randn(9, hidden, generator=gen)
    with torch.no_grad():
        ref = reference.fused_moe(x, want13, want2, *reference.select_experts(layer.gate(x), 2, True))
        torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-5)
        if not torch.cuda.is_available():  # CPU tensors reach Triton only through its interpreter
            layer.use_triton()
            torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-4)


def test_missing_and_misshapen_int4_expert_tensors_are_named():
    layer = FusedMoE(2, 2, 32, 16, renormalize=True, quant_config=AWQConfig(group_size=16), expert_names=NAMES)
    packed = pack_linear(torch.randn(16, 32), 16)
    layer.load_expert_packed("w13", 1, 1, "qweight", packed["qweight"])
    missing = layer.quant_method.missing_tensors(layer)
    assert "model.layers.0.mlp.experts.1.up_proj.qzeros" in missing
    assert "model.layers.0.mlp.experts.1.up_proj.qweight" not in missing
    assert "model.layers.0.mlp.experts.0.down_proj.scales" in missing and len(missing) == 2 * 3 * 3 - 1
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.qweight: checkpoint shape \(32, 2\) != \(16, 4\)"):
        for part, t in pack_linear(torch.randn(16, 32), 16).items():  # a [16, 32] down_proj where [32, 16] goes
            layer.load_expert_packed("w2", 1, None, part, t)
    with pytest.raises(ValueError, match="int4 tensors .qweight. for expert 0, whose weights its quantization_con"):
        FusedMoE(2, 2, 32, 16, renormalize=True).load_expert_packed("w2", 0, None, "qweight", packed["qweight"])


def test_config_choices_for_experts():
    """modules_to_not_convert naming the experts keeps them 16-bit; 8-bit GPTQ experts are refused."""
    assert type(AWQConfig(modules_to_not_convert=("experts",)).get_moe_method(NAMES)) is UnquantizedMoEMethod
    with pytest.raises(ValueError, match="modules_to_not_convert splits an expert's projections"):
        AWQConfig(modules_to_not_convert=("down_proj",)).get_moe_method(NAMES)
    with pytest.raises(ValueError, match="GPTQ checkpoint with 8-bit experts: not supported"):
        FusedMoE(4, 2, 32, 16, renormalize=True, quant_config=GPTQConfig(bits=8, group_size=-1), expert_names=NAMES)


def test_a_missing_int4_expert_tensor_is_reported_by_name(tiny_model_factory, tmp_path, with_mixtral_experts):
    awq_dir = autoawq_checkpoint(tiny_model_factory("mixtral"), str(tmp_path / "awq"), 16)
    path = os.path.join(awq_dir, "model.safetensors")
    state = load_file(path)
    del state["model.layers.2.block_sparse_moe.experts.3.w3.qzeros"]
    save_file(state, path)
    with pytest.raises(ValueError, match=r"lacks tensors of experts: \['model.layers.2.block_sparse_moe.experts.3."
                                         r"w3.qzeros'\]"):  # fmt: skip
        LLM(awq_dir, dtype="float32", enforce_eager=True)


@pytest.mark.parametrize("variant", ["mixtral", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_awq_moe_checkpoint_matches_transformers_on_dequantized_weights(tiny_model_factory, tmp_path, caplog,
                                                                        with_mixtral_experts, variant):  # fmt: skip
    """Experts, attention and (Qwen3-MoE's dense layer) MLP linears AWQ int4 in groups of 16, the router 16-bit."""
    skip = ("gate",) if variant == "mixtral" else ()  # AutoAWQ's Mixtral: the router (block_sparse_moe.gate)
    awq_dir = autoawq_checkpoint(tiny_model_factory(variant), str(tmp_path / "awq"), 16, skip=skip)
    router = "block_sparse_moe.gate" if variant == "mixtral" else "mlp.gate"
    assert f"model.layers.0.{router}.weight" in load_file(os.path.join(awq_dir, "model.safetensors"))
    ps = prompts(4, (5, 21, 40))
    expected = hf_greedy(dequantized_checkpoint(awq_dir, str(tmp_path / "deq")), ps, 12)
    with caplog.at_level(logging.INFO, logger="aserve"):
        llm, got = greedy(awq_dir, ps, quantization="awq")
    assert got == expected
    blocks = moe_blocks(llm)
    assert blocks and all(type(b.quant_method) is Int4MoEMethod for b in blocks)
    # Groups of 16: dequantised at load on every device (packed experts: tests/test_moe_int4_kernels.py)
    assert blocks[0].w13.dtype == torch.float32
    assert len([r for r in caplog.records if "int4 experts dequantised to float32 at load" in r.message]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("variant, desc_act", [("qwen3_moe", False), ("mixtral", True)])
def test_gptq_moe_checkpoint_matches_transformers_on_dequantized_weights(tiny_model_factory, tmp_path,
                                                                         with_mixtral_experts, variant,
                                                                         desc_act):  # fmt: skip
    gptq_dir, deq_dir = test_gptq.gptq_checkpoint(tiny_model_factory(variant), str(tmp_path / "gptq"), 16,
                                                  sym=False, desc_act=desc_act, version=1)  # fmt: skip
    ps = prompts(6, (5, 21, 40))
    llm, got = greedy(gptq_dir, ps, quantization="gptq")
    assert got == hf_greedy(deq_dir, ps, 12)
    assert all(type(b.quant_method) is Int4MoEMethod for b in moe_blocks(llm))


def test_experts_in_modules_to_not_convert_load_16_bit(tiny_model_factory, tmp_path, with_mixtral_experts):
    """An AWQ Mixtral whose linears are int4 and whose experts modules_to_not_convert leaves 16-bit generates what
    its dequantised checkpoint does (aserve on both, chunked prefill)."""
    src = tiny_model_factory("mixtral")
    ps = prompts(7, (5, 21))
    skip_dir = autoawq_checkpoint(src, str(tmp_path / "awq-skip"), 16, skip=("experts",))
    _, want = greedy(dequantized_checkpoint(skip_dir, str(tmp_path / "deq-skip")), ps, 8)
    llm, got = greedy(skip_dir, ps, 8)
    assert got == want and all(type(b.quant_method) is UnquantizedMoEMethod for b in moe_blocks(llm))


def test_random_weights_for_an_int4_moe_checkpoint(tiny_model_factory, tmp_path, with_mixtral_experts):
    """`--load-format dummy` at an AWQ MoE checkpoint's shapes: the model generates."""
    awq_dir = autoawq_checkpoint(tiny_model_factory("qwen3_moe"), str(tmp_path / "awq"), 16)
    llm = LLM(awq_dir, dtype="float32", enforce_eager=True, load_format="dummy")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
