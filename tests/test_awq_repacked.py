"""The M = 1 AWQ GEMV over awq_repack's layout (aserve/kernels/awq/) against the pure-torch reference: the layout
itself in torch, the kernel through Triton's interpreter on CPU at small shapes (the asm helpers' tl twins), on a GPU
the same with the asm; and the AWQ linear method's use of the repacked copy."""

import pytest
import torch
from test_awq_kernels import DEVICE, random_awq, rel_err

from aserve.kernels import awq
from aserve.kernels.awq import tuning
from aserve.kernels.awq.gemv1_repacked import _repacked_tiles_m1
from aserve.kernels.awq_reference import awq_matmul, dequantize, unpack_int4
from aserve.layers.linear import Linear
from aserve.layers.quantization.awq import AWQConfig

DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def f16_halves(words: torch.Tensor) -> torch.Tensor:
    """int32 [...] of f16x2 -> float32 [..., 2] (low half, high half)."""
    h = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], -1).to(torch.int16)
    return h.view(torch.float16).float()


def awq_layer(k: int, n: int, bias: bool, group_size: int) -> Linear:
    """An AWQ Linear on DEVICE running the Triton kernels (weights not loaded)."""
    layer = Linear(k, n, bias=bias, quant_config=AWQConfig(group_size=group_size)).to(DEVICE)
    layer.quant_method.use_triton(layer)
    return layer


def loaded_layer(k: int, n: int, seed: int, bias: bool):
    """An AWQ Linear (group 128, Triton kernels) with random_awq(k, n, 128, seed)'s weights loaded -> (layer,
    qweight, qzeros, scales, bias or None)."""
    layer = awq_layer(k, n, bias, 128)
    qweight, qzeros, scales, b = random_awq(k, n, 128, seed=seed)
    tensors = (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)) + ((("bias", b),) if bias else ())
    for name, t in tensors:
        layer.load_output_slice(getattr(layer, name), 0, n, t)
    return layer, qweight, qzeros, scales, b if bias else None


def test_repack_layout():
    """wq[b, t, r, i, j] = qweight[128 t + 16 i + r, 16 b + j]; meta words 0-3 decode to the zero points, 4-7 to the
    scales * 16, column pair by column pair."""
    k, n = 256, 256
    qweight, qzeros, scales, _ = random_awq(k, n, 128, seed=5)
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    kt, nb = k // 128, n // 128
    wq = packed.wq.view(nb, kt, 16, 8, 16)
    for b, t, r, i, j in ((0, 0, 0, 0, 0), (1, 1, 15, 7, 15), (1, 0, 3, 5, 9), (0, 1, 9, 2, 4)):
        assert wq[b, t, r, i, j] == qweight[128 * t + 16 * i + r, 16 * b + j]
    meta = packed.meta.view(nb, kt, 8, 16).permute(1, 0, 3, 2).reshape(kt, n // 8, 8)  # [group, column group, word]
    zc = f16_halves(meta[..., :4]).reshape(kt, n)  # column 8j + 2p + h
    z = unpack_int4(qzeros).float()
    odd_pair = (torch.arange(n, device=z.device) % 8 // 2) % 2 == 1
    assert torch.equal(zc, torch.where(odd_pair, -(64 + z), 1024 + z))
    assert torch.equal(f16_halves(meta[..., 4:]).reshape(kt, n), scales.float() * 16)


def test_repack_applies_to_group_128_and_whole_column_blocks_only():
    assert awq.awq_repack(*random_awq(256, 256, 64, seed=1)[:3], 64) is None
    assert awq.awq_repack(*random_awq(256, 136, 128, seed=1)[:3], 128) is None
    assert awq.awq_repack(*random_awq(256, 128, 128, seed=1)[:3], 128) is not None


# (K, N, tiles per program, bias): K splits of 1 (written directly), 2, 4 and 8; 1-3 column blocks
CASES = [(128, 128, None, True), (512, 256, 1, False), (512, 384, 2, True), (1024, 128, None, False)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, rows", [(1, 1), (2, 1), (3, 2)])  # rows per program (odd M: one masked)
def test_repacked_gemv_matches_reference(case, dtype, m, rows):
    k, n, tiles, with_bias = case
    qweight, qzeros, scales, bias = random_awq(k, n, 128, seed=k + n)
    bias = bias.to(dtype) if with_bias else None
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    counters = awq.gemv_counters(n, DEVICE)
    for seed in (1, 2):  # twice: the counters are back at zero for the next launch
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
        out = awq.awq_gemv_repacked(x, packed, bias, counters, tiles, rows)
        ref = awq_matmul(x.float(), qweight, qzeros, scales, 128, None if bias is None else bias.float())
        assert out.dtype == dtype and out.shape == (m, n)
        assert rel_err(out, ref) < REL_TOL[dtype]
        assert not counters.any()


def test_repacked_m1_tiles_fill_one_wave(monkeypatch):
    """One-row launches take the fewest K tiles per program (of 1, 2, 4, 8, 16) whose programs fit one wave of
    REPACKED_GEMV1_PER_SM per SM (H200: 8 x 132 = 1056), else the most that divides K's tiles."""
    shapes = ((4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096), (4096, 28672), (256, 128), (384, 128))
    assert [_repacked_tiles_m1(k // 128, n // 128, 132) for k, n in shapes] == [1, 2, 4, 4, 8, 1, 1]
    assert _repacked_tiles_m1(32, 20000, 132) == 16 and _repacked_tiles_m1(3, 20000, 132) == 1
    # a wave of 2 programs: 512 x 256 (4 K tiles, 2 column blocks) runs 4 tiles per program, still correct
    sms = tuning._num_sms(torch.device(DEVICE).index)
    monkeypatch.setattr(tuning, "REPACKED_GEMV1_PER_SM", 2 / sms)
    assert _repacked_tiles_m1(4, 2, sms) == 4
    qweight, qzeros, scales, _ = random_awq(512, 256, 128, seed=5)
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    assert rel_err(awq.awq_gemv_repacked(x, packed), awq_matmul(x.float(), qweight, qzeros, scales, 128)) < 2e-3


def test_awq_linear_keeps_a_repacked_copy():
    """M = 1 runs over the copy made on the first call; loading weights drops it (made again from the new ones);
    a layer the layout does not fit (group 64) keeps the AutoAWQ kernel."""
    for k, n, g in ((256, 128, 128), (256, 128, 64)):
        layer = awq_layer(k, n, True, g)
        for seed in (3, 4):
            qweight, qzeros, scales, bias = random_awq(k, n, g, seed=seed)
            for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
                layer.load_output_slice(getattr(layer, name), 0, n, t)
            layer.load_output_slice(layer.bias, 0, n, bias)
            assert layer.repacked is None
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.float16)
            ref = awq_matmul(x.float(), qweight, qzeros, scales, g, bias.float())
            assert rel_err(layer(x), ref) < REL_TOL[torch.float16]
            assert (layer.repacked is False) == (g != 128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, tiles", [(128, None), (512, 2)])  # K splits of 1 (partials anyway) and 2
@pytest.mark.parametrize("m, rows", [(1, 1), (3, 2)])
def test_repacked_gemv_with_silu_mul_out_is_bit_identical(dtype, k, tiles, m, rows):
    """silu_mul_out=True ([gate | up] outputs; the last program of each gate / up column-block pair applies
    SiLU·mul) = this GEMV's output through aserve/kernels/fused.py's silu_and_mul, bit for bit; counters back at 0."""
    from aserve.kernels.fused import silu_and_mul

    n = 512  # gate and up 256 columns each: two column-block pairs
    qweight, qzeros, scales, bias = random_awq(k, n, 128, seed=k + 9)
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    counters = awq.gemv_counters(n, DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    fused = awq.awq_gemv_repacked(x, packed, bias.to(dtype), counters, tiles, rows, silu_mul_out=True)
    assert fused.shape == (m, n // 2) and not counters.any()
    assert torch.equal(fused, silu_and_mul(awq.awq_gemv_repacked(x, packed, bias.to(dtype), counters, tiles, rows)))
    ref = awq_matmul(x.float(), qweight, qzeros, scales, 128, bias.float())
    assert rel_err(fused, torch.nn.functional.silu(ref[:, : n // 2]) * ref[:, n // 2 :]) < 2 * REL_TOL[dtype]


def test_awq_linear_applies_silu_mul_for_an_mlp():
    """fuses_silu_mul_out / forward_silu_mul_out (what the Llama MLP calls for small decode batches): only once the
    repacked copy exists, up to REPACKED_GEMV1_MAX_M rows of fp16 / bf16, outputs a multiple of 256."""
    from aserve.kernels.fused import silu_and_mul

    k, n = 256, 256
    layer = loaded_layer(k, n, 6, bias=False)[0]
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    assert not layer.fuses_silu_mul_out(x)  # no copy yet: the MLP runs the layer (which makes it), then silu_and_mul
    expected = silu_and_mul(layer(x))
    assert layer.fuses_silu_mul_out(x) and not layer.fuses_silu_mul_out(x.float())
    assert not layer.fuses_silu_mul_out(torch.zeros(tuning.REPACKED_GEMV1_MAX_M + 1, k, device=DEVICE, dtype=x.dtype))
    assert torch.equal(layer.forward_silu_mul_out(x), expected)
    narrow = loaded_layer(k, 128, 7, bias=False)[0]
    assert narrow.quant_method.repack(narrow, drop_autoawq=False) and narrow.repacked
    assert not narrow.fuses_silu_mul_out(x)  # 64 + 64 outputs: no whole column block per half


# -- M > 1 (and float32) over the repacked copy, and an AWQ layer holding only that copy ---------------------------


@pytest.mark.parametrize("k, n", [(256, 256), (384, 128)])
def test_repacked_dequantise_is_exact(k, n):
    """The repacked copy dequantises to exactly the reference's weights, rows back in their places."""
    qweight, qzeros, scales, _ = random_awq(k, n, 128, seed=k)
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    for bp in (32, 128):
        w = awq.awq_dequantize_repacked(packed, torch.float32, dict(BP=bp))
        assert w.shape == (k, n) and torch.equal(w, dequantize(qweight, qzeros, scales, 128))


# (M, K, N, dtype, split K): float32 M = 1 (f16x2 does not take it), fp16 M = 2..16; K splits 1, 2, 3 (uneven)
DOT_CASES = [(1, 256, 128, torch.float32, None), (2, 384, 256, torch.float16, 3), (16, 256, 128, torch.float16, 1),
             (5, 512, 128, torch.float32, 2)]  # fmt: skip


@pytest.mark.parametrize("case", DOT_CASES)
@pytest.mark.parametrize("with_bias, swap", [(False, False), (True, False), (True, True)])
def test_repacked_dot_gemv_matches_reference(case, with_bias, swap):
    """swap: the kernel computes out^T = W^T x^T (the weight tile as the dot's first operand)."""
    m, k, n, dtype, split_k = case
    qweight, qzeros, scales, bias = random_awq(k, n, 128, seed=m + k)
    bias = bias.to(dtype) if with_bias else None
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    out = awq.awq_gemv_repacked_dot(x, packed, bias, dict(BP=64 if m % 2 else 32, SPLIT_K=split_k, SWAP=swap))
    ref = awq_matmul(x.float(), qweight, qzeros, scales, 128, None if bias is None else bias.float())
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else REL_TOL[dtype])


def test_awq_linear_repack_holds_the_weights_once():
    """repack() frees the AutoAWQ tensors; every M (1 and 4 in fp16: the f16x2 kernel; 1 in float32 and 7: tl.dot;
    20: dequantise) and both backends then run over the repacked copy alone; loading into it afterwards is refused.
    A layer the layout does not fit keeps its tensors."""
    k, n = 256, 256
    layer, qweight, qzeros, scales, bias = loaded_layer(k, n, 11, bias=True)
    method = layer.quant_method
    assert method.repack(layer) and layer.autoawq_dropped
    assert layer.qweight.numel() == layer.qzeros.numel() == layer.scales.numel() == 0
    assert torch.equal(method.dequantized_weight(layer, torch.float32), dequantize(qweight, qzeros, scales, 128).t())
    for backend, m, dtype in (("triton", 1, torch.float16), ("triton", 1, torch.float32), ("triton", 4, torch.float16),
                              ("triton", 7, torch.float16), ("triton", 20, torch.float32),
                              ("torch", 3, torch.float32)):  # fmt: skip
        if backend == "triton":
            method.use_triton(layer)
        else:
            method.use_torch(layer)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
        ref = awq_matmul(x.float(), qweight, qzeros, scales, 128, bias.float())
        assert rel_err(layer(x), ref) < (1e-5 if dtype == torch.float32 else REL_TOL[dtype]), (backend, m, dtype)
    with pytest.raises(RuntimeError, match="repack"):
        layer.load_output_slice(layer.scales, 0, n, scales)

    small = awq_layer(k, 64 + 8, False, 128)  # 72 outputs: not a whole column block
    assert not small.quant_method.repack(small) and not small.autoawq_dropped and small.qweight.numel() == k * 9
