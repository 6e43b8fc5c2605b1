"""The AWQ quantiser's parts: its calibration forward against transformers, scale folding that leaves the float
model unchanged, the scale and clipping searches, GPTQ's error feedback, and the perplexity evaluation against
transformers' loss. The full SmolLM2 run (quality within 5 % of bf16, better than RTN, still answers "Paris") is
marked slow."""

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from aserve.kernels.awq_reference import dequantize as dequantize_packed
from aserve.kernels.awq_reference import unpack_int4
from aserve.layers.quantization.awq_format import fake_quantize, pack_quantized, quantize_groups
from aserve.quantize.awq_search import apply_clip, awq_layer, search_clip, search_scales
from aserve.quantize.dense_layer import DenseDecoderLayer
from aserve.quantize.gptq import SEARCHES, dequantize, gptq_quantize, gram, output_error

TEXT = "The quick brown fox jumps over the lazy dog. Prefix caching shares blocks between requests. " * 6


def tiny_layers(path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    state = load_file(f"{path}/model.safetensors")
    layers = []
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        layers.append({k.removeprefix(prefix): v.float() for k, v in state.items() if k.startswith(prefix)})
    return cfg, state, layers


@pytest.mark.parametrize("variant", ["gqa", "qwen2", "llama3_rope"])
def test_calibration_forward_matches_transformers(tiny_model_factory, variant):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(variant)
    cfg, state, layers = tiny_layers(path)
    ids = torch.randint(2, 380, (3, 24), generator=torch.Generator().manual_seed(0))
    x = state["model.embed_tokens.weight"][ids.flatten()]
    for weights in layers:
        x, _ = DenseDecoderLayer(weights, cfg, 24).forward(x, 24)
    x = F.rms_norm(x, (x.shape[-1],), state["model.norm.weight"], cfg.rms_norm_eps)
    logits = F.linear(x, state["lm_head.weight"]).view(3, 24, -1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["mha", "qwen2"])  # mha also folds o_proj's scales into v_proj
def test_folded_scales_leave_the_float_layer_unchanged(tiny_model_factory, variant):
    path = tiny_model_factory(variant)
    cfg, state, layers = tiny_layers(path)
    x = torch.randn(4 * 16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    layer = DenseDecoderLayer(dict(layers[0]), cfg, 16)
    before, feats = layer.forward(x, 16)
    report = awq_layer(layer, feats, 16, group_size=32, clip=False)
    assert set(report) == ({"qkv", "o_proj", "gate_up", "down_proj"} if variant == "mha" else
                           {"qkv", "gate_up", "down_proj"})  # fmt: skip
    changed = [k for k in layers[0] if not torch.equal(layer.w[k], layers[0][k])]
    assert "input_layernorm.weight" in changed and "mlp.up_proj.weight" in changed
    after, _ = layer.forward(x, 16)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    for group in report.values():  # s = 1 is a candidate: never worse than round-to-nearest on the calibration data
        assert group["awq"] <= group["rtn"]


def outlier_data(seed: int):
    """Inputs where 4 of 128 channels are 20x larger (as LLM activations are), and a random weight."""
    gen = torch.Generator().manual_seed(seed)
    gain = torch.ones(128)
    gain[torch.randperm(128, generator=gen)[:4]] = 20.0
    calib = torch.randn(512, 128, generator=gen) * gain
    heldout = torch.randn(512, 128, generator=gen) * gain
    return calib, heldout, torch.randn(64, 128, generator=gen)


def test_scale_search_protects_salient_channels_on_heldout_inputs():
    calib, heldout, w = outlier_data(0)
    scales, losses = search_scales(calib, ["w"], {"w": w}, lambda o: F.linear(calib, o.get("w", w)), 32)
    assert losses["awq"] < 0.5 * losses["rtn"]
    reference = F.linear(heldout, w)
    rtn_err = (F.linear(heldout, fake_quantize(w, 32)) - reference).pow(2).mean()
    awq_err = (F.linear(heldout, fake_quantize(w * scales, 32) / scales) - reference).pow(2).mean()
    assert awq_err < 0.5 * rtn_err


def test_clip_search_never_increases_any_groups_error():
    calib, _, w = outlier_data(1)
    low, high = search_clip(calib, w, 32)
    org_min, org_max = w.reshape(64, 4, 32).amin(-1).clamp(max=0), w.reshape(64, 4, 32).amax(-1).clamp(min=0)
    assert high.shape == low.shape == (64, 4)
    assert (high <= org_max).all() and (high >= 0.5 * org_max).all() and (low >= org_min).all()
    assert (low <= 0.5 * org_min).all() and ((high < org_max) | (low > org_min)).any()

    def group_errors(weight):  # token-wise, without the Gram-matrix shortcut the search uses
        delta = (fake_quantize(weight, 32) - w).reshape(64, 4, 32)
        return torch.einsum("tgk,ogk->tog", calib.reshape(-1, 4, 32), delta).pow(2).mean(0)

    clipped, plain = group_errors(apply_clip(w, (low, high), 32)), group_errors(w)
    assert (clipped <= plain * (1 + 1e-5)).all()
    assert clipped.sum() < plain.sum()


def correlated_data(seed: int):
    """Inputs whose channels are mixed (correlated, as a layer's inputs are) with 4 outliers, and a random weight."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.eye(128) + torch.randn(128, 128, generator=gen) / 8
    gain = torch.ones(128)
    gain[torch.randperm(128, generator=gen)[:4]] = 10.0
    calib = torch.randn(1024, 128, generator=gen) @ mix * gain
    heldout = torch.randn(1024, 128, generator=gen) @ mix * gain
    return calib, heldout, torch.randn(64, 128, generator=gen)


@pytest.mark.parametrize("search", SEARCHES)
def test_gptq_output_error_is_below_round_to_nearest(search):
    calib, heldout, w = correlated_data(2)
    q, z, s = gptq_quantize(w, gram(calib), 32, search)
    assert q.dtype == z.dtype == torch.int32 and s.dtype == torch.float16 and z.shape == s.shape == (64, 4)
    assert q.min() >= 0 and q.max() <= 15 and z.min() >= 0 and z.max() <= 15
    packed = pack_quantized(q, z, s)  # the checkpoint holds exactly the weights GPTQ chose
    assert torch.equal(dequantize_packed(packed["qweight"], packed["qzeros"], packed["scales"], 32).t(),
                       dequantize(q, z, s))  # fmt: skip
    for x in (calib, heldout):  # minimised on calib, and it carries over to inputs of the same correlations
        h = gram(x)
        assert output_error(w, dequantize(q, z, s), h) < 0.75 * output_error(w, fake_quantize(w, 32), h)


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_gptq_act_order_beats_input_order(seed):
    """Rounding the input channels by decreasing H diagonal (grids fixed beforehand, groups still contiguous) leaves
    a lower output error than rounding them in order, on the calibration inputs and on held-out ones."""
    calib, heldout, w = correlated_data(seed)
    h = gram(calib)
    by_energy, in_order = (dequantize(*gptq_quantize(w, h, 32, act_order=a)) for a in (True, False))
    for x in (calib, heldout):
        hx = gram(x)
        assert output_error(w, by_energy, hx) < output_error(w, in_order, hx)


def test_gptq_with_uncorrelated_unit_inputs_is_round_to_nearest():
    # H = I: no column's error can be compensated by another, so GPTQ on min/max grids rounds to nearest, exactly
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(3))
    for got, expected in zip(gptq_quantize(w, torch.eye(96), 32, "minmax", damp=0.0), quantize_groups(w, 32)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("method, variant", [("gptq", "gqa"), ("awq-gptq", "mha")])
def test_gptq_checkpoint_loads_and_matches_its_dequantized_model(tiny_model_factory, tmp_path, method, variant):
    from test_awq_model import MAX_NEW, PROMPTS, aserve_greedy, dequantized_checkpoint
    from tiny_models import hf_greedy

    from aserve.quantize.quantize import quantize_model

    out = str(tmp_path / method)
    report = quantize_model(tiny_model_factory(variant), out, group_size=32, method=method, num_samples=4,
                            seq_len=64, progress=False)  # fmt: skip
    assert len(report["linears"]) == 2 and len(report["layers"]) == (2 if method == "awq-gptq" else 0)
    errors = [e for layer in report["linears"] for e in layer.values()]
    assert sum(e["gptq"] for e in errors) < sum(e["rtn"] for e in errors)
    quantize_model(tiny_model_factory(variant), str(tmp_path / "rtn"), group_size=32, method="rtn", progress=False)
    state, rtn = load_file(f"{out}/model.safetensors"), load_file(f"{tmp_path}/rtn/model.safetensors")
    assert not torch.equal(state["model.layers.0.mlp.down_proj.qweight"], rtn["model.layers.0.mlp.down_proj.qweight"])
    expected = hf_greedy(dequantized_checkpoint(out, str(tmp_path / "deq")), PROMPTS, MAX_NEW)
    assert aserve_greedy(out) == expected


def test_perplexity_matches_transformers_loss(tiny_model_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aserve.quantize.perplexity import perplexity, window_ids

    path = tiny_model_factory("gqa")
    ppl, count = perplexity(path, TEXT, window=48, dtype="float32")
    windows = window_ids(AutoTokenizer.from_pretrained(path), TEXT, 48)
    assert count == 47 * len(windows) and len(windows) >= 3
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        nll = sum(hf(torch.tensor([w]), labels=torch.tensor([w])).loss.item() * 47 for w in windows)
    assert ppl == pytest.approx(math.exp(nll / count), rel=1e-5)


def _paris(model: str) -> str:
    from aserve import LLM, SamplingParams

    llm = LLM(model, max_model_len=512, kv_cache_memory_gb=0.1)
    return llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text  # fmt: skip


@pytest.mark.slow
def test_smollm2_awq_g64_quality(tmp_path):
    """On held-out text (Alice in Wonderland; calibration is Shakespeare and Milton) the default quantiser (GPTQ in
    act order, AutoAWQ format) at g64 beats RTN g64, and greedy chat still answers Paris. Rounding alone stays at
    +8.4-8.7 % of bf16's perplexity; the 5 % bar is met with end-to-end tuning on a GPU (the next test).
    bench/awq_quality.py prints the full table."""
    from aserve.quantize.perplexity import perplexity
    from aserve.quantize.quantize import data_path, quantize_model

    with open(data_path("heldout.txt")) as f:
        text = f.read()
    ppl = {"bf16": perplexity(None, text, max_windows=24)[0]}
    for method in ("rtn", "gptq"):
        quantize_model(None, str(tmp_path / method), group_size=64, method=method, progress=False)
        ppl[method] = perplexity(str(tmp_path / method), text, max_windows=24)[0]
    assert ppl["bf16"] < ppl["gptq"] < ppl["rtn"], ppl
    assert "Paris" in _paris(str(tmp_path / "gptq"))


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="500 tuning steps of 16 windows: ~5 min on a GPU")
def test_smollm2_awq_g64_tuned_within_5_percent(tmp_path):
    """The issue's quality bar through the CLI: `aserve quantize` with end-to-end tuning on a GPU (the recipe of
    docs/quantization.md: +4.40 % on an H200) is within 5 % of bf16's perplexity on the whole held-out text, and
    greedy chat still answers Paris."""
    from aserve.cli import main as cli_main
    from aserve.quantize.perplexity import perplexity
    from aserve.quantize.quantize import data_path

    with open(data_path("heldout.txt")) as f:
        text = f.read()
    out = str(tmp_path / "tuned")
    cli_main(["quantize", "--out", out, "--tune-steps", "500", "--tune-batch", "16", "--tune-codes-lr", "2e-2",
              "--tune-generated", "2000", "--device", "cuda"])  # fmt: skip
    bf16, tuned = perplexity(None, text)[0], perplexity(out, text)[0]
    print(f"held-out perplexity: bf16 {bf16:.3f}, tuned g64 {tuned:.3f} ({100 * (tuned / bf16 - 1):+.2f} %)")
    assert tuned < 1.05 * bf16, (tuned, bf16)
    assert "Paris" in _paris(out)


@pytest.mark.parametrize("method, variant, codes_lr", [("gptq", "gqa", "0"), ("awq", "qwen2", "0.03")])
def test_tune_steps_lower_the_kl_and_keep_the_format(tiny_model_factory, tmp_path, capsys, method, variant, codes_lr):
    """`aserve quantize --tune-steps`: the scales and norms (and, with --tune-codes-lr, some codes) train against the
    float model, so the KL per token on the probe windows falls; zero points, biases and embeddings stay those of the
    untuned run, codes too unless they are trained; the checkpoint serves exactly like its dequantised weights under
    transformers. qwen2: q/k/v biases and AWQ's folded scales."""
    import re

    from test_awq_model import MAX_NEW, PROMPTS, aserve_greedy, dequantized_checkpoint
    from tiny_models import hf_greedy

    from aserve.cli import main as cli_main

    model = tiny_model_factory(variant)
    common = ["quantize", "--model", model, "--group-size", "32", "--num-samples", "4", "--seq-len", "64",
              "--method", method]  # fmt: skip
    cli_main([*common, "--out", str(tmp_path / "plain")])
    capsys.readouterr()
    cli_main([*common, "--out", str(tmp_path / "tuned"), "--tune-steps", "100", "--tune-lr", "1e-2",
              "--tune-codes-lr", codes_lr])  # fmt: skip
    out = capsys.readouterr().out
    found = re.search(r"end-to-end tuning, 100 steps in .* float model ([\d.]+) -> ([\d.]+), (\d+) codes moved", out)
    before, after, moved = float(found[1]), float(found[2]), int(found[3])
    assert after < 0.9 * before, out
    plain = load_file(f"{tmp_path}/plain/model.safetensors")
    tuned = load_file(f"{tmp_path}/tuned/model.safetensors")
    assert plain.keys() == tuned.keys()
    changed_codes = 0
    for key in plain:
        if key.endswith(".qweight"):
            changed_codes += int((unpack_int4(tuned[key]) != unpack_int4(plain[key])).sum())
        elif key.endswith((".qzeros", ".bias", "embed_tokens.weight", "lm_head.weight")):
            assert torch.equal(plain[key], tuned[key]), key
        else:  # scales and norms
            assert tuned[key].dtype == plain[key].dtype and not torch.equal(plain[key], tuned[key]), key
    assert changed_codes == moved and (moved > 0) == (codes_lr != "0")
    expected = hf_greedy(dequantized_checkpoint(str(tmp_path / "tuned"), str(tmp_path / "deq")), PROMPTS, MAX_NEW)
    assert aserve_greedy(str(tmp_path / "tuned")) == expected


def test_tune_generated_windows_join_the_tuning(tiny_model_factory, tmp_path, capsys):
    """`--tune-generated N`: the float model writes N windows continuing calibration prefixes (deterministic per
    seed), tuning runs on the calibration windows plus those (`--tune-batch` of them per step), and the checkpoint
    serves like its dequantised weights."""
    import re

    from test_awq_model import MAX_NEW, PROMPTS, aserve_greedy, dequantized_checkpoint
    from tiny_models import hf_greedy

    from aserve.cli import main as cli_main
    from aserve.quantize.quantize import self_generated_windows

    model = tiny_model_factory("gqa")
    calibration = torch.randint(3, 300, (3, 48), generator=torch.Generator().manual_seed(0))
    windows = self_generated_windows(model, calibration, 4, progress=False, prefix=16)
    assert windows.shape == (4, 48) and windows.dtype == calibration.dtype
    assert all(torch.equal(windows[i, :16], calibration[i % 3, :16]) for i in range(4))
    assert torch.equal(windows, self_generated_windows(model, calibration, 4, progress=False, prefix=16))
    assert len({tuple(w[16:].tolist()) for w in windows}) == 4  # each its own seed

    cli_main(["quantize", "--model", model, "--group-size", "32", "--num-samples", "4", "--seq-len", "64", "--out",
              str(tmp_path / "tuned"), "--tune-steps", "6", "--tune-generated", "5", "--tune-batch", "3"])  # fmt: skip
    out = capsys.readouterr().out
    found = re.search(r"KL per token to the float model ([\d.]+) -> ([\d.]+), \d+ codes moved; (\d+) windows \(5 "
                      r"self-generated\), 3 per step", out)  # fmt: skip
    assert found, out
    from transformers import AutoTokenizer

    from aserve.quantize.quantize import calibration_ids, data_path

    with open(data_path("calibration.txt"), encoding="utf-8") as f:
        shipped = len(calibration_ids(AutoTokenizer.from_pretrained(model), f.read(), 1 << 30, 64))
    assert int(found[3]) == shipped + 5
    expected = hf_greedy(dequantized_checkpoint(str(tmp_path / "tuned"), str(tmp_path / "deq")), PROMPTS, MAX_NEW)
    assert aserve_greedy(str(tmp_path / "tuned")) == expected
