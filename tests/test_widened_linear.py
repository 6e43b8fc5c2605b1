"""CPU 16-bit linears where no native 16-bit GEMM takes the weight (aserve/layers/linear.py's _widened): inputs of
WIDEN_MIN_ROWS or more rows run float32 GEMMs over widened slices of the weight, fewer rows F.linear; bf16 weights
up to ROWS_PACKED_MAX rows through the C gemm_rows over a packed copy (_rows_packed_widened)."""

import threading

import pytest
import torch
import torch.nn.functional as F

from aserve.kernels import cpu
from aserve.layers import linear
from aserve.layers.linear import Linear, UnquantizedLinearMethod


def _layer(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=bias, params_dtype=dtype)
    layer.weight.data.copy_(torch.randn(n, k, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=gen))
    UnquantizedLinearMethod().use_widened(layer)
    layer.kernel = linear._widened  # (bf16 with the C kernels: _rows_packed_widened up to ROWS_PACKED_MAX rows)
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, bias", [(1536, 576, False), (700, 3000, True), (5, 2048, True)])
@pytest.mark.parametrize("rows", [1, 7, 8, 33])
def test_widened_matches_float32_sums_of_the_same_values(monkeypatch, dtype, n, k, bias, rows):
    monkeypatch.setattr(linear, "WIDEN_CHUNK", 1 << 16)  # several slices of the weight, the last one short
    layer = _layer(n, k, dtype, bias, seed=n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    if rows < linear.WIDEN_MIN_ROWS:
        assert torch.equal(got, F.linear(x, layer.weight, layer.bias))
    else:
        want = torch.mm(x.float(), layer.weight.float().t())
        if layer.bias is not None:
            want += layer.bias.float()
        torch.testing.assert_close(got, want.to(dtype))  # float32 sums (BLAS may order them by N), rounded once


def test_threads_keep_their_own_scratch():
    layer = _layer(512, 1024, torch.bfloat16, False, seed=1)
    xs = [torch.randn(16, 1024, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(4)]
    want = [layer(x) for x in xs]
    got = [None] * len(xs)

    def run(i: int) -> None:
        for _ in range(20):
            got[i] = layer(xs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bf16_layers_widen_where_onednn_cannot_prepack(monkeypatch):
    monkeypatch.setattr(UnquantizedLinearMethod, "use_onednn", lambda self, layer: False)
    layer = _layer(64, 128, torch.bfloat16, True, seed=3)
    layer.process_weights_after_loading()
    packed = cpu.available()
    assert layer.kernel is (linear._rows_packed_widened if packed else linear._widened)
    assert layer.rows_packed is packed and (layer.packed_weight is not None) is packed


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_rows_run_gemm_rows_up_to_the_bound_then_widen(monkeypatch, bias):
    """Up to ROWS_PACKED_MAX rows: gemm_rows over the packed copy (bias added after); more: the widened GEMM. Both
    within a bf16 rounding of the float32 sums of the same values, as 3-d inputs too."""
    monkeypatch.setattr(UnquantizedLinearMethod, "use_onednn", lambda self, layer: False)
    monkeypatch.setattr(linear, "ROWS_PACKED_MAX", 20)
    layer = _layer(300, 200, torch.bfloat16, bias, seed=5)
    layer.process_weights_after_loading()
    for rows in (1, 3, 20, 21, 40):
        x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = layer(x)
        if rows <= 20:
            want = cpu.gemm_rows(layer.packed_weight, x, 300)
            want = want + layer.bias if bias else want
        else:
            want = linear.widened_linear(x, layer.weight, layer.bias)
        assert torch.equal(got, want), rows
        exact = torch.mm(x.float(), layer.weight.float().t()) + (layer.bias.float() if bias else 0)
        torch.testing.assert_close(got.float(), exact, atol=0.05, rtol=2**-6)
        assert torch.equal(layer(x.view(1, rows, 200)), got.view(1, rows, 300))
