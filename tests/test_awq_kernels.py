"""AWQ Triton kernels (aserve/kernels/awq/) against the pure-torch reference (aserve/kernels/awq_reference.py), on
random packed weights: Triton's interpreter on CPU at small shapes; on a GPU the same tests plus full shapes and bf16.

The interpreter rounds float32 -> bfloat16 by truncation and its bf16 dot is wrong, so bf16 runs on GPUs only."""

import pytest
import torch

from aserve.kernels import awq
from aserve.kernels.awq import dispatch, split_k
from aserve.kernels.awq_reference import awq_matmul, dequantize

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


# (M, K, N, group): N not a power of two (a partial last column tile), K several groups. M = 1 in float32 takes the
# tl.dot kernel (in fp16 / bf16 the f16x2 one, below, which derives its K split from TILES: SPLIT_K is ignored).
GEMV_CASES = [(1, 192, 200, 64), (1, 256, 72, 32), (4, 256, 136, 32), (16, 384, 200, 128), (3, 128, 1032, 64)]
GEMM_CASES = [(17, 192, 200, 64), (40, 256, 72, 32), (70, 384, 136, 128)]
F16X2_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("case", GEMV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 3, None])  # None: the launch heuristic
def test_gemv_matches_reference(case, dtype, split_k):
    m, k, n, g = case
    qweight, qzeros, scales, bias = random_awq(k, n, g, seed=m + k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    config = {"SPLIT_K": split_k} if split_k else None
    out = awq.awq_gemv(x, qweight, qzeros, scales, g, bias.to(dtype), config=config)
    ref = awq_matmul(x.float(), qweight, qzeros, scales, g, bias.to(dtype).float())
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) < REL_TOL[dtype]


# M = 1, f16x2 kernel: (K, N, group, config overrides, bias) -> K splits of 1 (no counters), 2, 3, 4 and 16; N a
# multiple of BLOCK_N (unmasked loads) or not; R = 4, 8, 16 rows per asm call (R = 16 on BLOCK_K = 32: 2 per slice)
GEMV1_CASES = [
    (256, 72, 32, {}, True),  # BLOCK_K 32, TILES auto (1: one column block): split 8; partial column block
    (256, 72, 32, {"TILES": 2, "BLOCK_N": 64}, False),  # split 4, two tiles per program
    (192, 200, 64, {"TILES": 1}, False),  # split 3
    (384, 1032, 128, {"BLOCK_N": 128, "TILES": 3}, True),  # split 1: written directly
    (512, 256, 128, {"R": 8}, True),  # split 2, full column blocks
    (1024, 128, 64, {"TILES": 1, "R": 4}, False),  # split 16
]


@pytest.mark.parametrize("case", GEMV1_CASES)
@pytest.mark.parametrize("dtype", F16X2_DTYPES)
def test_gemv1_f16x2_matches_reference(case, dtype):
    """On CPU the interpreter runs the asm helpers' tl twins: indexing, nibble order, zero points, scales, bias and
    the counter-based split-K reduction; on a GPU the same with the asm."""
    k, n, g, config, with_bias = case
    qweight, qzeros, scales, bias = random_awq(k, n, g, seed=k + n)
    bias = bias.to(dtype) if with_bias else None
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    counters = awq.gemv_counters(n, DEVICE)
    out = awq.awq_gemv(x, qweight, qzeros, scales, g, bias, config=config, counters=counters)
    ref = awq_matmul(x.float(), qweight, qzeros, scales, g, None if bias is None else bias.float())
    assert out.dtype == dtype and out.shape == (1, n)
    assert rel_err(out, ref) < REL_TOL[dtype]
    assert not counters.any()  # every column block's last program reset its counter


def test_gemv1_tiles_per_program():
    """TILES auto: 4 or 2 K tiles per program where that leaves GEMV1_MIN_PROGRAMS programs, else 1."""
    cfg = {shape: awq.gemv_config(1, shape[1], shape[0], 128) for shape in ((4096, 4096), (4096, 14336), (14336, 4096),
                                                                              (256, 72))}  # fmt: skip
    assert [(c["TILES"], c["SPLIT_K"]) for c in cfg.values()] == [(2, 16), (4, 8), (4, 28), (1, 2)]


def test_gemv1_counters_reset_across_calls():
    """Repeated launches on the same counters (own and shared) stay correct and deterministic, and leave them at 0."""
    k, n, g = 256, 128, 64
    config = {"TILES": 1}  # split 4
    layers = [random_awq(k, n, g, seed=s)[:3] for s in (1, 2)]
    counters = awq.gemv_counters(n, DEVICE)
    for i in range(2):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(10 + i)).to(DEVICE, torch.float16)
        for weights in layers:
            ref = awq_matmul(x.float(), *weights, g)
            own = awq.awq_gemv(x, *weights, g, config=config, counters=counters)
            shared = awq.awq_gemv(x, *weights, g, config=config)  # the per-(device, N) set
            assert rel_err(own, ref) < REL_TOL[torch.float16] and torch.equal(own, shared)
    assert not counters.any() and not split_k._shared_counters(n, torch.device(DEVICE)).any()


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's f16 overflow, on purpose
@pytest.mark.parametrize("r", [8, 16])
def test_gemv1_f16_overflow_bound(r):
    """The bound of aserve/kernels/awq/f16x2.py's docstring: R rows of x/16 * (q - z) summed in f16 stay finite while
    |x| < 69871 / R (worst case, q - z = 15 everywhere), and overflow above it."""
    k = n = 128
    qweight = torch.full((k, n // 8), -1, dtype=torch.int32, device=DEVICE)  # every nibble 15
    qzeros = torch.zeros(1, n // 8, dtype=torch.int32, device=DEVICE)
    scales = torch.full((1, n), 2.0**-14, dtype=torch.float16, device=DEVICE)
    for factor, finite in ((0.98, True), (1.05, False)):
        x = torch.full((1, k), 69871 / r * factor, device=DEVICE).half()
        out = awq.awq_gemv(x, qweight, qzeros, scales, 128, config={"R": r})
        assert bool(torch.isfinite(out).all()) == finite
        if finite:
            assert rel_err(out, awq_matmul(x.float(), qweight, qzeros, scales, 128)) < 5e-3


def test_awq_linear_module_m1_keeps_its_own_counters():
    from aserve.layers.linear import Linear
    from aserve.layers.quantization.awq import AWQConfig

    k, n, g = 256, 136, 64
    qweight, qzeros, scales, bias = random_awq(k, n, g, seed=3)
    layer = Linear(k, n, bias=True, quant_config=AWQConfig(group_size=g)).to(DEVICE)
    for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("bias", bias)):
        getattr(layer, name).data.copy_(t)
    layer.quant_method.use_triton(layer)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.float16)
    ref = awq_matmul(x.float(), qweight, qzeros, scales, g, bias.float())
    for _ in range(2):
        assert rel_err(layer(x), ref) < REL_TOL[torch.float16]
    counters = layer.gemv_counters
    assert counters is not None and counters.device.type == DEVICE and not counters.any()


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
        fn = getattr(dispatch, name)  # the names awq_linear calls
        monkeypatch.setattr(dispatch, name, lambda *a, _fn=fn, _name=name, **kw: calls.append(_name) or _fn(*a, **kw))
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
