"""GPTQ checkpoints in aserve: the format's packing round trip, and end to end, aserve's greedy tokens on a GPTQ
checkpoint equal transformers' on the float checkpoint of the weights it dequantises to (transformers itself cannot
load GPTQ here: it needs optimum / gptqmodel).

The checkpoints come from a writer in this file, independent of aserve: round-to-nearest grids per group (symmetric
or not), act order as GPTQ forms it (a permutation of the inputs, shared by the linears that read the same input,
groups made in that order: g_idx[perm[i]] = i // group_size), and AutoGPTQ's loop-by-loop packing, in the v1 (zero
points minus one) or v2 format."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_awq_model import LINEARS, MAX_NEW, PROMPTS, aserve_greedy, copy_model_dir, dequantized_checkpoint
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.cli import main as cli_main
from aserve.layers.linear import Linear
from aserve.layers.quantization import gptq_format
from aserve.layers.quantization.awq import AWQLinearMethod
from aserve.layers.quantization.gptq import FORMAT_VERSIONS, ActOrderAWQLinearMethod, GPTQConfig

# the linears that read one input share an act-order permutation
_INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
             "up_proj": "mlp", "down_proj": "down"}  # fmt: skip


def autogptq_pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R/8, C], as AutoGPTQ's QuantLinear.pack: rows 8i + j in bits 4j of row i."""
    packed = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for i in range(q.shape[0] // 8):
        for j in range(8):
            packed[i] |= q[8 * i + j].to(torch.int64) << (4 * j)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize_linear(w: torch.Tensor, group_size: int, sym: bool, g_idx: torch.Tensor):
    """W [N, K] -> (q [K, N], z [G, N], s fp16 [G, N]) rounded to nearest on each group's grid."""
    n, k = w.shape
    groups = k // group_size
    q = torch.empty(k, n, dtype=torch.int64)
    z = torch.empty(groups, n, dtype=torch.int64)
    s = torch.empty(groups, n, dtype=torch.float16)
    for grp in range(groups):
        cols = (g_idx == grp).nonzero()[:, 0]
        wg = w[:, cols].float()
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        if sym:
            scale = (torch.maximum(-lo, hi) / 7.5).clamp(min=1e-5).half()
            zero = torch.full((n,), 8)
        else:
            scale = ((hi - lo) / 15).clamp(min=1e-5).half()
            zero = (-lo / scale.float()).round().clamp(1, 15).long()  # 1..15: v1 stores z - 1 >= 0
        q[cols] = (wg / scale.float()[:, None]).round().add(zero[:, None]).clamp(0, 15).long().t()
        z[grp], s[grp] = zero, scale
    return q, z, s


def gptq_checkpoint(float_dir: str, out_dir: str, group_size: int, sym: bool, desc_act: bool, version: int) -> tuple:
    """-> (GPTQ dir, dir of the float checkpoint of its dequantised weights)."""
    state = load_file(os.path.join(float_dir, "model.safetensors"))
    tensors, dequantized = {}, {}
    gen = torch.Generator().manual_seed(group_size + 2 * sym + 4 * desc_act + 8 * version)
    perms = {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        linear = module.split(".")[-1]
        if not (name.endswith(".weight") and linear in LINEARS):
            tensors[name] = dequantized[name] = w
            continue
        n, k = w.shape
        g = k if group_size == -1 else group_size
        g_idx = torch.arange(k) // g
        if desc_act:
            key = (module.rsplit(".", 2)[0], _INPUT_OF[linear])
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // g
        q, z, s = quantize_linear(w, g, sym, g_idx)
        stored = z - (1 if version == 1 else 0)
        tensors[f"{module}.qweight"] = autogptq_pack_rows(q)
        tensors[f"{module}.qzeros"] = autogptq_pack_rows(stored.t().contiguous()).t().contiguous()
        tensors[f"{module}.scales"] = s
        tensors[f"{module}.g_idx"] = g_idx.to(torch.int32)
        dequantized[name] = ((q - z[g_idx]).float() * s[g_idx].float()).t().contiguous()
    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq" if version == 1 else "gptq_v2", "damp_percent": 0.01,
              "true_sequential": True, "static_groups": False}  # fmt: skip
    return (copy_model_dir(float_dir, out_dir, tensors, config),
            copy_model_dir(float_dir, out_dir + "-deq", dequantized, None))  # fmt: skip


def test_pack_round_trip_and_dequantize_match_the_writer():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 64), generator=gen)  # [out, in]
    z = torch.randint(1, 16, (24, 4), generator=gen)
    s = torch.rand(24, 4, generator=gen).half()
    g_idx = torch.randperm(64, generator=gen) % 4
    for version in (1, 2):
        packed = gptq_format.pack(q, z, s, g_idx, version)
        assert torch.equal(packed["qweight"], autogptq_pack_rows(q.t()))
        assert torch.equal(gptq_format.unpack_rows(packed["qweight"]), q.t().int())
        assert torch.equal(gptq_format.zero_points(packed["qzeros"], version), z.t().int())
        w = gptq_format.dequantize(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], version)
        expected = (q - z[:, g_idx]).float() * s[:, g_idx].float()
        assert torch.equal(w, expected)
    with pytest.raises(ValueError, match="a zero point of 0 has no GPTQ v1 encoding"):
        gptq_format.pack(q, torch.zeros_like(z), s, None, version=1)


CASES = [  # variant, group size, sym, desc_act, format version
    ("gqa", 32, True, False, 1),
    ("qwen2", 32, False, True, 1),  # q/k/v biases, asymmetric, act order
    ("gqa", -1, False, False, 2),  # one group per output channel
    ("mha", 32, True, True, 2),
]


@pytest.mark.parametrize("variant, group_size, sym, desc_act, version", CASES)
def test_gptq_checkpoint_matches_transformers_on_dequantized_weights(tiny_model_factory, tmp_path, variant,
                                                                     group_size, sym, desc_act, version):  # fmt: skip
    gptq_dir, deq_dir = gptq_checkpoint(tiny_model_factory(variant), str(tmp_path / "gptq"), group_size, sym,
                                        desc_act, version)  # fmt: skip
    expected = hf_greedy(deq_dir, PROMPTS, MAX_NEW)
    llm = LLM(gptq_dir, dtype="float32", enforce_eager=True, max_model_len=256, quantization="gptq")
    methods = {type(m.quant_method) for m in llm.engine.core.runner.model.modules() if isinstance(m, Linear)}
    kind = ActOrderAWQLinearMethod if desc_act else AWQLinearMethod
    assert kind in methods and GPTQConfig not in methods
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_act_order_layer_on_the_triton_kernels_and_the_reference():
    """One act-order GPTQ linear, fused from two parts: the GPTQ reference before processing, the repacked AWQ
    kernels (Triton; the interpreter on CPU) and the CPU dense copy agree."""
    gen = torch.Generator().manual_seed(1)
    k, g = 64, 16
    g_idx = (torch.randperm(k, generator=gen) % (k // g)).int()
    layer = Linear(k, 48, bias=True, quant_config=GPTQConfig(group_size=g, desc_act=True, sym=False))
    start = 0
    for n in (32, 16):
        q = torch.randint(0, 16, (n, k), generator=gen)
        z = torch.randint(1, 16, (n, k // g), generator=gen)
        s = (torch.rand(n, k // g, generator=gen) * 0.05).half()
        part = {**gptq_format.pack(q, z, s, g_idx), "bias": torch.randn(n, generator=gen)}
        for name, tensor in part.items():
            layer.load_output_slice(getattr(layer, name), start, n, tensor)
        start += n
    x = torch.randn(5, k, generator=gen)
    expected = layer(x)  # the GPTQ reference: dequantise, then matmul
    layer.process_weights_after_loading()  # CPU: repacked, then the AWQ method's dense copy
    assert isinstance(layer.quant_method, ActOrderAWQLinearMethod)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    layer.quant_method.use_triton(layer)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layer.input_perm = layer.input_perm.to(device)
    torch.testing.assert_close(layer.to(device)(x.to(device)).cpu(), expected, atol=1e-5, rtol=1e-5)


def test_legacy_quantize_config_and_clear_errors(tiny_model_factory, tmp_path):
    gptq_dir, deq_dir = gptq_checkpoint(tiny_model_factory("gqa"), str(tmp_path / "gptq"), 32, True, False, 1)
    config_path = os.path.join(gptq_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    entry = config.pop("quantization_config")
    with open(config_path, "w") as f:
        json.dump(config, f)
    with open(os.path.join(gptq_dir, "quantize_config.json"), "w") as f:  # older AutoGPTQ: beside config.json
        json.dump({k: v for k, v in entry.items() if k != "quant_method"}, f)
    assert aserve_greedy(gptq_dir) == hf_greedy(deq_dir, PROMPTS, MAX_NEW)
    with pytest.raises(ValueError, match="--quantization awq, but .* is a checkpoint quantised with gptq"):
        LLM(gptq_dir, quantization="awq", enforce_eager=True)
    with pytest.raises(ValueError, match=r"is a 16-bit checkpoint; quantise it with `aserve quantize --format gptq`"):
        LLM(tiny_model_factory("gqa"), quantization="gptq", enforce_eager=True)
    for change, message in [({"bits": 3}, "3-bit weights: aserve runs 4-bit and 8-bit GPTQ"),
                            ({"bits": 8}, "8-bit GPTQ with group_size 32: not supported"),
                            ({"group_size": 24}, "group_size 24 is not supported"),
                            ({"checkpoint_format": "marlin"}, "format 'marlin' is not supported"),
                            ({"lm_head": True}, "the checkpoint holds a 16-bit lm_head.weight")]:  # fmt: skip
        with open(os.path.join(gptq_dir, "quantize_config.json"), "w") as f:
            json.dump({**entry, **change}, f)
        with pytest.raises(ValueError, match=message):
            LLM(gptq_dir, enforce_eager=True)


def test_v1_zero_point_overflow_and_mixed_act_order_parts_are_refused():
    q = torch.zeros(8, 32, dtype=torch.int64)
    # a zero point of 0 in v1: stored as -1, its nibbles read back as 15, the zero point as 16
    packed = {"qweight": autogptq_pack_rows(q.t()), "qzeros": torch.full((1, 1), -1, dtype=torch.int32),
              "scales": torch.ones(1, 8).half(), "g_idx": torch.zeros(32, dtype=torch.int32)}  # fmt: skip
    with pytest.raises(ValueError, match="AutoGPTQ's asymmetric overflow"):
        gptq_format.to_awq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], 32, version=1)
    layer = Linear(32, 16, bias=False, quant_config=GPTQConfig(group_size=16, desc_act=True))
    g_idx = torch.arange(32, dtype=torch.int32) % 2
    layer.load_output_slice(layer.g_idx, 0, 8, g_idx)
    with pytest.raises(ValueError, match="different g_idx"):
        layer.load_output_slice(layer.g_idx, 8, 8, g_idx.flip(0))


def test_dummy_weights_for_a_gptq_config(tiny_model_factory, tmp_path):
    gptq_dir, _ = gptq_checkpoint(tiny_model_factory("gqa"), str(tmp_path / "gptq"), 32, True, True, 1)
    llm = LLM(gptq_dir, load_format="dummy", dtype="float32", enforce_eager=True, max_model_len=256)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_quantize_cli_writes_gptq_with_the_awq_grids(tiny_model_factory, tmp_path):
    """`aserve quantize --format gptq`: the same grids as the AWQ-format checkpoint of the same run, packed as GPTQ;
    aserve's greedy tokens on it equal transformers' on its dequantised weights."""
    model = tiny_model_factory("qwen2")
    dirs = {}
    for fmt in ("awq", "gptq"):
        dirs[fmt] = str(tmp_path / fmt)
        cli_main(["quantize", "--model", model, "--out", dirs[fmt], "--group-size", "32", "--method", "rtn",
                  "--format", fmt])  # fmt: skip
    with open(os.path.join(dirs["gptq"], "config.json")) as f:
        entry = json.load(f)["quantization_config"]
    assert entry["quant_method"] == "gptq" and entry["group_size"] == 32 and entry["desc_act"] is False
    version = FORMAT_VERSIONS[entry["checkpoint_format"]]
    gptq_state = load_file(os.path.join(dirs["gptq"], "model.safetensors"))
    awq_deq = load_file(os.path.join(dequantized_checkpoint(dirs["awq"], str(tmp_path / "deq")), "model.safetensors"))
    suffixes = tuple(f".{p}.weight" for p in LINEARS)
    linears = [name.removesuffix(".weight") for name in awq_deq if name.endswith(suffixes)]
    assert len(linears) == 2 * len(LINEARS)
    for m in linears:
        w = gptq_format.dequantize(*(gptq_state[f"{m}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")), version)
        assert torch.equal(w, awq_deq[f"{m}.weight"])
    assert aserve_greedy(dirs["gptq"], quantization="gptq") == hf_greedy(str(tmp_path / "deq"), PROMPTS, MAX_NEW)


async def test_act_order_gptq_over_http_matches_transformers(tiny_model_factory, tmp_path):
    """The OpenAI server (in process) on an act-order GPTQ checkpoint: each completion's text is that of the offline
    API's greedy output, whose tokens are transformers' on the dequantised weights."""
    from aiohttp.test_utils import TestClient, TestServer

    from aserve import EngineArgs, LLMEngine
    from aserve.engine.async_engine import AsyncEngine
    from aserve.entrypoints.openai.server import build_app

    gptq_dir, deq_dir = gptq_checkpoint(tiny_model_factory("qwen2"), str(tmp_path / "gptq"), 32, False, True, 1)
    llm = LLM(gptq_dir, dtype="float32", enforce_eager=True, max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(deq_dir, PROMPTS, MAX_NEW)
    del llm
    engine = LLMEngine(EngineArgs(model=gptq_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                                  served_model_name="gptq", quantization="gptq"))  # fmt: skip
    client = TestClient(TestServer(build_app(AsyncEngine(engine), "gptq", None)))
    await client.start_server()
    try:
        for prompt, out in zip(PROMPTS, outs, strict=True):
            body = {"model": "gptq", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200
            assert (await resp.json())["choices"][0]["text"] == out.outputs[0].text
    finally:
        await client.close()
