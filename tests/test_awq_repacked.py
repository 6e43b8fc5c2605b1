"""The M = 1 AWQ GEMV over awq_repack's layout (kernels/awq.py) against the pure-torch reference: the layout itself
in torch, the kernel through Triton's interpreter on CPU at small shapes (the asm helpers' tl twins), on a GPU the
same with the asm; and AWQLinear's use of the repacked copy."""

import pytest
import torch
import triton
import triton.language as tl
from test_awq_kernels import DEVICE, random_awq, rel_err

from kernels import awq
from kernels.awq import _fx_add, _silu_fx_resolve
from kernels.awq_reference import awq_matmul, dequantize, unpack_int4

DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def f16_halves(words: torch.Tensor) -> torch.Tensor:
    """int32 [...] of f16x2 -> float32 [..., 2] (low half, high half)."""
    h = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], -1).to(torch.int16)
    return h.view(torch.float16).float()


def loaded_layer(k: int, n: int, seed: int, bias: bool):
    """An AWQLinear (group 128, Triton backend) with random_awq(k, n, 128, seed)'s weights loaded -> (layer,
    qweight, qzeros, scales, bias or None)."""
    from aserve.quantization.awq_linear import AWQLinear

    layer = AWQLinear(k, n, bias=bias, group_size=128).to(DEVICE)
    layer.backend = "triton"
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
    assert [awq._repacked_tiles_m1(k // 128, n // 128, 132) for k, n in shapes] == [1, 2, 4, 4, 8, 1, 1]
    assert awq._repacked_tiles_m1(32, 20000, 132) == 16 and awq._repacked_tiles_m1(3, 20000, 132) == 1
    # a wave of 2 programs: 512 x 256 (4 K tiles, 2 column blocks) runs 4 tiles per program, still correct
    sms = awq._num_sms(torch.device(DEVICE).index)
    monkeypatch.setattr(awq, "REPACKED_GEMV1_PER_SM", 2 / sms)
    assert awq._repacked_tiles_m1(4, 2, sms) == 4
    qweight, qzeros, scales, _ = random_awq(512, 256, 128, seed=5)
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    assert rel_err(awq.awq_gemv_repacked(x, packed), awq_matmul(x.float(), qweight, qzeros, scales, 128)) < 2e-3


def test_awq_linear_keeps_a_repacked_copy():
    """M = 1 runs over the copy made on the first call; loading weights drops it (made again from the new ones);
    a layer the layout does not fit (group 64) keeps the AutoAWQ kernel."""
    from aserve.quantization.awq_linear import AWQLinear

    for k, n, g in ((256, 128, 128), (256, 128, 64)):
        layer = AWQLinear(k, n, bias=True, group_size=g).to(DEVICE)
        layer.backend = "triton"
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
    SiLU·mul) = this GEMV's output through kernels/fused.py's silu_and_mul, bit for bit; counters back at 0."""
    from kernels.fused import silu_and_mul

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


@pytest.mark.parametrize("case, m, rows", [(c, 1, 1) for c in CASES] + [(CASES[1], 3, 2)])  # 3 rows: interpreter-slow
def test_repacked_gemv_fixed_point_sum(monkeypatch, case, m, rows):
    """REPACKED_GEMV1_FIXED_POINT (the split-K sum in 64-bit fixed point, one atomic per column): close to the
    reference, the same output on every launch, the accumulators back at zero; a NaN in a row's input gives that
    row NaN outputs (the poison) and still leaves the accumulators at zero."""
    monkeypatch.setattr(awq, "REPACKED_GEMV1_FIXED_POINT", True)
    k, n, tiles, with_bias = case
    qweight, qzeros, scales, bias = random_awq(k, n, 128, seed=k + n + 3)
    bias = bias.half() if with_bias else None
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    acc = awq._shared_accumulators(n, torch.device(DEVICE))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    out = awq.awq_gemv_repacked(x, packed, bias, None, tiles, rows)
    assert torch.equal(awq.awq_gemv_repacked(x, packed, bias, None, tiles, rows), out) and not acc.any()
    ref = awq_matmul(x.float(), qweight, qzeros, scales, 128, None if bias is None else bias.float())
    assert rel_err(out, ref) < REL_TOL[torch.float16]
    x[0, 5] = float("nan")
    out = awq.awq_gemv_repacked(x, packed, bias, None, tiles, rows)
    assert out[0].isnan().all() and not out[1:].isnan().any() and not acc.any()


@pytest.mark.parametrize("fixed, m, rows, silu", [(False, 1, 1, False), (True, 1, 1, False), (False, 3, 2, False),
                                                   (True, 1, 1, True)])  # fmt: skip
def test_repacked_gemv_prefetch_options_change_no_output(monkeypatch, fixed, m, rows, silu):
    """REPACKED_GEMV1_CLAMPED_PREFETCH (unmasked prefetches: the last tile's next is itself, a missing second row
    reads the first's inputs) and REPACKED_GEMV1_L2_PREFETCH (a cache hint: no-op in the interpreter) give the same
    outputs, bit for bit, as without them."""
    k, n, tiles = 512, 256, 2
    qweight, qzeros, scales, bias = random_awq(k, n, 128, seed=13)
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(13)).to(DEVICE, torch.float16)
    monkeypatch.setattr(awq, "REPACKED_GEMV1_FIXED_POINT", fixed)
    expected = awq.awq_gemv_repacked(x, packed, bias.half(), None, tiles, rows, silu_mul_out=silu)
    monkeypatch.setattr(awq, "REPACKED_GEMV1_CLAMPED_PREFETCH", True)
    monkeypatch.setattr(awq, "REPACKED_GEMV1_L2_PREFETCH", True)
    assert torch.equal(awq.awq_gemv_repacked(x, packed, bias.half(), None, tiles, rows, silu_mul_out=silu), expected)


def test_awq_linear_fixed_point_keeps_its_own_accumulators(monkeypatch):
    """With REPACKED_GEMV1_FIXED_POINT an AWQLinear sums its K splits in accumulators of its own (made on the first
    call), left at zero; without it, it makes none."""
    k, n = 512, 128  # 4 K tiles: split 4 at M = 1, 2 at M = 3
    layer, qweight, qzeros, scales, bias = loaded_layer(k, n, 8, bias=True)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.float16)
    layer(x[:1])
    assert layer.__dict__.get("gemv_accumulators") is None
    monkeypatch.setattr(awq, "REPACKED_GEMV1_FIXED_POINT", True)
    for m in (1, 3):
        ref = awq_matmul(x[:m].float(), qweight, qzeros, scales, 128, bias.float())
        assert rel_err(layer(x[:m]), ref) < REL_TOL[torch.float16]
        acc = layer.__dict__["gemv_accumulators"]
        assert acc.shape == (awq.REPACKED_GEMV1_MAX_M, n) and acc.dtype == torch.int64 and not acc.any()


@pytest.mark.parametrize("k, tiles, m, rows", [(128, None, 1, 1), (512, 2, 1, 1), (512, 2, 3, 2)])
def test_repacked_silu_mul_out_with_fixed_point_is_bit_identical(monkeypatch, k, tiles, m, rows):
    """With REPACKED_GEMV1_FIXED_POINT the SiLU·mul path sums in the same fixed point (M = 1: programs over a gate
    block and its up block, through the accumulators; more rows: the partials): still the plain GEMV's output
    through silu_and_mul, bit for bit, counters and accumulators back at zero; a NaN input poisons the output."""
    from kernels.fused import silu_and_mul

    monkeypatch.setattr(awq, "REPACKED_GEMV1_FIXED_POINT", True)
    n = 512
    qweight, qzeros, scales, bias = random_awq(k, n, 128, seed=k + 10)
    packed = awq.awq_repack(qweight, qzeros, scales, 128)
    counters = awq.gemv_counters(n, DEVICE)
    acc = awq._shared_accumulators(n, torch.device(DEVICE))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.float16)
    fused = awq.awq_gemv_repacked(x, packed, bias.half(), counters, tiles, rows, silu_mul_out=True)
    assert torch.equal(fused, silu_and_mul(awq.awq_gemv_repacked(x, packed, bias.half(), counters, tiles, rows)))
    assert not counters.any() and not acc.any()
    if m == 1:  # the programs over a gate and an up block (3 rows: the partials, as without the option)
        x[0, 3] = float("nan")
        fused = awq.awq_gemv_repacked(x, packed, bias.half(), counters, tiles, rows, silu_mul_out=True)
        assert fused.isnan().all() and not counters.any() and not acc.any()


def test_awq_linear_applies_silu_mul_for_an_mlp():
    """AWQLinear.fuses_silu_mul / forward_silu_mul_out (what the Llama MLP calls for small decode batches): only
    once the repacked copy exists, up to REPACKED_GEMV1_MAX_M rows of fp16 / bf16, outputs a multiple of 256."""
    from aserve.quantization.awq_linear import AWQLinear
    from kernels.fused import silu_and_mul

    k, n = 256, 256
    layer = loaded_layer(k, n, 6, bias=False)[0]
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    assert not layer.fuses_silu_mul(x)  # no copy yet: the MLP runs the layer (which makes it), then silu_and_mul
    expected = silu_and_mul(layer(x))
    assert layer.fuses_silu_mul(x) and not layer.fuses_silu_mul(x.float())
    assert not layer.fuses_silu_mul(torch.zeros(awq.REPACKED_GEMV1_MAX_M + 1, k, device=DEVICE, dtype=x.dtype))
    assert torch.equal(layer.forward_silu_mul_out(x), expected)
    narrow = AWQLinear(k, 128, bias=False, group_size=128).to(DEVICE)
    narrow.backend = "triton"
    narrow.__dict__["repacked"] = awq.awq_repack(*random_awq(k, 128, 128, seed=7)[:3], 128)
    assert not narrow.fuses_silu_mul(x)  # 64 + 64 outputs: no whole column block per half


def test_awq_linear_silu_mul_with_fixed_point_uses_its_own_accumulators(monkeypatch):
    """With REPACKED_GEMV1_FIXED_POINT, forward_silu_mul_out at M = 1 (programs over a gate block and its up block,
    split K) sums in the layer's own accumulators, left at zero."""
    monkeypatch.setattr(awq, "REPACKED_GEMV1_FIXED_POINT", True)
    k, n = 512, 256
    layer, qweight, qzeros, scales, _ = loaded_layer(k, n, 12, bias=False)
    layer.repack()
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.float16)
    ref = awq_matmul(x.float(), qweight, qzeros, scales, 128)
    assert rel_err(layer.forward_silu_mul_out(x), torch.nn.functional.silu(ref[:, :128]) * ref[:, 128:]) < 4e-3
    acc = layer.__dict__["gemv_accumulators"]
    assert acc.shape == (awq.REPACKED_GEMV1_MAX_M, n) and not acc.any()


# -- M > 1 (and float32) over the repacked copy, and AWQLinear holding only that copy ------------------------------


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
    from aserve.quantization.awq_linear import AWQLinear

    k, n = 256, 256
    layer, qweight, qzeros, scales, bias = loaded_layer(k, n, 11, bias=True)
    assert layer.repack() and layer.autoawq_dropped
    assert layer.qweight.numel() == layer.qzeros.numel() == layer.scales.numel() == 0
    assert torch.equal(layer.dequantized_weight(torch.float32), dequantize(qweight, qzeros, scales, 128).t())
    for backend, m, dtype in (("triton", 1, torch.float16), ("triton", 1, torch.float32), ("triton", 4, torch.float16),
                              ("triton", 7, torch.float16), ("triton", 20, torch.float32),
                              ("torch", 3, torch.float32)):  # fmt: skip
        layer.backend = backend
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
        ref = awq_matmul(x.float(), qweight, qzeros, scales, 128, bias.float())
        assert rel_err(layer(x), ref) < (1e-5 if dtype == torch.float32 else REL_TOL[dtype]), (backend, m, dtype)
    with pytest.raises(RuntimeError, match="repack"):
        layer.load_output_slice(layer.scales, 0, n, scales)

    small = AWQLinear(k, 64 + 8, bias=False, group_size=128).to(DEVICE)  # 72 outputs: not a whole column block
    assert not small.repack() and not small.autoawq_dropped and small.qweight.numel() == k * 9


@triton.jit
def _dual_end_probe(acc_ptr, vals_ptr, state_ptr, out_ptr, split_k, PROG: tl.constexpr, STEP: tl.constexpr,
                    C: tl.constexpr):  # fmt: skip
    """One step of dual program PROG's end, one launch per step, so that a test can order two programs' atomics
    as the interpreter (which runs programs one after another) never would: STEP 0 its gate add, 1 its up add
    (kernels.awq._fx_add: last and word kept in state [PROG, 4, C]), 2 the handshake (_silu_fx_resolve: fin, gate
    and up words -> out [PROG, 3, C])."""
    rc = tl.arange(0, C)
    state = state_ptr + PROG * 4 * C + rc
    if STEP == 0:
        last, word = _fx_add(acc_ptr + rc, tl.load(vals_ptr + PROG * 2 * C + rc), split_k)
        tl.store(state, last.to(tl.int64))
        tl.store(state + C, word)
    elif STEP == 1:
        last, word = _fx_add(acc_ptr + C + rc, tl.load(vals_ptr + (PROG * 2 + 1) * C + rc), split_k)
        tl.store(state + 2 * C, last.to(tl.int64))
        tl.store(state + 3 * C, word)
    else:
        fin, wg, wu = _silu_fx_resolve(acc_ptr + rc, tl.load(state) != 0, tl.load(state + C), acc_ptr + C + rc,
                                       tl.load(state + 2 * C) != 0, tl.load(state + 3 * C))  # fmt: skip
        out = out_ptr + PROG * 3 * C + rc
        tl.store(out, fin.to(tl.int64))
        tl.store(out + C, wg)
        tl.store(out + 2 * C, wu)


@pytest.mark.parametrize("first", [0, 1])
def test_dual_silu_handshake_when_gate_and_up_have_different_last_programs(first):
    """Two programs of a K split of 2: program 0 adds its gate sums, program 1 both, then program 0 its up sums,
    so program 1 was the last on gate and program 0 on up. Whichever of them flips first, only the second finishes
    the columns, with both totals exact (the gate total from the flip, or the up total read back)."""
    c, split_k = 16, 2
    gen = torch.Generator().manual_seed(11)
    vals = torch.randint(-(2**40), 2**40, (2, 2, c), generator=gen, dtype=torch.int64).to(DEVICE)  # [prog, g/u, c]
    acc = torch.zeros(2 * c, dtype=torch.int64, device=DEVICE)
    state = torch.zeros(2, 4, c, dtype=torch.int64, device=DEVICE)
    out = torch.zeros(2, 3, c, dtype=torch.int64, device=DEVICE)
    for prog, step in ((0, 0), (1, 0), (1, 1), (0, 1), (first, 2), (1 - first, 2)):
        _dual_end_probe[(1,)](acc, vals, state, out, split_k, PROG=prog, STEP=step, C=c)
    assert state[1, 0].all() and not state[1, 2].any() and state[0, 2].all() and not state[0, 0].any()
    assert not out[first, 0].any() and out[1 - first, 0].all()  # only the second to flip finishes
    unit = 2**58
    for words, total in ((out[1 - first, 1], vals[:, 0].sum(0)), (out[1 - first, 2], vals[:, 1].sum(0))):
        assert torch.equal((words & (unit - 1)) - split_k * 2**51, total)
