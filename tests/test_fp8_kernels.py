"""The 8-bit weight-only GPU kernels' variants against the pure-torch reference (Triton's interpreter on CPU: float32
and fp16 activations, its bf16 tl.dot is not exact there): the scaled GEMV's launch configuration chosen per weight
shape through the FP8 layer, fp8_matmul's configuration by rows, the shared 8-bit matmul with split K for e4m3 and
int8 weights, and bench/fp8_tune.py's sweep (run on CPU tensors with stand-in timings) printing table entries that
load."""

import ast
import importlib.util
import pathlib
import re

import pytest
import torch
from test_fp8_checkpoints import fused_fp8_layer

from aserve.kernels import fp8_gemv, gemv, int8, scaled_matmul
from aserve.kernels.fp8_reference import fp8_weight_only_linear
from aserve.kernels.fused import silu_and_mul
from aserve.layers.quantization import fp8 as fp8_method
from aserve.layers.quantization.fp8 import quantize_per_channel
from aserve.layers.quantization.fp8_config import Fp8Config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=2e-3)}


def e4m3_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w, scale = quantize_per_channel(torch.randn(n, k, generator=gen))
    return w.to(DEVICE), scale.to(DEVICE), torch.randn(n, generator=gen)


def test_the_fp8_layer_takes_its_shapes_gemv_configuration(monkeypatch):
    """SCALED_GEMV_CONFIGS' entries for a layer's shape (96 x 64: q/k/v-like; with SiLU·mul fused) are what the
    layer runs at one row, chosen when it loads."""
    row = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)
    silu = dict(BLOCK_N=8, BLOCK_K=64, num_warps=4, num_stages=2)
    monkeypatch.setitem(gemv.SCALED_GEMV_CONFIGS, (96, 64, False), row)
    monkeypatch.setitem(gemv.SCALED_GEMV_CONFIGS, (96, 64, True), silu)
    monkeypatch.setattr(fp8_method, "has_fp8_tensor_cores", lambda device: True)
    used = []
    real = gemv.scaled_gemv
    monkeypatch.setattr(gemv, "scaled_gemv", lambda *a, **kw: used.append(a[4]) or real(*a, **kw))
    layer, weight, scale = fused_fp8_layer(Fp8Config.from_config({"quant_method": "fp8"}))
    layer.process_weights_after_loading()
    assert layer.gemv_config == row and layer.gemv_silu_config == silu
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2)).half()
    torch.testing.assert_close(layer(x), fp8_weight_only_linear(x, weight, scale, layer.bias), **TOL[torch.float16])
    gate_up = torch.randn(1, 128, generator=torch.Generator().manual_seed(3)).half()
    want = fp8_weight_only_linear(silu_and_mul(gate_up), weight, scale, layer.bias)
    torch.testing.assert_close(layer.forward_silu_mul_in(gate_up), want, **TOL[torch.float16])
    assert used == [row, silu]


def test_fp8_matmul_takes_its_configuration_by_rows(monkeypatch):
    configs = {m: {**fp8_gemv.MATMUL_CONFIG, "BLOCK_K": 16 << i, "SPLIT_K": i} for i, m in enumerate((2, 4, 16), 1)}
    monkeypatch.setattr(fp8_gemv, "MATMUL_CONFIGS", (*configs.items(), (None, None)))
    used = []
    real = scaled_matmul.scaled_matmul
    monkeypatch.setattr(scaled_matmul, "scaled_matmul", lambda *a, **kw: used.append(a[4]) or real(*a, **kw))
    w, scale, bias = e4m3_weight(48, 192, 4)
    for m, bucket in ((2, 2), (3, 4), (5, 16), (16, 16)):
        x = torch.randn(m, 192, generator=torch.Generator().manual_seed(m))
        got = fp8_gemv.fp8_small_m(x.to(DEVICE), w, scale, bias.to(DEVICE))
        assert used[-1] == configs[bucket]
        torch.testing.assert_close(got.cpu(), fp8_weight_only_linear(x, w.cpu(), scale.cpu(), bias), **TOL[x.dtype])
    assert fp8_gemv.matmul_config(17) is None and fp8_gemv.MAX_ROWS == 16  # the shipped table: 2 .. 16 rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["e4m3", "int8"])
@pytest.mark.parametrize("m, split_k, group_m", [(5, 2, 1), (37, 3, 2)])
def test_shared_8bit_matmul_with_split_k_matches_the_reference(kind, m, split_k, group_m, dtype):
    n, k = 70, 96  # N and M tails; K = 3 tiles of 32 (+ no tail) split 2 or 3 ways
    w, scale, bias = e4m3_weight(n, k, m)
    if kind == "int8":
        w = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(m), dtype=torch.int8)
        w = w.to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).to(dtype)
    want = fp8_weight_only_linear(x, w.cpu().float(), scale.cpu(), bias.to(dtype))  # the same sum for int8
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=group_m, SPLIT_K=split_k, num_warps=4, num_stages=2)
    args = [x.to(DEVICE), w, scale, bias.to(dtype).to(DEVICE)]
    got = fp8_gemv.fp8_matmul(*args, config=cfg) if kind == "e4m3" else int8.int8_matmul(*args, config=cfg)
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])
    assert torch.equal(scaled_matmul.scaled_matmul(*args, cfg, evict_first=kind == "e4m3"), got)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run of the sweep (a GPU runs the bench itself)")
def test_the_tuning_sweep_prints_config_table_entries_that_load(monkeypatch, capsys):
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "fp8_tune.py"
    spec = importlib.util.spec_from_file_location("fp8_tune", path)
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    timings = iter(range(1000, 1, -1))  # stand-in timings: later candidates are faster
    monkeypatch.setattr(tune, "bench_us", lambda fn, *a: float(next(timings)) / 100)
    monkeypatch.setattr(tune, "DEVICE", "cpu")
    monkeypatch.setattr(tune, "DTYPE", torch.float16)
    monkeypatch.setattr(tune, "GEMV_TILES", ((8, 128, 4),))
    monkeypatch.setattr(tune, "GEMV_STAGES", (2,))
    monkeypatch.setattr(tune, "MATMUL_ROWS", (2, 32))
    monkeypatch.setattr(tune, "MATMUL_SPACE", {16: ((32,), (64,), (2,), (1, 2)), 32: ((32,), (64,), (2,), (1,))})
    shapes = {"qkv": (48, 256), "o": (32, 256), "gate_up": (64, 256), "down": (32, 512)}
    weights = {name: e4m3_weight(n, k, n)[:2] for name, (n, k) in shapes.items()}
    tune.tune(shapes, weights, budget_s=600)
    out = capsys.readouterr().out
    assert not re.search(r"FAILED: .*(GEMV|fp8_matmul)", out) and ", 0 skipped" in out and "compiled " in out
    gemv_table = out[out.index("SCALED_GEMV_CONFIGS") :].split("= ", 1)[1].split("\n}\n")[0] + "\n}"
    entries = eval(gemv_table, {"dict": dict})  # the text to paste into gemv.py
    assert set(entries) == {(48, 256, False), (32, 256, False), (64, 256, False), (32, 512, False), (32, 512, True)}
    # the last candidate swept (after the table's configuration) has the fastest stand-in timing
    best = dict(BLOCK_N=8, BLOCK_K=128, num_warps=4, num_stages=2)
    assert entries[(32, 512, True)] == best
    for (n, k, silu), cfg in entries.items():
        assert gemv.scaled_gemv_config(n, k, cfg, silu) == cfg
    matmul_table = out[out.index("MATMUL_CONFIGS = ") :].split("= ", 1)[1]
    rows = ast.literal_eval(re.sub(r"dict\(([^)]*)\)", lambda mt: "{" + re.sub(r"(\w+)=", r"'\1': ", mt[1]) + "}",
                                   matmul_table))  # fmt: skip
    assert [m for m, _ in rows] == [2, 32, None] and all(cfg is None or cfg["GROUP_M"] == 1 for _, cfg in rows)
