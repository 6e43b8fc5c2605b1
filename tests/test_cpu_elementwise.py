"""The CPU element-wise kernels (aserve/kernels/cpu.py) against the torch versions in
aserve/layers/elementwise.py, which follow HF's eager code op by op."""

import pytest
import torch

from aserve.kernels import cpu
from aserve.layers import elementwise, rotary

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no working C compiler")


def close(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    else:  # the same roundings; an input a hair from a rounding boundary may land one bf16 step away
        diff = (a.float() - b.float()).abs()
        assert (diff <= b.float().abs() * 2**-7 + 1e-6).all() and (diff > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_add_rms_norm(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, 96, generator=gen).to(dtype) for _ in range(2))
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    for residual in (None, r):
        got, expected = cpu.add_rms_norm(x, residual, w, 1e-5), elementwise.add_rms_norm(x, residual, w, 1e-5)
        close(got[0], expected[0], dtype)
        close(got[1], expected[1], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_split(dtype):
    gen = torch.Generator().manual_seed(2)
    H, Hkv, D, T = 6, 2, 16, 4
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype)
    rot = rotary.RotaryEmbedding(D, 64, 10000.0, {"rope_type": "default"})
    rot.materialize(torch.device("cpu"))
    cos, sin = rot(torch.tensor([0, 3, 9, 40]), dtype)
    for got, expected in zip(cpu.rotary_split(qkv, cos, sin, H, Hkv, D),
                             elementwise.split_rotate_qkv(qkv, cos, sin, H, Hkv, D)):  # fmt: skip
        close(got, expected.contiguous(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gate_up = (torch.randn(3, 2 * 80, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    close(cpu.silu_mul(gate_up), elementwise.silu_and_mul(gate_up), dtype)
