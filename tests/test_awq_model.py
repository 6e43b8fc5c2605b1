"""AWQ checkpoints in aserve, end to end: aserve's greedy tokens on an AWQ checkpoint equal transformers' on the
float checkpoint of the weights it dequantises to.

Checkpoints come from two writers: an independent one in this file (AutoAWQ's pseudo-quantiser and loop-by-loop
packer, as AutoAWQ writes them) and aserve's own quantiser (`aserve quantize`). transformers itself cannot load AWQ
here (it needs gptqmodel), so the float checkpoint of the dequantised weights is what it runs."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_awq_format import autoawq_pack
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.cli import main as cli_main
from aserve.kernels.awq_reference import awq_matmul, dequantize
from aserve.layers.linear import Linear
from aserve.layers.quantization.awq import AWQConfig, AWQLinearMethod

MAX_NEW = 16
PROMPTS = [[5, 9, 33, 2, 71], [100 + 3 * i for i in range(21)], [7 * i % 380 + 2 for i in range(40)]]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def copy_model_dir(src: str, dst: str, tensors: dict, quantization_config: dict | None) -> str:
    """src's tokenizer and config (with or without quantization_config) + `tensors` as model.safetensors."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    return dst


def autoawq_checkpoint(float_dir: str, out_dir: str, group_size: int, skip: tuple[str, ...] = ()) -> str:
    """AutoAWQ's writer, re-implemented independently of aserve: pseudo_quantize_tensor's zero-point grid (fp16
    scales), WQLinear_GEMM.from_linear's packing."""
    tensors = {}
    for name, w in load_file(os.path.join(float_dir, "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.split(".")[-1] in LINEARS) or any(s in name for s in skip):
            tensors[name] = w
            continue
        out_features, in_features = w.shape
        wg = w.float().reshape(-1, group_size)
        max_val, min_val = wg.amax(1, keepdim=True), wg.amin(1, keepdim=True)
        scales = ((max_val - min_val).clamp(min=1e-5) / 15).half()
        zeros = (-torch.round(min_val / scales.float())).clamp(0, 15)
        q = (torch.round(wg / scales.float()) + zeros).clamp(0, 15)
        tensors[f"{module}.qweight"] = autoawq_pack(q.reshape(out_features, in_features).t().int())
        tensors[f"{module}.qzeros"] = autoawq_pack(zeros.reshape(out_features, -1).t().int())
        tensors[f"{module}.scales"] = scales.reshape(out_features, -1).t().contiguous()
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": list(skip) or None}  # fmt: skip
    return copy_model_dir(float_dir, out_dir, tensors, config)


def dequantized_checkpoint(awq_dir: str, out_dir: str) -> str:
    """The float checkpoint of the weights an AWQ checkpoint stands for (W = (q - z) * s), for transformers."""
    with open(os.path.join(awq_dir, "config.json")) as f:
        group_size = json.load(f)["quantization_config"]["group_size"]
    state = load_file(os.path.join(awq_dir, "model.safetensors"))
    tensors = {}
    for name, t in state.items():
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            w = dequantize(t, state[f"{module}.qzeros"], state[f"{module}.scales"], group_size)
            tensors[f"{module}.weight"] = w.t()
        elif not name.endswith((".qzeros", ".scales")):
            tensors[name] = t.float()
    return copy_model_dir(awq_dir, out_dir, tensors, None)


def aserve_greedy(path: str, **engine_args) -> list[list[int]]:
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=256, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]


def awq_layer_map(model) -> dict:
    return {
        n: m for n, m in model.named_modules() if isinstance(m, Linear) and isinstance(m.quant_method, AWQLinearMethod)
    }


def awq_layers(llm) -> list[str]:
    return list(awq_layer_map(llm.engine.core.runner.model))


@pytest.mark.parametrize("variant, group_size", [("gqa", 32), ("qwen2", 64)])
def test_autoawq_checkpoint_matches_transformers_on_dequantized_weights(tiny_model_factory, tmp_path, variant,
                                                                        group_size):  # fmt: skip
    awq_dir = autoawq_checkpoint(tiny_model_factory(variant), str(tmp_path / "awq"), group_size)
    expected = hf_greedy(dequantized_checkpoint(awq_dir, str(tmp_path / "deq")), PROMPTS, MAX_NEW)
    assert aserve_greedy(awq_dir, quantization="awq") == expected


def test_modules_to_not_convert_and_legacy_quant_config(tiny_model_factory, tmp_path):
    awq_dir = autoawq_checkpoint(tiny_model_factory("gqa"), str(tmp_path / "awq"), 32, skip=("down_proj",))
    expected = hf_greedy(dequantized_checkpoint(awq_dir, str(tmp_path / "deq")), PROMPTS, MAX_NEW)
    llm = LLM(awq_dir, dtype="float32", enforce_eager=True, max_model_len=256)
    assert awq_layers(llm) == [f"layers.{i}.{m}" for i in range(2)
                               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj")]  # fmt: skip
    del llm
    # Older AutoAWQ: no quantization_config in config.json, a quant_config.json beside it.
    with open(os.path.join(awq_dir, "config.json")) as f:
        config = json.load(f)
    entry = config.pop("quantization_config")
    with open(os.path.join(awq_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(awq_dir, "quant_config.json"), "w") as f:
        json.dump({"zero_point": True, "q_group_size": entry["group_size"], "w_bit": 4, "version": "GEMM",
                   "modules_to_not_convert": entry["modules_to_not_convert"]}, f)  # fmt: skip
    assert aserve_greedy(awq_dir) == expected


@pytest.mark.parametrize("variant", ["mha", "qwen2"])  # mha: o_proj folds into v_proj; qwen2: GQA + q/k/v biases
def test_quantizer_output_loads_and_matches_its_dequantized_model(tiny_model_factory, tmp_path, variant):
    out = str(tmp_path / "awq")
    cli_main(["quantize", "--model", tiny_model_factory(variant), "--out", out, "--group-size", "32",
              "--num-samples", "4", "--seq-len", "64", "--method", "awq"])  # fmt: skip
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                      "zero_point": True, "version": "gemm",
                                                      "modules_to_not_convert": None}  # fmt: skip
    state = load_file(os.path.join(out, "model.safetensors"))
    assert state["model.layers.0.self_attn.q_proj.qweight"].dtype == torch.int32
    assert state["model.layers.0.mlp.down_proj.scales"].dtype == torch.float16
    assert "lm_head.weight" in state and "model.layers.0.mlp.up_proj.weight" not in state
    expected = hf_greedy(dequantized_checkpoint(out, str(tmp_path / "deq")), PROMPTS, MAX_NEW)
    assert aserve_greedy(out) == expected


def test_quantize_cli_names_a_group_size_that_fits(tiny_model_factory, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["quantize", "--model", tiny_model_factory("gqa"), "--out", str(tmp_path / "x"), "--group-size",
                  "128", "--method", "rtn"])  # fmt: skip
    assert exc.value.code == 2
    assert "hidden_size 64 is not a multiple of group size 128; use --group-size 64" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_quantize_cli_device_cuda_without_a_gpu_fails_at_once(tiny_model_factory, tmp_path, capsys):
    """`--device cuda` where torch sees no GPU: a clear error before any rounding, no output written."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["quantize", "--model", tiny_model_factory("gqa"), "--out", str(tmp_path / "x"), "--group-size", "32",
                  "--tune-steps", "2", "--device", "cuda"])  # fmt: skip
    assert exc.value.code == 2
    assert "device 'cuda' was asked for, but torch sees no CUDA GPU here" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize(
    "flag, value", [("--tune-batch", "0"), ("--tune-steps", "-1"), ("--tune-generated", "-2"), ("--num-samples", "0")]
)
def test_quantize_cli_rejects_impossible_counts(tiny_model_factory, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        cli_main(["quantize", "--model", tiny_model_factory("gqa"), "--out", str(tmp_path / "x"), "--group-size", "32",
                  flag, value])  # fmt: skip
    assert exc.value.code == 2
    assert f"{flag} must be at least" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")


def test_quantization_arg_checks_the_checkpoint(tiny_model_factory):
    with pytest.raises(ValueError, match="is a 16-bit checkpoint; quantise it with `aserve quantize`"):
        LLM(tiny_model_factory("gqa"), quantization="awq", enforce_eager=True)
    with pytest.raises(ValueError, match="quantization must be one of awq, compressed-tensors, fp8, gptq, int8"):
        LLM(tiny_model_factory("gqa"), quantization="int4", enforce_eager=True)


def test_dummy_weights_for_an_awq_config(tiny_model_factory, tmp_path):
    awq_dir = autoawq_checkpoint(tiny_model_factory("gqa"), str(tmp_path / "awq"), 32)
    llm = LLM(awq_dir, load_format="dummy", dtype="float32", enforce_eager=True, max_model_len=256)
    qweight = llm.engine.core.runner.model.layers[0].mlp.down_proj.qweight
    assert qweight.dtype == torch.int32 and qweight.min() < 0 < qweight.max()  # random bits, the sign bit included
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_fused_awq_linear_equals_its_parts_on_every_backend():
    """qkv-style fusion along the packed output dimension, then the reference, the Triton kernels (interpreter on
    CPU) and the prepacked CPU copy agree."""
    gen = torch.Generator().manual_seed(0)
    parts = []
    for out_features in (48, 16, 16):
        parts.append({"qweight": torch.randint(-(2**31), 2**31, (64, out_features // 8), dtype=torch.int32,
                                               generator=gen),  # fmt: skip
                      "qzeros": torch.randint(-(2**31), 2**31, (2, out_features // 8), dtype=torch.int32,
                                              generator=gen),  # fmt: skip
                      "scales": (torch.rand(2, out_features, generator=gen) * 0.05).half(),
                      "bias": torch.randn(out_features, generator=gen)})  # fmt: skip
    layer = Linear(64, 80, bias=True, quant_config=AWQConfig(group_size=32))
    start = 0
    for p in parts:
        size = p["scales"].shape[1]
        for name, tensor in p.items():
            layer.load_output_slice(getattr(layer, name), start, size, tensor)
        start += size
    x = torch.randn(5, 64, generator=gen)
    expected = torch.cat([awq_matmul(x, p["qweight"], p["qzeros"], p["scales"], 32, p["bias"]) for p in parts], 1)
    assert torch.equal(layer(x), expected)  # reference kernel (before process_weights_after_loading)
    layer.quant_method.use_triton(layer)  # on a GPU, on the GPU (Triton's launcher takes no CPU tensors there)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.testing.assert_close(layer.to(device)(x.to(device)).cpu(), expected, atol=1e-5, rtol=1e-5)
    layer.to("cpu")
    assert layer.quant_method.use_dense_copy(layer) and layer.dense is not None
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine repacks AWQ weights on GPUs only")
def test_gpu_engine_holds_awq_weights_once_and_matches_transformers(tiny_model_factory, tmp_path):
    """Group 128 on a GPU: the engine repacks the layers the layout fits and frees their AutoAWQ tensors (qkv, 192
    outputs, keeps its own); greedy output still equals transformers on the dequantised weights."""
    awq_dir = autoawq_checkpoint(tiny_model_factory("wide"), str(tmp_path / "awq"), 128)
    expected = hf_greedy(dequantized_checkpoint(awq_dir, str(tmp_path / "deq")), PROMPTS, MAX_NEW)
    llm = LLM(awq_dir, dtype="float32", enforce_eager=True, max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == expected
    layers = awq_layer_map(llm.engine.core.runner.model)
    dropped = {n.split(".")[-1] for n, m in layers.items() if m.autoawq_dropped}
    assert dropped == {"o_proj", "gate_up_proj", "down_proj"}
    assert all(m.qweight.numel() == 0 for m in layers.values() if m.autoawq_dropped)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the f16x2 AWQ kernels run on GPUs only")
def test_gpu_engine_applies_silu_mul_in_the_awq_gate_up_kernel(tiny_model_factory, tmp_path, monkeypatch):
    """fp16 decode on a GPU: the MLP's SiLU·mul runs in the gate/up GEMV's last programs (fuses_silu_mul_out), and
    greedy tokens equal those of the unfused path (the GEMV, then silu_and_mul: the same rounding)."""
    awq_dir = autoawq_checkpoint(tiny_model_factory("wide"), str(tmp_path / "awq"), 128)
    calls = []
    fused = AWQLinearMethod.apply_silu_mul_out
    monkeypatch.setattr(AWQLinearMethod, "apply_silu_mul_out",
                        lambda self, layer, x: calls.append(x.shape[0]) or fused(self, layer, x))  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    tokens = {}
    for on in (True, False):
        if not on:
            monkeypatch.setattr(AWQLinearMethod, "fuses_silu_mul_out", lambda self, layer, x: False)
        llm = LLM(awq_dir, dtype="float16", enforce_eager=True, max_model_len=256)
        tokens[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        del llm
    assert calls and max(calls) <= 6
    assert tokens[True] == tokens[False]
