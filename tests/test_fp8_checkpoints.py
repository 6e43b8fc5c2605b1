"""Pre-quantised FP8 checkpoints as the ecosystem writes them: llm-compressor's compressed-tensors (FP8_DYNAMIC:
per-channel weight scales; per-tensor with static input scales; block-wise) and the plain `quant_method: "fp8"`
format (per-tensor scalar scales, static `input_scale`, `weight_block_size` with `weight_scale_inv`).

The checkpoints come from a writer in this file, independent of aserve: e4m3 rounding of each decoder linear by its
own scales, written with safetensors. v_proj and up_proj are scaled up first, so the parts of aserve's fused q/k/v
and gate/up layers have clearly different per-tensor scales. Without FP8 tensor cores (this CPU) aserve runs them
weight-only: its greedy tokens equal transformers' on the float checkpoint of the dequantised weights (float32).
The FP8 layer path that GPUs take (weight-only kernels for few rows, torch._scaled_mm beyond, static input scales)
is checked on CPU tensors against the pure-torch reference, with Triton's interpreter."""

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file
from test_awq_model import LINEARS, MAX_NEW, PROMPTS, copy_model_dir
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.kernels.fp8_reference import fp8_weight_only_linear
from aserve.layers.linear import Linear, UnquantizedLinearMethod
from aserve.layers.quantization import fp8 as fp8_method
from aserve.layers.quantization.fp8_checkpoint import Fp8CheckpointLinearMethod
from aserve.layers.quantization.fp8_config import Fp8Config

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def to_e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize(w: torch.Tensor, strategy: str, block=None, scale_dtype=torch.float32):
    """W [N, K] -> (e4m3 weight, scale as the checkpoint stores it, the dequantised float32 weight)."""
    w = w.float()
    if strategy == "tensor":
        scale = (w.abs().max() / E4M3_MAX).to(scale_dtype)
        q = to_e4m3(w, scale.float())
        return q, scale, q.float() * scale.float()
    if strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(scale_dtype)  # [N, 1]
        q = to_e4m3(w, scale.float())
        return q, scale, q.float() * scale.float()
    bn, bk = block
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=E4M3)
    deq = torch.empty(n, k)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = (slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk))
            scale[i, j] = w[tile].abs().max() / E4M3_MAX
            q[tile] = to_e4m3(w[tile], scale[i, j])
            deq[tile] = q[tile].float() * scale[i, j]
    return q, scale.to(scale_dtype), deq


def fp8_dynamic_group(strategy: str, inputs: dict | None, block=None) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "block_structure": list(block) if block else None, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}  # fmt: skip
    return {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None}


TOKEN_DYNAMIC = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token",
                 "group_size": None, "observer": None}  # fmt: skip
TENSOR_STATIC = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
                 "observer": "minmax"}  # fmt: skip

# layout -> (config, weight strategy, block, scale name, 0-dim per-tensor scales, static input scales, scale dtype)
LAYOUTS = {
    "ct-channel": ("ct", "channel", None, "weight_scale", False, False, torch.bfloat16),  # FP8_DYNAMIC
    "ct-tensor-static": ("ct", "tensor", None, "weight_scale", False, True, torch.float32),
    "ct-block": ("ct", "block", (48, 48), "weight_scale", False, False, torch.float32),
    "fp8-tensor": ("fp8", "tensor", None, "weight_scale", True, False, torch.float32),
    "fp8-static": ("fp8", "tensor", None, "weight_scale", True, True, torch.float32),
    "fp8-block": ("fp8", "block", (48, 48), "weight_scale_inv", False, False, torch.float32),
}
IGNORED = "model.layers.1.mlp.down_proj"  # kept 16-bit by the config's ignore list


def quantization_config(layout: str) -> dict:
    fmt, strategy, block, _, _, static, _ = LAYOUTS[layout]
    if fmt == "fp8":
        config = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
                  "ignored_layers": [IGNORED]}  # fmt: skip
        if block:
            config["weight_block_size"] = list(block)
        return config
    inputs = TENSOR_STATIC if static else TOKEN_DYNAMIC
    if block:
        inputs = {**TOKEN_DYNAMIC, "strategy": "group", "group_size": block[1]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": fp8_dynamic_group(strategy, inputs, block)},
            "ignore": ["lm_head", f"re:{IGNORED.replace('.', '[.]')}$"], "kv_cache_scheme": None,
            "sparsity_config": {}, "global_compression_ratio": 1.5, "version": "0.10.2"}  # fmt: skip


def fp8_checkpoint(float_dir: str, out_dir: str, layout: str) -> tuple[str, str]:
    """-> (FP8 checkpoint dir, dir of the float checkpoint of its dequantised weights)."""
    _, strategy, block, scale_name, zero_dim, static, scale_dtype = LAYOUTS[layout]
    tensors, dequantized = {}, {}
    for i, (name, w) in enumerate(sorted(load_file(os.path.join(float_dir, "model.safetensors")).items())):
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.split(".")[-1] in LINEARS) or module == IGNORED:
            tensors[name] = dequantized[name] = w
            continue
        if module.endswith(("v_proj", "up_proj")):
            w = w * 4.0  # different per-tensor scales within a fused layer
        q, scale, deq = quantize(w, strategy, block, scale_dtype)
        tensors[name], dequantized[name] = q, deq
        tensors[f"{module}.{scale_name}"] = scale.reshape(1) if strategy == "tensor" and not zero_dim else scale
        if static:
            value = torch.tensor(0.01 * (1 + i % 5))
            tensors[f"{module}.input_scale"] = value if zero_dim else value.reshape(1)
    return (copy_model_dir(float_dir, out_dir, tensors, quantization_config(layout)),
            copy_model_dir(float_dir, out_dir + "-deq", dequantized, None))  # fmt: skip


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]


CASES = [("gqa", "ct-channel"), ("qwen2", "ct-tensor-static"), ("mha", "ct-block"), ("gqa", "fp8-tensor"),
         ("gqa", "fp8-static"), ("qwen2", "fp8-block")]  # fmt: skip


@pytest.mark.parametrize("variant, layout", CASES)
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(tiny_model_factory, tmp_path, caplog, variant,
                                                                    layout):  # fmt: skip
    fp8_dir, deq_dir = fp8_checkpoint(tiny_model_factory(variant), str(tmp_path / "fp8"), layout)
    fp8_method.Fp8LinearMethod._logged_reasons.clear()
    with caplog.at_level(logging.INFO, logger="aserve"):
        llm = LLM(fp8_dir, dtype="float32", enforce_eager=True, max_model_len=256)
    assert [r.message for r in caplog.records if "computed weight-only" in r.message]  # the one log line
    model = llm.engine.core.runner.model
    for i, layer in enumerate(model.layers):
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            ignored = i == 1 and linear is layer.mlp.down_proj
            want = UnquantizedLinearMethod if ignored else Fp8CheckpointLinearMethod
            assert type(linear.quant_method) is want and linear.weight.dtype == torch.float32
    # the fused q/k/v layer holds exactly the dequantised parts, each by its own scales
    deq = load_file(os.path.join(deq_dir, "model.safetensors"))
    parts = [deq[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, torch.cat(parts))
    assert greedy(llm) == hf_greedy(deq_dir, PROMPTS, MAX_NEW)


def fused_fp8_layer(config, dtype=torch.float16, bias=True) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A q/k/v-like 64 -> 96 layer of three parts with per-tensor scales (and input scales 0.02, 0.05, 0.03) loaded
    part by part -> (layer, its e4m3 weight, the per-channel scales that stand for the parts' scales)."""
    gen = torch.Generator().manual_seed(5)
    layer = Linear(64, 96, bias=bias, quant_config=config, checkpoint_names=[f"m.{p}_proj" for p in "qkv"],
                   params_dtype=dtype)  # fmt: skip
    weights, scales = [], []
    for i, input_scale in enumerate((0.02, 0.05, 0.03)):
        q, scale, _ = quantize(torch.randn(32, 64, generator=gen) * (i + 1), "tensor")
        layer.load_output_slice(layer.weight, 32 * i, 32, q)
        layer.load_output_slice(layer.weight_scale, 32 * i, 32, scale.reshape(1))
        if hasattr(layer, "input_scale"):
            layer.load_output_slice(layer.input_scale, 32 * i, 32, torch.tensor([input_scale]))
        if bias:
            layer.load_output_slice(layer.bias, 32 * i, 32, torch.randn(32, generator=gen).to(dtype))
        weights.append(q)
        scales.append(scale.expand(32))
    return layer, torch.cat(weights), torch.cat(scales)


def test_the_fp8_layer_path_of_gpus_on_cpu_tensors(monkeypatch):
    """What a GPU with FP8 tensor cores runs, on CPU tensors (Triton's interpreter; torch._scaled_mm has a CPU
    kernel): e4m3 weights with per-channel scales, the weight-only kernels up to fp8_gemv.MAX_ROWS rows (the
    one-row GEMV with SiLU·mul fused in too), torch._scaled_mm beyond on activations quantised by the largest of the
    parts' static input scales."""
    from aserve.kernels import fp8_gemv
    from aserve.kernels.fused import silu_and_mul

    config = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static"})
    cpu_layer, weight, scale = fused_fp8_layer(config)  # this CPU: dequantised, also when processed again
    for _ in range(2):
        cpu_layer.process_weights_after_loading()
        assert torch.equal(cpu_layer.weight, (weight.float() * scale[:, None]).half())
    monkeypatch.setattr(fp8_method, "has_fp8_tensor_cores", lambda device: True)
    layer, weight, scale = fused_fp8_layer(config)
    for _ in range(2):  # processing again (after weights change) keeps the FP8 layer as it is
        layer.process_weights_after_loading()
        assert layer.weight.dtype == E4M3 and torch.equal(layer.weight, weight)
        assert layer.input_scale.item() == torch.tensor(0.05).item()  # the parts' largest
        assert torch.equal(layer.channel_scale, scale)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, fp8_gemv.MAX_ROWS):  # the weight-only kernels: the exact product, up to summation order
        x = torch.randn(rows, 64, generator=gen).half()
        torch.testing.assert_close(layer(x), fp8_weight_only_linear(x, weight, scale, layer.bias), atol=2e-2,
                                   rtol=2e-3)  # fmt: skip
    x = torch.randn(fp8_gemv.MAX_ROWS + 4, 64, generator=gen).half()
    x_fp8 = (x.float() / 0.05).clamp(-448, 448).to(E4M3)
    want = fp8_weight_only_linear((x_fp8.float() * 0.05).half(), weight, scale, layer.bias)
    torch.testing.assert_close(layer(x), want, atol=5e-2, rtol=1e-2)
    # the down projection of a Llama MLP: SiLU·mul fused into the one-row GEMV
    down, weight, scale = fused_fp8_layer(Fp8Config.from_config({"quant_method": "fp8"}), bias=False)
    down.process_weights_after_loading()
    gate_up = torch.randn(1, 128, generator=gen).half()
    assert down.fuses_silu_mul_in(gate_up) and not down.fuses_silu_mul_in(gate_up.expand(2, 128))
    torch.testing.assert_close(down.forward_silu_mul_in(gate_up), down(silu_and_mul(gate_up)), atol=2e-3, rtol=2e-3)


def edited_config(path: str, edit) -> str:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


def test_what_is_not_supported_is_refused_clearly(tiny_model_factory, tmp_path):
    ct_dir, _ = fp8_checkpoint(tiny_model_factory("gqa"), str(tmp_path / "ct"), "ct-channel")
    with pytest.raises(ValueError, match="--quantization fp8, but .* quantised with compressed-tensors"):
        LLM(ct_dir, quantization="fp8", enforce_eager=True)
    refusals = [
        (lambda c: c.update(format="pack-quantized"), "format 'pack-quantized' is not supported"),
        (lambda c: c["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4), "4-bit int weights"),
        (
            lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=32),
            "weight strategy 'group' is not supported",
        ),
        (lambda c: c.update(ignore=["model.layers.0.self_attn.k_proj"]), "leaves part of a fused layer"),
        (lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config: not supported"),
    ]
    for edit, message in refusals:
        with pytest.raises(ValueError, match=message):
            LLM(edited_config(ct_dir, edit), enforce_eager=True)
        edited_config(ct_dir, lambda c: (c.clear(), c.update(quantization_config("ct-channel"))))
    fp8_dir, _ = fp8_checkpoint(tiny_model_factory("gqa"), str(tmp_path / "fp8"), "fp8-block")
    with pytest.raises(ValueError, match="weight_block_size with static activations"):
        LLM(edited_config(fp8_dir, lambda c: c.update(activation_scheme="static")), enforce_eager=True)
    with pytest.raises(ValueError, match="fmt 'e5m2'"):
        LLM(edited_config(fp8_dir, lambda c: c.update(activation_scheme="dynamic", fmt="e5m2")), enforce_eager=True)


def test_fp8_checkpoint_over_http_with_the_openai_client(tiny_model_factory, tmp_path):
    """`aserve serve --quantization fp8` on a plain-format FP8 checkpoint with static input scales (Qwen2: q/k/v
    biases), driven by the openai client: each completion is the offline API's greedy output, whose tokens are
    transformers' on the dequantised weights; the server's log says the weights run weight-only."""
    openai = pytest.importorskip("openai")
    from aserve_server import start_server, stop_server

    fp8_dir, deq_dir = fp8_checkpoint(tiny_model_factory("qwen2"), str(tmp_path / "fp8"), "fp8-static")
    llm = LLM(fp8_dir, dtype="float32", enforce_eager=True, max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(deq_dir, PROMPTS, MAX_NEW)
    del llm
    log_path = str(tmp_path / "server.log")
    proc, url = start_server("--model", fp8_dir, "--dtype", "float32", "--quantization", "fp8", "--served-model-name",
                             "fp8", "--enforce-eager", "--max-model-len", "256", log_path=log_path)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            resp = client.completions.create(model="fp8", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
            assert resp.choices[0].text == out.outputs[0].text
    finally:
        stop_server(proc)
    with open(log_path) as f:
        assert sum("computed weight-only" in line for line in f) == 1


def test_random_weights_for_an_fp8_checkpoint(tiny_model_factory, tmp_path):
    """`load_format="dummy"` draws e4m3 weights and scales at the checkpoint's shapes (benchmarks of FP8 models)."""
    fp8_dir, _ = fp8_checkpoint(tiny_model_factory("gqa"), str(tmp_path / "fp8"), "ct-tensor-static")
    llm = LLM(fp8_dir, load_format="dummy", enforce_eager=True, max_model_len=128)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
