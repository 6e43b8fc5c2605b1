"""Mixture-of-experts: the fused Triton kernels (Triton's interpreter on CPU) and the CPU per-expert path against the
pure-torch references, and the MoE families (Mixtral, Qwen3-MoE) against transformers beyond greedy parity (that is
in tests/test_parity.py): logprobs, prefix-cache hits, the Triton path inside the engine, transformers' stacked expert
names. FP8 experts: tests/test_moe_fp8.py."""

import os
import random
import shutil

import pytest
import torch
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams
from aserve.kernels import moe, moe_align, moe_decode, moe_routing, reference
from aserve.layers.elementwise import silu_and_mul
from aserve.layers.moe import FusedMoE

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MOE_VARIANTS = ["mixtral", "qwen3_moe"]


def random_moe(tokens, experts, hidden, inter, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=gen)
    return [t.to(DEVICE) for t in (x, w13, w2, logits)]


def test_route_and_align_groups_slots_by_expert():
    # token -> its two experts: t0 (2, 0), t1 (2, 3), t2 (0, 2), t3 (2, 1); slots t * 2 + j
    picks = [(2, 0), (2, 3), (0, 2), (2, 1)]
    logits = torch.zeros(4, 4)
    for t, (first, second) in enumerate(picks):
        logits[t, first], logits[t, second] = 3.0, 1.0
    weights, ids, sorted_slots, block_experts = moe_align.route_and_align(logits.to(DEVICE), 2, True, 16)
    assert ids.tolist() == [list(p) for p in picks]
    top = torch.tensor([3.0, 1.0, 0.0, 0.0]).softmax(0)[:2]
    torch.testing.assert_close(weights.cpu(), (top / top.sum()).expand(4, 2))
    # 8 slots in blocks of 16: at most 8 + 4 * 15 rows -> 5 blocks; expert 4 marks the unused one
    assert block_experts.tolist() == [0, 1, 2, 3, 4]
    pad = 8
    expected = [[1, 4], [7], [0, 2, 5, 6], [3], []]  # each block's slots (order within an expert may vary)
    got = sorted_slots.view(5, 16).sort(1).values.tolist()
    assert got == [sorted(s) + [pad] * (16 - len(s)) for s in expected]


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (37, 8, 2), (64, 6, 3), (16, 128, 8)])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("one_program", [True, False])
def test_route_and_align_matches_reference_routing(tokens, experts, top_k, block_m, one_program, monkeypatch):
    """Up to moe_align.ROUTE_ALIGN_MAX_SLOTS slots one program routes and groups (here 2-128 slots of 4-128 experts; 192
    slots take the four kernels either way); without it, route, offsets and scatter: the same grouping."""
    if not one_program:
        monkeypatch.setattr(moe_align, "ROUTE_ALIGN_MAX_SLOTS", 0)
    *_, logits = random_moe(tokens, experts, 16, 16, seed=tokens)
    for renormalize in (True, False):
        weights, ids, sorted_slots, block_experts = moe_align.route_and_align(logits, top_k, renormalize, block_m)
        ref_w, ref_ids = reference.select_experts(logits, top_k, renormalize)
        assert ids.tolist() == ref_ids.tolist()
        torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-6)
    flat = ids.flatten().long()
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m
    # the experts in order, ceil(count / block_m) blocks each, then unused blocks (marked E)
    expected = [e for e in range(experts) for _ in range(int(padded[e]))]
    assert block_experts.tolist() == expected + [experts] * (block_experts.numel() - len(expected))
    rows = sorted_slots.view(-1, block_m)
    for b, e in enumerate(block_experts.tolist()):
        slots = rows[b][rows[b] < flat.numel()].long()
        assert (flat[slots] == e).all()
    used = sorted_slots[sorted_slots < flat.numel()]
    assert sorted(used.tolist()) == list(range(flat.numel()))  # every slot exactly once


def tiles(block_n, block_k, group_m):
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=4, num_stages=2)


CONFIGS = {
    "default": None,
    "small-tiles": dict(BLOCK_M=16, gate_up=tiles(16, 16, 1), down=tiles(16, 32, 1)),
    "grouped": dict(BLOCK_M=32, gate_up=tiles(32, 32, 4), down=tiles(16, 16, 2)),
    # blocks of few routed rows through a half- or quarter-height tile
    "shrunk": dict(BLOCK_M=64, gate_up={**tiles(32, 32, 4), "SHRINK": 2}, down={**tiles(16, 16, 2), "SHRINK": 1}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", [(1, 4, 2, 64, 32), (19, 8, 2, 48, 40),
                                                                    (70, 6, 3, 64, 48),
                                                                    (300, 4, 2, 64, 48)])  # fmt: skip
def test_fused_moe_matches_reference(config, tokens, experts, top_k, hidden, inter):
    """Hidden / intermediate sizes that are not multiples of the tiles take the masked K loop and clamped columns."""
    x, w13, w2, logits = random_moe(tokens, experts, hidden, inter)
    for renormalize in (True, False):
        out = moe.fused_moe(x, logits, w13, w2, top_k, renormalize, CONFIGS[config])
        ref = reference.fused_moe(x, w13, w2, *reference.select_experts(logits, top_k, renormalize))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_configuration_by_rows_per_expert():
    """Few rows per expert: 16-row blocks; many: 64; from MANY_SLOTS_PER_EXPERT on, 128-row blocks for 16-bit
    experts (FP8 experts keep 64)."""
    assert moe.moe_config(16 * 128, 128) is moe.SMALL_CONFIG
    assert moe.moe_config(16 * 128 + 1, 128) is moe.LARGE_CONFIG
    assert moe.moe_config(2048 * 8, 128) is moe.MANY_CONFIG and moe.MANY_CONFIG["BLOCK_M"] == 128
    assert moe.moe_config(2048 * 8, 128, fp8_experts=True) is moe.LARGE_CONFIG
    assert moe.moe_config(2048 * 8 - 1, 128) is moe.LARGE_CONFIG


def test_deterministic_configurations_sum_k_in_the_same_steps():
    """Deterministic mode: SMALL_CONFIG below MANY_SLOTS_PER_EXPERT slots an expert (a decode step too: no few-token
    kernels), its own many-row tiles from there, both GEMMs with the same BLOCK_K in both."""
    many = moe.MANY_SLOTS_PER_EXPERT * 128
    assert moe.moe_config(1, 128, deterministic=True) is moe.SMALL_CONFIG
    assert moe.moe_config(many - 1, 128, deterministic=True) is moe.SMALL_CONFIG
    assert moe.moe_config(many, 128, deterministic=True) is moe.DETERMINISTIC_MANY_CONFIG
    for gemm in ("gate_up", "down"):
        assert moe.DETERMINISTIC_MANY_CONFIG[gemm]["BLOCK_K"] == moe.SMALL_CONFIG[gemm]["BLOCK_K"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_gets_the_same_bits_through_either_deterministic_configuration(dtype):
    """deterministic_tiles_agree on this device (the interpreter on CPU): the tokens of a step large enough for the
    many-row tiles give the bits SMALL_CONFIG gives them, and so do they alone, through fused_moe's deterministic
    path (fixed-order sums, the configuration by slots)."""
    _, w13, w2, _ = (t.to(dtype) for t in random_moe(1, 4, 64, 128, seed=9))
    moe._TILES_AGREE.clear()
    assert moe.deterministic_tiles_agree(w13, w2, 2, True)
    x, _, _, logits = (t.to(dtype) for t in random_moe(moe.MANY_SLOTS_PER_EXPERT * 2, 4, 64, 128, seed=10))
    step = moe.fused_moe(x, logits, w13, w2, 2, True, fixed_order_sum=True)
    assert torch.equal(moe.fused_moe(x[:3], logits[:3], w13, w2, 2, True, fixed_order_sum=True), step[:3])


def test_fused_moe_16_bit_rounds_as_separate_ops():
    """float16 (Triton's interpreter multiplies bfloat16 wrongly, so the 16-bit case on CPU is float16): within the
    rounding of the projections and the activation to 16 bits."""
    x, w13, w2, logits = (t.half() for t in random_moe(37, 8, 64, 48, seed=5))
    out = moe.fused_moe(x, logits, w13, w2, 2, True)
    ref = reference.fused_moe(x, w13, w2, *reference.select_experts(logits, 2, True))
    torch.testing.assert_close(out, ref, atol=3e-3, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter",
                         [(1, 4, 2, 64, 32), (1, 8, 2, 48, 40), (3, 64, 4, 64, 48), (1, 32, 8, 256, 64)])  # fmt: skip
def test_decode_kernels_match_reference(dtype, tokens, experts, top_k, hidden, inter):
    """A few tokens: fused_moe takes moe_decode's kernels (no alignment; each token's k outputs summed by the down
    kernel), with K / N not multiples of the tiles (48, 40: masked) and multiples of them."""
    assert moe_decode.use_decode(tokens, top_k, experts)
    x, w13, w2, logits = (t.to(dtype) for t in random_moe(tokens, experts, hidden, inter, seed=tokens + experts))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-3, rtol=1e-2)
    for renormalize in (True, False):
        ref = reference.fused_moe(x, w13, w2, *reference.select_experts(logits, top_k, renormalize))
        torch.testing.assert_close(moe.fused_moe(x, logits, w13, w2, top_k, renormalize), ref, **tol)
    act, weights, ids = moe_decode.gate_up(x, logits, w13, top_k, True, config=dict(BLOCK_N=16, BLOCK_K=16))
    ref_weights, ref_ids = reference.select_experts(logits, top_k, True)
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
    out = moe_decode.down_sum(act, w2, ids, weights, config=dict(BLOCK_N=4, BLOCK_K=32))
    torch.testing.assert_close(out, reference.fused_moe(x, w13, w2, weights, ids), **tol)


def test_decode_choice_breaks_ties_by_expert_index():
    """Equal probabilities: the lower expert index first, in the decode kernel's choice by ranks as in the route
    kernel's repeated argmax."""
    logits = torch.tensor([[0.0] * 8, [1.0, 2.0, 2.0, 0.5, 2.0, 1.0, 1.0, -3.0]], device=DEVICE)
    x, w13, w2, _ = random_moe(2, 8, 32, 16, seed=11)
    for renormalize in (True, False):
        _, weights, ids = moe_decode.gate_up(x, logits, w13, 4, renormalize)
        assert ids.tolist() == [[0, 1, 2, 3], [1, 2, 4, 0]]
        ref_weights, ref_ids = moe_routing.route(logits, 4, renormalize)
        assert ref_ids.tolist() == ids.tolist()
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)


def test_decode_kernels_serve_few_slots_per_expert():
    assert moe_decode.use_decode(1, 8, 128) and moe_decode.use_decode(4, 8, 128)
    assert not moe_decode.use_decode(5, 8, 128)
    assert moe_decode.use_decode(1, 2, 8) and not moe_decode.use_decode(2, 2, 8)  # Mixtral: one token


def top2_block(w13, w2, renormalize: bool, gate_seed: int, **to) -> FusedMoE:
    """A FusedMoE block (top 2) holding w13 / w2 and a random router, moved `.to(**to)`."""
    experts, hidden = w13.shape[0], w13.shape[2]
    layer = FusedMoE(experts, 2, hidden, w2.shape[2], renormalize=renormalize).to(**to)
    with torch.no_grad():
        layer.w13.copy_(w13)
        layer.w2.copy_(w2)
        layer.gate.weight.copy_(torch.randn(experts, hidden, generator=torch.Generator().manual_seed(gate_seed)))
    return layer


def random_layer():
    """-> (x [23, 32], w13, w2, a FusedMoE block of 8 experts (top 2, not renormalised) holding them and a random
    router)."""
    x, w13, w2, _ = random_moe(23, 8, 32, 16, seed=3)
    layer = top2_block(w13, w2, False, 4, device=DEVICE)
    with torch.no_grad():
        layer.gate.process_weights_after_loading()
    return x, w13, w2, layer


@pytest.mark.parametrize("kernel", ["per_expert", "triton"])
def test_fused_moe_layer_matches_reference(kernel):
    """The layer's two kernels (the CPU's per-expert matmuls, the fused Triton one) with the router."""
    x, w13, w2, layer = random_layer()
    with torch.no_grad():
        if kernel == "triton":
            layer.use_triton()
        out = layer(x)
        ref = reference.fused_moe(x, w13, w2, *reference.select_experts(layer.gate(x), 2, False))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU kernel")
def test_one_token_on_cpu_runs_its_experts_as_gemvs(monkeypatch):
    """bf16 experts on a CPU with the C GEMV: a one-token step's experts, and in a step of several tokens the experts
    with one row, run as GEMVs, within bf16 roundings of the rows path and the reference."""
    from aserve.kernels import cpu

    x, w13, w2, _ = random_moe(5, 8, 64, 32, seed=12)
    layer = top2_block(w13, w2, True, 13, dtype=torch.bfloat16)
    layer.process_weights_after_loading()
    if not cpu.gemv_supports(layer.w13[0]):
        pytest.skip("no C GEMV on this CPU (AVX512-BF16)")
    assert layer.expert_gemv
    calls = []
    gemv = cpu.gemv
    monkeypatch.setattr(cpu, "gemv", lambda w, row: calls.append(w.shape) or gemv(w, row))
    for rows in (slice(0, 1), slice(None)):  # 5 tokens over 8 experts of top-2: some experts get one row
        xs = x[rows].bfloat16()
        with torch.no_grad():
            layer.expert_gemv = True
            calls.clear()
            out = layer(xs)
            _, ids = reference.select_experts(layer.gate(xs), 2, True)
            single = (torch.bincount(ids.flatten(), minlength=8) == 1).sum().item()
            assert len(calls) == 2 * single > 0  # each one-row expert's two projections
            ref = reference.fused_moe(xs, layer.w13, layer.w2, *reference.select_experts(layer.gate(xs), 2, True))
            layer.expert_gemv = False
            without = layer(xs)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out, without, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_experts_widen_where_the_cpu_has_no_16_bit_gemm(monkeypatch, dtype):
    """Where linear.widens says the CPU has no native 16-bit GEMM, the experts' projections over WIDEN_MIN_ROWS+ rows
    are float32 GEMMs of the 16-bit values (each projection's output rounded once), and experts with fewer rows
    F.linear; where it has one, F.linear throughout."""
    from aserve.layers import linear
    from aserve.layers import moe as moe_layer

    for native in (True, False):
        monkeypatch.setattr(moe_layer, "widens", lambda dt: not native)
        x, w13, w2, _ = random_moe(20, 6, 64, 32, seed=21)
        layer = top2_block(w13, w2, True, 22, dtype=dtype)
        layer.process_weights_after_loading()
        layer.expert_gemv = False
        assert layer.expert_linear is (torch.nn.functional.linear if native else linear.widened_linear)
    counts = []
    widened = linear.widened_linear
    monkeypatch.setattr(layer, "expert_linear", lambda x, w: counts.append(x.shape[0]) or widened(x, w))
    xs = x.to(dtype)
    with torch.no_grad():
        out = layer(xs)
        weights, ids = reference.select_experts(layer.gate(xs), 2, True)
    assert min(counts) < linear.WIDEN_MIN_ROWS <= max(counts)  # both paths ran (20 tokens x top-2 over 6 experts)
    want = torch.zeros(20, 64, dtype=dtype)
    for e in range(6):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if not len(rows):
            continue
        if len(rows) < linear.WIDEN_MIN_ROWS:
            h = torch.nn.functional.linear(xs[rows], layer.w13[e])
            h = torch.nn.functional.linear(silu_and_mul(h), layer.w2[e])
        else:
            h = (xs[rows].float() @ layer.w13[e].float().t()).to(dtype)
            h = (silu_and_mul(h).float() @ layer.w2[e].float().t()).to(dtype)
        want.index_add_(0, rows, (h * weights[rows, slot, None]).to(dtype))
    torch.testing.assert_close(out, want)


def prompts(seed=0, lens=(3, 17, 33, 50)):
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(n)] for n in lens]


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_logprobs_match_transformers(tiny_model_factory, variant):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(variant)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", enforce_eager=True)
    ids = prompts(5, (21,))[0]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                                   ignore_eos=True))[0].outputs[0]  # fmt: skip
    for token_id, lp in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)
        top = ref.topk(3)
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert lp[tid].rank == rank and abs(lp[tid].logprob - value) < 1e-4
        assert lp[token_id].rank == 1
        ids = ids + [token_id]


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_prefix_cache_hits_keep_parity(tiny_model_factory, variant):
    """A second prompt sharing 32 tokens (two blocks) with the first reads them from the prefix cache, under a
    16-token budget (chunked prefill): both equal transformers' greedy tokens."""
    path = tiny_model_factory(variant)
    first = prompts(1, (40,))[0]
    second = first[:32] + prompts(2, (9,))[0]
    expected = hf_greedy(path, [first, second], 16)
    llm = LLM(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=16)
    got = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in (first, second)]
    assert got == expected
    assert llm.engine.core.kv_manager.stats.hits == 32


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_triton_moe_in_the_engine_matches_transformers(tiny_model_factory, variant):
    """The GPU's fused MoE kernels inside the engine (Triton's interpreter on CPU), with chunked prefill and
    preemption: same greedy tokens."""
    path = tiny_model_factory(variant)
    ps = prompts(0, (20, 40, 50))
    expected = hf_greedy(path, ps, 12)
    # 6 blocks of 16 tokens for requests that grow to 32..62 tokens: some are preempted and resumed
    llm = LLM(path, dtype="float32", enforce_eager=True, max_num_batched_tokens=16, num_gpu_blocks_override=6,
              max_model_len=64)  # fmt: skip
    blocks = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(blocks) == (3 if variant == "mixtral" else 2)  # Qwen3-MoE's layer 1 is dense
    for block in blocks:
        block.use_triton()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=12))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_stacked_expert_tensors_load(tiny_model_factory, tmp_path):
    """A checkpoint with transformers' in-memory names (experts stacked: mlp.experts.gate_up_proj / down_proj)
    loads as the per-expert one save_pretrained writes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    src = tiny_model_factory("mixtral")
    dst = str(tmp_path / "stacked")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    state = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(dst, "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=8)
    ps = [{"prompt_token_ids": p} for p in prompts()]
    got = [o.outputs[0].token_ids for o in LLM(dst, dtype="float32", enforce_eager=True).generate(ps, params)]
    assert got == [o.outputs[0].token_ids for o in LLM(src, dtype="float32", enforce_eager=True).generate(ps, params)]


def test_a_missing_expert_tensor_is_reported(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_model_factory("mixtral")
    dst = str(tmp_path / "missing")
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    state = load_file(path)
    del state["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    save_file(state, path)
    with pytest.raises(ValueError, match=r"lacks weights for: \['layers.2.mlp.w13'\]"):
        LLM(dst, dtype="float32", enforce_eager=True)


def test_ordered_sum_adds_a_tokens_outputs_in_slot_order():
    x = torch.randn(5, 3, 40, generator=torch.Generator().manual_seed(2)).half().to(DEVICE)
    total = x[:, 0].float()
    for j in (1, 2):
        total += x[:, j]
    assert torch.equal(moe.ordered_sum(x), total.half())


def test_fixed_configuration_gives_a_token_the_same_bits_in_any_batch():
    """Deterministic mode's GPU experts (one launch configuration, each token's k outputs added in a fixed order):
    a token's output alone equals its output among other tokens, bit for bit."""
    x, w13, w2, logits = random_moe(37, 8, 64, 48, seed=9)
    run = lambda rows: moe.fused_moe(x[rows], logits[rows], w13, w2, 2, True, moe.SMALL_CONFIG,  # noqa: E731
                                     fixed_order_sum=True)  # fmt: skip
    full = run(slice(None))
    for rows in (slice(36, 37), slice(30, 37), slice(0, 1)):
        assert torch.equal(run(rows), full[rows])
    torch.testing.assert_close(full, moe.fused_moe(x, logits, w13, w2, 2, True, moe.SMALL_CONFIG), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (2, 16, 8), (5, 6, 3)])
def test_routed_gate_up_is_route_and_align_then_the_gate_up_gemm(dtype, tokens, experts, top_k, monkeypatch):
    """The gate/up GEMM whose programs route the slots themselves: the same routing stored for the down GEMM and
    the same bits as the routing's own launch then the GEMM, so a token's result does not depend on which path the
    number of slots took."""
    x, w13, w2, logits = (t.to(dtype) for t in random_moe(tokens, experts, 48, 40, seed=tokens))
    for renormalize in (True, False):
        routing = moe_align.route_and_align(logits, top_k, renormalize, 16)
        act = torch.empty(tokens * top_k, 40, dtype=dtype, device=DEVICE)
        moe.grouped_gemm(x, w13, act, routing[2], routing[3], 16, moe.SMALL_CONFIG["gate_up"], top_k, gated=True)
        folded_act = torch.full_like(act, float("nan"))
        folded = moe.routed_gate_up(x, logits, w13, folded_act, top_k, renormalize, 16, moe.SMALL_CONFIG["gate_up"])
        for got, want in zip(folded, routing):
            assert torch.equal(got, want)
        assert torch.equal(folded_act, act)
        base = moe.fused_moe(x, logits, w13, w2, top_k, renormalize, moe.SMALL_CONFIG, fixed_order_sum=True)
        monkeypatch.setattr(moe, "FOLD_ROUTE_MAX_SLOTS", 64)
        assert torch.equal(moe.fused_moe(x, logits, w13, w2, top_k, renormalize, moe.SMALL_CONFIG,
                                         fixed_order_sum=True), base)  # fmt: skip
        monkeypatch.setattr(moe, "FOLD_ROUTE_MAX_SLOTS", 0)
