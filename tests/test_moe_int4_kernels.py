"""Int4 experts kept packed (aserve/kernels/moe_int4.py, Triton's interpreter on CPU): the kernels against the
reference on the dequantised experts (aserve/kernels/moe_int4_reference.py) on both paths (the grouped GEMMs and
the few-token kernels), blocks loaded from AWQ and GPTQ tensors that keep them packed (as a GPU does), and a tiny AWQ
Mixtral whose blocks run the packed kernels inside the engine, its greedy tokens equal to transformers' on the
dequantised checkpoint. The dequantising load (CPU) and its parity: tests/test_moe_int4.py."""

import logging

import pytest
import torch
from test_awq_model import autoawq_checkpoint, dequantized_checkpoint
from test_moe import DEVICE, prompts
from test_moe_int4 import NAMES, PROJECTIONS, gptq_tensors, greedy, moe_blocks, with_mixtral_experts  # noqa: F401 (a fixture)
from tiny_models import hf_greedy

from aserve.kernels import moe, moe_decode, moe_int4, reference
from aserve.kernels import moe_int4_reference as int4_reference
from aserve.kernels.awq_reference import dequantize
from aserve.kernels.moe_int4_reference import Int4Experts
from aserve.layers.moe import FusedMoE
from aserve.layers.quantization import gptq_format, int4_moe
from aserve.layers.quantization.awq import AWQConfig
from aserve.layers.quantization.awq_format import pack_linear
from aserve.layers.quantization.gptq import GPTQConfig

# Groups of 32 (K tiles of 32): Triton 3.6 does not compile the grouped GEMM for sm_90; blocks keep such experts 16-bit
GROUP_32 = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton does not compile K tiles of 32 for sm_90")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_int4(experts: int, rows: int, cols: int, group: int, gen: torch.Generator) -> Int4Experts:
    """Random nibbles and zero points, scales that give weights of about cols ** -0.5."""
    q = torch.randint(0, 16, (experts, rows, cols), generator=gen)
    z = torch.randint(0, 16, (experts, rows, cols // group), generator=gen, dtype=torch.uint8)
    s = (torch.rand(experts, rows, cols // group, generator=gen) + 0.5) * (cols**-0.5 / 5)
    return Int4Experts(*(t.to(DEVICE) for t in (int4_reference.pack(q), z, s.half())))


def test_layout_round_trip_and_dequantisation():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (3, 5, 64), generator=gen)
    assert torch.equal(int4_reference.unpack(int4_reference.pack(q)), q)
    w = random_int4(3, 5, 64, 32, gen)
    assert w.group_size == 32 and w.shape == (3, 5, 64)
    z = w.qzeros.long().repeat_interleave(32, -1)
    want = (int4_reference.unpack(w.qweight) - z).float() * w.scales.float().repeat_interleave(32, -1)
    assert torch.equal(int4_reference.dequantize(w), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, group",
                         [(1, 8, 2, 128, 64, 64), pytest.param(3, 8, 2, 64, 96, 32, marks=GROUP_32),
                          (40, 4, 2, 256, 128, 128)])  # fmt: skip
def test_int4_fused_moe_matches_the_dequantised_reference(dtype, tokens, experts, top_k, hidden, inter, group):
    """fused_moe's own choice of path (the few-token kernels where use_decode holds), the grouped GEMMs at two
    launch configurations, and the few-token kernels at small tiles, against the reference on the dequantised
    experts (16-bit: float16, as Triton's interpreter multiplies bfloat16 wrongly)."""
    gen = torch.Generator().manual_seed(tokens + experts)
    w13, w2 = random_int4(experts, 2 * inter, hidden, group, gen), random_int4(experts, hidden, inter, group, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for renormalize in (True, False):
        routing = reference.select_experts(logits, top_k, renormalize)
        ref = int4_reference.fused_moe(x, w13, w2, *routing)
        runs = {"chosen": moe_int4.fused_moe(x, logits, w13, w2, top_k, renormalize)}
        if renormalize:
            for name in ("SMALL_CONFIG", "LARGE_CONFIG"):
                runs[name] = moe_int4.fused_moe(x, logits, w13, w2, top_k, True, getattr(moe, name))
        if renormalize and tokens == 1:
            act, weights, ids = moe_int4.gate_up(x, logits, w13, top_k, True, dict(BLOCK_N=16, BLOCK_K=32))
            assert ids.tolist() == routing[1].tolist()
            runs["few-token tiles"] = moe_int4.down_sum(act, w2, ids, weights, dict(BLOCK_N=4, BLOCK_K=64))
        for name, out in runs.items():
            assert out.dtype == dtype and relative_error(out, ref) < tol, name
        if DEVICE == "cuda" and dtype == torch.float32:
            continue  # the 16-bit kernels' tiles for many tokens take more shared memory in float32 than a GPU has
        # the 16-bit kernels on the dequantised experts compute the same
        dense13, dense2 = (int4_reference.dequantize(w).to(dtype) for w in (w13, w2))
        torch.testing.assert_close(runs["chosen"], moe.fused_moe(x, logits, dense13, dense2, top_k, renormalize),
                                   atol=1e-5 if dtype == torch.float32 else 3e-3, rtol=1e-2)  # fmt: skip


@pytest.mark.parametrize("tokens, experts", [(1, 8), (3, 24)])
def test_few_token_kernels_in_bfloat16(tokens, experts):
    """bfloat16 through the few-token kernels (no bfloat16 products there, which Triton's interpreter gets wrong):
    within the 16-bit kernels' rounding of the reference, and close to those kernels on the dequantised experts."""
    assert moe_decode.use_decode(tokens, 2, experts)
    gen = torch.Generator().manual_seed(tokens)
    w13, w2 = random_int4(experts, 128, 128, 64, gen), random_int4(experts, 128, 64, 32, gen)
    x = torch.randn(tokens, 128, generator=gen).to(DEVICE, torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    out = moe_int4.fused_moe(x, logits, w13, w2, 2, True)
    dense13, dense2 = (int4_reference.dequantize(w).bfloat16() for w in (w13, w2))
    assert out.dtype == torch.bfloat16
    assert relative_error(out, int4_reference.fused_moe(x, w13, w2, *reference.select_experts(logits, 2, True))) < 3e-2
    assert relative_error(out, moe.fused_moe(x, logits, dense13, dense2, 2, True)) < 1e-2


def test_fixed_order_sum_gives_a_token_the_same_bits_in_any_batch():
    gen = torch.Generator().manual_seed(5)
    w13, w2 = random_int4(8, 96, 64, 32, gen), random_int4(8, 64, 48, 16, gen)
    x = torch.randn(21, 64, generator=gen).to(DEVICE)
    logits = torch.randn(21, 8, generator=gen).to(DEVICE)
    run = lambda rows: moe_int4.fused_moe(x[rows], logits[rows], w13, w2, 2, True, moe.SMALL_CONFIG,  # noqa: E731
                                          fixed_order_sum=True)  # fmt: skip
    full = run(slice(None))
    for rows in (slice(20, 21), slice(0, 5)):
        assert torch.equal(run(rows), full[rows])


@pytest.mark.parametrize("fmt, group, tokens", [("awq", 64, 1), ("awq", 64, 40), ("gptq", 64, 3), ("gptq", -1, 1)])
def test_int4_blocks_keep_their_experts_packed(monkeypatch, caplog, fmt, group, tokens):
    """AWQ and GPTQ (act order off) tensors loaded as a GPU loads them: the block holds the packed layout (what the
    reference dequantises is exactly the checkpoint's weights) and its forward, the int4 kernels, computes what the
    reference computes on the dequantised experts."""
    monkeypatch.setattr(int4_moe, "keeps_packed", lambda device: True)
    monkeypatch.setattr(int4_moe, "_logged", set())
    experts, hidden, inter = 4, 64, 64
    gen = torch.Generator().manual_seed(7)
    config = AWQConfig(group_size=group) if fmt == "awq" else GPTQConfig(group_size=group)
    layer = FusedMoE(experts, 2, hidden, inter, renormalize=True, quant_config=config, expert_names=NAMES)
    want13 = torch.empty(experts, 2 * inter, hidden)
    want2 = torch.empty(experts, hidden, inter)
    for e in range(experts):
        for param_name, shard in PROJECTIONS:
            rows = slice(None) if shard is None else slice(shard * inter, (shard + 1) * inter)
            target = want13 if param_name == "w13" else want2
            w = torch.randn(target[e, rows].shape, generator=gen) / 8
            if fmt == "awq":
                packed = pack_linear(w, group)
                target[e, rows] = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], group).t()
            else:
                packed = gptq_tensors(w, group, False, gen)
                target[e, rows] = gptq_format.dequantize(*packed.values(), version=1)
            for part, t in packed.items():
                layer.load_expert_packed(param_name, e, shard, part, t)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.randn(experts, hidden, generator=gen))
    layer.to(DEVICE)
    with caplog.at_level(logging.INFO, logger="aserve"):
        layer.process_weights_after_loading()
    assert [r.message for r in caplog.records if "int4 experts kept packed" in r.message]
    assert layer.w13.dtype == torch.int32 and layer.w13.shape == (experts, 2 * inter, hidden // 8)
    assert layer.kernel is int4_moe.int4_fused and layer.w2_scales.dtype == torch.float16
    w13, w2 = int4_moe.packed_experts(layer)
    assert torch.equal(int4_reference.dequantize(w13).cpu(), want13)
    assert torch.equal(int4_reference.dequantize(w2).cpu(), want2)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    with torch.no_grad():
        routing = reference.select_experts(layer.gate(x), 2, True)
        ref = reference.fused_moe(x, want13.to(DEVICE), want2.to(DEVICE), *routing)
        assert relative_error(layer(x), ref) < 1e-5
    assert moe_decode.use_decode(tokens, 2, experts) == (tokens == 1)


def dummy_int4_block(monkeypatch, group_size: int) -> FusedMoE:
    """An AWQ block loaded as `--load-format dummy` loads it where the int4 kernels would run: random packed words
    only."""
    monkeypatch.setattr(int4_moe, "keeps_packed", lambda device: True)
    layer = FusedMoE(4, 2, 64, 64, renormalize=True, quant_config=AWQConfig(group_size=group_size), expert_names=NAMES)
    layer.to_empty(device=DEVICE)
    for w in (layer.w13, layer.w2):
        w.data.random_(-(2**31), 2**31)
    layer.process_weights_after_loading()
    return layer


def test_dummy_weights_give_packed_experts_their_groups(monkeypatch):
    """`--load-format dummy` draws only the packed weights: the block makes up zero points and scales (weights of
    about N(0, 0.02)) instead of computing with uninitialised ones."""
    layer = dummy_int4_block(monkeypatch, group_size=64)
    w = int4_reference.dequantize(int4_moe.packed_experts(layer)[0])
    assert torch.isfinite(w).all() and 0.005 < w.std() < 0.05


@pytest.mark.usefixtures("with_mixtral_experts")
def test_tiny_awq_mixtral_runs_packed_experts_in_the_engine(tiny_model_factory, tmp_path, monkeypatch, caplog):
    """The engine with every block on the int4 kernels (as on a GPU; Triton's interpreter here), chunked prefill:
    the greedy tokens of transformers on the dequantised checkpoint."""
    monkeypatch.setattr(int4_moe, "keeps_packed", lambda device: True)
    awq_dir = autoawq_checkpoint(tiny_model_factory("mixtral"), str(tmp_path / "awq"), 64, skip=("gate",))
    ps = prompts(8, (5, 21))
    expected = hf_greedy(dequantized_checkpoint(awq_dir, str(tmp_path / "deq")), ps, 6)
    with caplog.at_level(logging.INFO, logger="aserve"):
        llm, got = greedy(awq_dir, ps, 6, quantization="awq")
    blocks = moe_blocks(llm)
    assert blocks and all(b.kernel is int4_moe.int4_fused and b.w13.dtype == torch.int32 for b in blocks)
    assert len([r for r in caplog.records if "int4 experts kept packed" in r.message]) == 1
    assert got == expected


def test_groups_of_32_keep_their_experts_16_bit(monkeypatch):
    """Where the int4 kernels would run, groups that are not multiples of 64 are dequantised at load instead."""
    layer = dummy_int4_block(monkeypatch, group_size=32)
    assert layer.w13.dtype == layer.params_dtype and layer.kernel is not int4_moe.int4_fused
