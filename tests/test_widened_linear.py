"""CPU 16-bit linears where no native 16-bit GEMM takes the weight (aserve/layers/linear.py's _widened): inputs of
WIDEN_MIN_ROWS or more rows run float32 GEMMs over widened slices of the weight, fewer rows F.linear."""

import threading

import pytest
import torch
import torch.nn.functional as F

from aserve.layers import linear
from aserve.layers.linear import Linear, UnquantizedLinearMethod


def _layer(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=bias, params_dtype=dtype)
    layer.weight.data.copy_(torch.randn(n, k, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=gen))
    UnquantizedLinearMethod().use_widened(layer)
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
    assert layer.kernel is linear._widened
