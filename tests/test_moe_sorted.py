"""The fused MoE layer over the sorted layout (aserve/kernels/moe_sorted.py, opt-in by configuration; Triton's
interpreter on CPU): against the pure-torch reference with and without TMA descriptors and the copy of x in sorted
order, the layout's rows themselves, a token's bits in any batch under a fixed configuration, and bench/moe_kernel.py
--variants' table on a tiny shape."""

import importlib.util
import pathlib

import pytest
import torch
from test_moe import DEVICE, random_moe, tiles

from aserve.kernels import moe, moe_align, moe_sorted, reference

# Padding rows of the sorted layout hold whatever their buffer held (never stored into an output): NumPy warns of them
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

OPTIONS = {
    "pointers": dict(tma=False),
    "tma": dict(tma=True),
    "tma-gather": dict(tma=True, gather_x=True),
    "gather": dict(tma=False, gather_x=True),
}


def sorted_config(block_m: int, options: dict) -> dict:
    return dict(BLOCK_M=block_m, sorted=options, gate_up=tiles(16, 16, 2), down=tiles(32, 32, 1))


@pytest.mark.parametrize("options", list(OPTIONS))
def test_sorted_layout_matches_reference(options):
    """Hidden / intermediate sizes that are not multiples of the tiles (48, 40: masked K, or zero-filled by the
    descriptors; gate rows of a tile past I read up rows, never stored) and multiples of them."""
    for (tokens, experts, top_k, hidden, inter), block_m in (((19, 8, 2, 48, 40), 16), ((70, 6, 3, 64, 48), 32)):
        x, w13, w2, logits = random_moe(tokens, experts, hidden, inter, seed=tokens)
        renormalize = tokens % 2 == 1
        out = moe_sorted.fused_moe(x, logits, w13, w2, top_k, renormalize, sorted_config(block_m, OPTIONS[options]))
        ref = reference.fused_moe(x, w13, w2, *reference.select_experts(logits, top_k, renormalize))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_gate_up_stores_the_layouts_rows():
    """GEMM 1 stores each slot's activation at its row of sorted_slots (the gather of x into that order too): the
    rows of moe.py's GEMM at the slots, bit for bit; padding rows are not written."""
    tokens, experts, top_k, hidden, inter, block_m = 23, 8, 2, 64, 48, 16
    x, w13, _, logits = random_moe(tokens, experts, hidden, inter, seed=2)
    _, _, sorted_slots, block_experts = moe_align.route_and_align(logits, top_k, True, block_m)
    n = tokens * top_k
    act = torch.empty(n, inter, device=DEVICE)
    moe.grouped_gemm(x, w13, act, sorted_slots, block_experts, block_m, tiles(16, 16, 2), top_k, gated=True)
    valid = sorted_slots < n
    slots = sorted_slots[valid].long()
    xs = moe_sorted.gather_rows(x, sorted_slots, block_experts, block_m, top_k, experts)
    assert torch.equal(xs[valid], x[slots // top_k])
    for a, options in ((x, dict(a_sorted=False)), (xs, dict(a_sorted=True, tma=True))):
        act_sorted = torch.full((sorted_slots.numel(), inter), float("nan"), device=DEVICE)
        moe_sorted.sorted_gemm(a, w13, act_sorted, sorted_slots, block_experts, block_m, tiles(16, 16, 2),
                               num_slots=n, row_div=top_k, out_sorted=True, gated=True, **options)  # fmt: skip
        assert torch.equal(act_sorted[valid], act[slots])
        assert act_sorted[~valid].isnan().all()


@pytest.mark.parametrize("options", ["pointers", "tma-gather"])
def test_fixed_configuration_gives_a_token_the_same_bits_in_any_batch(options):
    """Deterministic mode's property holds over the sorted layout too: a token alone and among others are the same
    bits; through pointers also the same bits as moe.py's layout with the same tiles (the interpreter multiplies a
    descriptor's transposed tile in another order: close)."""
    x, w13, w2, logits = random_moe(37, 8, 64, 48, seed=9)
    config = sorted_config(16, OPTIONS[options])
    run = lambda rows, cfg: (moe_sorted if "sorted" in cfg else moe).fused_moe(  # noqa: E731
        x[rows], logits[rows], w13, w2, 2, True, cfg, fixed_order_sum=True)  # fmt: skip
    full = run(slice(None), config)
    for rows in (slice(36, 37), slice(30, 37), slice(0, 1)):
        assert torch.equal(run(rows, config), full[rows])
    default = run(slice(None), {k: v for k, v in config.items() if k != "sorted"})
    if options == "pointers":
        assert torch.equal(full, default)
    torch.testing.assert_close(full, default, atol=1e-6, rtol=1e-6)


def test_16_bit_rounds_as_the_default_layout():
    """float16 (the interpreter multiplies bfloat16 wrongly): the activation rounded to 16 bits once, as moe.py's
    GEMMs do; within the rounding of the reference."""
    x, w13, w2, logits = (t.half() for t in random_moe(37, 8, 64, 48, seed=5))
    config = sorted_config(16, OPTIONS["tma-gather"])
    out = moe_sorted.fused_moe(x, logits, w13, w2, 2, True, config)
    ref = reference.fused_moe(x, w13, w2, *reference.select_experts(logits, 2, True))
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=1e-2)
    default = moe.fused_moe(x, logits, w13, w2, 2, True, {k: v for k, v in config.items() if k != "sorted"})
    torch.testing.assert_close(out, default, atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run of --variants (a GPU runs the bench itself)")
def test_variants_bench_prints_a_row_per_variant(monkeypatch, capsys):
    """bench/moe_kernel.py --variants (--smoke runs the whole grid, ~15 s): two variants, one tile each."""
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("moe_kernel", bench / "moe_kernel.py")
    moe_kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe_kernel)
    monkeypatch.setattr(moe_kernel, "VARIANTS", {"default": None, "sorted+tma+gather": OPTIONS["tma-gather"]})
    one_tile = moe_kernel.tiles(32, 32, 4, 2)
    monkeypatch.setattr(moe_kernel, "SMOKE_TILES", {16: dict(gate_up=[one_tile], down=[one_tile])})
    monkeypatch.setattr(moe_kernel, "timer", lambda smoke: lambda fn: 0.5)  # stand-in timings: the layers still run
    moe_kernel.compare_variants("tiny", 16, smoke=True)
    table = capsys.readouterr().out.split("| tokens |")[1].splitlines()[2:]
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in table]
    assert [(c[0], c[1]) for c in cells] == [(str(t), v) for t in (16, 4, 1) for v in
                                             ("default (production)", "default", "sorted+tma+gather")]  # fmt: skip
    assert all(float(c[-1]) < 1e-5 for c in cells)  # each variant's output against the production default's
    assert cells[2][5] != "" and cells[1][5] == ""  # the gather's time where the variant gathers
