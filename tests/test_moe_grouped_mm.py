"""Mixture-of-experts through torch._grouped_mm (aserve/kernels/moe_grouped_mm.py; its Triton kernels in Triton's
interpreter on CPU, torch's grouped GEMM on any device) against the pure-torch reference, and the layer's choice of
it. On a GPU torch's grouped GEMM takes bf16 with rows of whole 16-byte units only: the float32 cases and the odd
hidden size run on CPU."""

import pytest
import torch
from test_moe import DEVICE, random_layer, random_moe

from aserve.kernels import moe, moe_grouped_mm, reference

SHAPES = [(37, 8, 2, 64, 32), (70, 6, 3, 48, 40), (3, 16, 4, 32, 16), (300, 4, 2, 300, 48)]
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="float32 or an odd row size: the GPU GEMM takes neither")


@cpu_only
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", SHAPES)
def test_sorted_rows_through_grouped_mm_match_reference(tokens, experts, top_k, hidden, inter, monkeypatch):
    """Every batch through the library path (experts with no rows among them: 12 slots over 16 experts; a hidden
    size that is not a multiple of the copy's column block: 300)."""
    monkeypatch.setattr(moe_grouped_mm, "MIN_SLOTS_PER_EXPERT", 0)
    x, w13, w2, logits = random_moe(tokens, experts, hidden, inter)
    for renormalize in (True, False):
        out = moe_grouped_mm.fused_moe(x, logits, w13, w2, top_k, renormalize)
        ref = reference.fused_moe(x, w13, w2, *reference.select_experts(logits, top_k, renormalize))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sort_by_expert_lays_rows_out_in_expert_order():
    """pos is a permutation of the slots; xs's rows of expert e lie in [offs[e - 1], offs[e]) and hold x's row of the
    slot's token."""
    x, _, _, logits = random_moe(29, 6, 16, 8, seed=2)
    weights, xs, pos, offs = moe_grouped_mm.sort_by_expert(x, logits, 3, True)
    ref_w, ids = reference.select_experts(logits, 3, True)
    torch.testing.assert_close(weights, ref_w)
    pos, offs = pos.long().cpu(), offs.long().cpu()
    assert sorted(pos.tolist()) == list(range(29 * 3))
    assert offs.tolist() == torch.bincount(ids.flatten().cpu(), minlength=6).cumsum(0).tolist()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), offs[:-1]])
    for s, row in enumerate(pos.tolist()):
        e = ids.flatten()[s].item()
        assert starts[e] <= row < offs[e]
        assert torch.equal(xs[row], x[s // 3])


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", SHAPES[:3])
def test_bf16_within_its_roundings(tokens, experts, top_k, hidden, inter, monkeypatch):
    """16-bit: the projections and the activation rounded as separate ops round them."""
    monkeypatch.setattr(moe_grouped_mm, "MIN_SLOTS_PER_EXPERT", 0)
    x, w13, w2, logits = (t.bfloat16() for t in random_moe(tokens, experts, hidden, inter, seed=5))
    out = moe_grouped_mm.fused_moe(x, logits, w13, w2, top_k, True)
    ref = reference.fused_moe(x, w13, w2, *reference.select_experts(logits, top_k, True))
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_few_rows_per_expert_and_fixed_configurations_keep_the_triton_path(monkeypatch):
    """Below MIN_SLOTS_PER_EXPERT rows per expert, or with a launch configuration given (deterministic mode), the
    call is moe.fused_moe's."""
    calls = []
    monkeypatch.setattr(moe, "fused_moe", lambda *a, **k: calls.append(a[0].shape[0]) or a[0])
    x, w13, w2, logits = (t.bfloat16() for t in random_moe(8, 4, 16, 8))
    assert 8 * 2 < moe_grouped_mm.MIN_SLOTS_PER_EXPERT * 4
    moe_grouped_mm.fused_moe(x, logits, w13, w2, 2, True)
    monkeypatch.setattr(moe_grouped_mm, "MIN_SLOTS_PER_EXPERT", 0)
    moe_grouped_mm.fused_moe(x, logits, w13, w2, 2, True, config=moe.SMALL_CONFIG)
    assert calls == [8, 8]
    moe_grouped_mm.fused_moe(x, logits, w13, w2, 2, True)
    assert calls == [8, 8]


@cpu_only
def test_the_layer_takes_it_for_large_experts_where_available(monkeypatch):
    """FusedMoE.use_triton picks the library path for large 16-bit experts where torch runs it (here: made available
    on any device, the size bound lowered to these experts), and keeps moe.py's for smaller experts, with a fixed
    configuration or the fixed-order sum."""
    monkeypatch.setattr(moe_grouped_mm, "available", lambda w13: True)
    monkeypatch.setattr(moe_grouped_mm, "MIN_SLOTS_PER_EXPERT", 0)
    x, w13, w2, layer = random_layer()
    with torch.no_grad():
        layer.use_triton()
        assert layer.triton_moe is moe.fused_moe  # 2 x 16 x 32 elements an expert: small
        monkeypatch.setattr(moe_grouped_mm, "LARGE_EXPERT_ELEMENTS", 2 * 16 * 32)
        layer.use_triton()
        assert layer.triton_moe is moe_grouped_mm.fused_moe
        # rows the GEMM's TMA loads cannot take: a hidden size of 300, an intermediate size of 20
        assert not moe_grouped_mm.chosen_for(torch.empty(8, 32, 300)) and not moe_grouped_mm.chosen_for(
            torch.empty(8, 40, 64)
        )
        out = layer(x)
        ref = reference.fused_moe(x, w13, w2, *reference.select_experts(layer.gate(x), 2, False))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        layer.use_triton(config=moe.SMALL_CONFIG)
        assert layer.triton_moe is moe.fused_moe
        layer.use_triton(fixed_order_sum=True)
        assert layer.triton_moe.func is moe.fused_moe
