"""AWQ Triton kernels (kernels/awq.py) against the pure-torch reference (kernels/awq_reference.py), on random
packed weights: Triton's interpreter on CPU at small shapes; on a GPU the same tests plus full shapes and bf16.

The interpreter rounds float32 -> bfloat16 by truncation and its bf16 dot is wrong, so bf16 runs on GPUs only."""

import pytest
import torch

from kernels import awq
from kernels.awq_reference import awq_matmul, dequantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# fp32: both sides sum the same float32 products in different orders. fp16/bf16: the kernels multiply in float32
# and round once; the reference rounds the weight to the activation dtype first.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def random_awq(k: int, n: int, group_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31, (k, n // 8), dtype=torch.int32, generator=gen)
    qzeros = torch.randint(-(2**31), 2**31, (k // group_size, n // 8), dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // group_size, n, generator=gen) * 0.02 + 1e-3).half()
    bias = torch.randn(n, generator=gen)
    return [t.to(DEVICE) for t in (qweight, qzeros, scales, bias)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# (M, K, N, group): N not a power of two (a partial last column tile), K several groups
GEMV_CASES = [(1, 192, 200, 64), (1, 256, 72, 32), (4, 256, 136, 32), (16, 384, 200, 128), (3, 128, 1032, 64)]
GEMM_CASES = [(17, 192, 200, 64), (40, 256, 72, 32), (70, 384, 136, 128)]


@pytest.mark.parametrize("case", GEMV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 3, None])  # None: the launch heuristic
@pytest.mark.parametrize("each_tile", [True, False])  # M = 1: reduce over K per tile / once at the end
def test_gemv_matches_reference(case, dtype, split_k, each_tile, monkeypatch):
    monkeypatch.setitem(awq.GEMV1_CONFIG, "EACH_TILE", each_tile)
    m, k, n, g = case
    qweight, qzeros, scales, bias = random_awq(k, n, g, seed=m + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    config = {"SPLIT_K": split_k} if split_k else None
    out = awq.awq_gemv(x, qweight, qzeros, scales, g, bias.to(dtype), config=config)
    ref = awq_matmul(x.float(), qweight, qzeros, scales, g, bias.to(dtype).float())
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("case", GEMM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_reference_beyond_gemv_rows(case, dtype):
    m, k, n, g = case
    qweight, qzeros, scales, bias = random_awq(k, n, g, seed=m + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    for b in (None, bias.to(dtype)):
        out = awq.awq_linear(x, qweight, qzeros, scales, g, b)
        ref = awq_matmul(x.float(), qweight, qzeros, scales, g, None if b is None else b.float())
        assert rel_err(out, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_dequantize_kernel_is_exact(group_size):
    qweight, qzeros, scales, _ = random_awq(256, 136, group_size, seed=group_size)
    ref = dequantize(qweight, qzeros, scales, group_size)
    for dtype in (torch.float32, torch.float16):  # (q - z) * s is exact in fp32; one rounding to fp16 in both
        assert torch.equal(awq.awq_dequantize(qweight, qzeros, scales, group_size, dtype), ref.to(dtype))


def test_linear_dispatch_by_rows(monkeypatch):
    """awq_linear: GEMV up to 16 rows, dequantise + matmul above; same results."""
    qweight, qzeros, scales, bias = random_awq(128, 64, 32, seed=5)
    calls = []
    for name in ("awq_gemv", "awq_dequantize"):
        fn = getattr(awq, name)
        monkeypatch.setattr(awq, name, lambda *a, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(*a, **kw))
    for m in (1, 16, 17, 32):
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        out = awq.awq_linear(x, qweight, qzeros, scales, 32, bias)
        assert rel_err(out, awq_matmul(x, qweight, qzeros, scales, 32, bias)) < 1e-5
    assert calls == ["awq_gemv", "awq_gemv", "awq_dequantize", "awq_dequantize"]


@pytest.mark.skipif(DEVICE != "cuda", reason="full shapes need a GPU (the interpreter takes minutes)")
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 2048])
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 14336), (14336, 4096)])
def test_full_shapes_gpu(m, shape):
    k, n = shape
    qweight, qzeros, scales, _ = random_awq(k, n, 128, seed=m)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    ref = awq_matmul(x.float(), qweight, qzeros, scales, 128)
    assert rel_err(awq.awq_linear(x, qweight, qzeros, scales, 128), ref) < 1e-2
