"""Hybrid KV layout (aserve/core/kv_cache_groups.py): models that interleave sliding-window and full-attention layers
(Gemma 2/3) keep one block table per group of layers, and their sliding groups give back the blocks behind the
window while requests live."""

import random

import pytest
import torch
from tiny_models import VOCAB_SIZE, hf_greedy

from aserve import LLM, SamplingParams
from aserve.core.block_pool import BlockHasher
from aserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from aserve.core.kv_cache_groups import plan_kv_groups
from aserve.core.outputs import RunnerOutput, SamplerOutput
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.sampling_params import SamplingParams as Params


def test_layers_split_into_groups_of_equal_size():
    gemma3 = [None if i % 6 == 5 else 1024 for i in range(48)]  # five sliding layers to one full
    layout = plan_kv_groups(gemma3)
    assert layout.group_windows == (None, 1024, 1024, 1024, 1024, 1024) and layout.num_slots == 8
    assert [layout.layer_groups[i] for i in (5, 11, 47)] == [0, 0, 0]
    assert [(layout.layer_groups[i], layout.layer_slots[i]) for i in (0, 1, 9, 10, 46)] == [
        (1, 0), (1, 1), (2, 0), (2, 1), (5, 7)]  # fmt: skip
    # Every (group, slot) pair is one layer's
    assert len(set(zip(layout.layer_groups, layout.layer_slots))) == 48
    # Gemma 3 1B: 4 full layers, 22 sliding: groups of 4, the last sliding group has two unused slots
    layout = plan_kv_groups([None if i % 6 == 5 else 512 for i in range(26)])
    assert layout.group_windows == (None,) + (512,) * 6 and layout.num_slots == 4
    assert sorted(layout.layer_groups).count(6) == 2
    gemma2 = [4096 if i % 2 == 0 else None for i in range(42)]
    assert plan_kv_groups(gemma2).group_windows == (None, 4096) and plan_kv_groups(gemma2).num_slots == 21
    # One group: every layer slides by one window (it gives back blocks), or no hybrid layout is allowed
    assert plan_kv_groups([12] * 4).group_windows == (12,) and plan_kv_groups([12] * 4).num_slots == 4
    assert plan_kv_groups(gemma2, hybrid=False).group_windows == (None,)
    assert plan_kv_groups([12] * 4, release_windows=False).group_windows == (None,)


BS = 4


def land(sched, out, token=7):
    sampled = [s for s in out.scheduled if s.samples]
    result = RunnerOutput(sampled, SamplerOutput([[token] for _ in sampled], [None] * len(sampled), [0] * len(sampled)))
    sched.update_from_output(out, result)
    sched.check_invariants()


def test_sliding_groups_give_back_blocks_and_share_the_window_of_a_prefix():
    """Groups (full, sliding by 6, sliding by 6), blocks of 4 tokens, 4-token chunks: the full group holds every
    block, each sliding group those its window reads; a second request with the same 20-token prefix takes the full
    group's five blocks and, in the sliding groups, only the blocks the window of its next token reads, even after
    one the window does not read was evicted; once one it reads is gone, the hit shrinks."""
    kv = HybridKVCacheManager(64, BS, (None, 6, 6))
    sched = Scheduler(kv, 4, 4, 64)
    hasher = BlockHasher(BS)
    sched.add_request(Request("a", list(range(20)), Params(max_tokens=8, ignore_eos=True), None, hasher))
    while sched.has_unfinished():
        out = sched.schedule()
        full, *sliding = kv.get_block_ids("a")
        s = out.scheduled[0]
        assert len(full) == -(-(s.num_computed_tokens + s.num_new_tokens) // BS)
        for ids in sliding:
            assert len(ids) == len(full) and sum(i != 0 for i in ids) <= 3  # the window's blocks and the new one
        land(sched, out)
    assert kv.pool.num_free_blocks == 64 and not kv.req_to_blocks

    b = Request("b", list(range(20)) + [99, 98], Params(max_tokens=2, ignore_eos=True), None, hasher)
    hits, num_tokens = kv.get_computed_blocks(b)
    assert num_tokens == 20
    assert [blk.block_id for blk in hits[0]] == [kv.groups[0].pool.cached_blocks[h].block_id
                                                 for h in b.block_hashes[:5]]  # fmt: skip
    # The query at position 20 reads keys 15..20: blocks 3 and 4 (the null block stands for 0..2)
    assert [[blk.block_id == 0 for blk in h] for h in hits[1:]] == [[True, True, True, False, False]] * 2
    sliding = kv.groups[2]
    kv.pool.uncache_blocks([sliding.pool.cached_blocks[b.block_hashes[1] + sliding.key_suffix]])
    assert kv.get_computed_blocks(b)[1] == 20
    kv.pool.uncache_blocks([sliding.pool.cached_blocks[b.block_hashes[3] + sliding.key_suffix]])
    # Ends at 16 need block 3; at 12, blocks 1 (gone) and 2; at 8, blocks 0 and 1 (gone); at 4: block 0
    assert kv.get_computed_blocks(b)[1] == 4
    sched.add_request(b)
    while sched.has_unfinished():
        land(sched, sched.schedule())
    assert kv.pool.num_free_blocks == 64


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB_SIZE) for _ in range(n)]


@pytest.fixture(scope="module")
def gemma3(tiny_model_factory):
    path = tiny_model_factory("gemma3")
    prompts = [random_prompt(40, seed=21), random_prompt(40, seed=22)]
    return path, prompts, hf_greedy(path, prompts, 60)


def test_two_long_gemma3_requests_fit_where_one_table_held_room_for_one(gemma3):
    """Tiny Gemma 3 (three layers sliding by 20 to one full, blocks of 16): 32 blocks of one layer each, the memory
    of 8 blocks of all four layers (one table: each 100-token request would hold 7 of those), run both requests at
    once without preemption; transformers' greedy tokens; every block back at the end."""
    path, prompts, expected = gemma3
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=128, num_gpu_blocks_override=32,
              debug_invariants=True)  # fmt: skip
    core = llm.engine.core
    assert core.runner.kv_layout.group_windows == (None, 20, 20, 20) and core.runner.kv_caches.shape[0] == 1
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=60))
    assert [o.outputs[0].token_ids for o in outs] == expected and min(map(len, expected)) > 30
    assert core.scheduler.num_preemptions == 0
    assert core.kv_manager.pool.num_free_blocks == core.num_kv_blocks and not core.kv_manager.req_to_blocks


def test_gemma3_prefix_hit_takes_the_sliding_layers_window(gemma3):
    """A prompt that repeats a finished request's first 50 tokens hits its first three blocks (48 tokens): every
    block in the full-attention group, the two the window reads (tokens 29..48) in each sliding group, whose first
    block went back while that request ran; the continuation is transformers'."""
    path, prompts, expected = gemma3
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=128, num_gpu_blocks_override=64,
              debug_invariants=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=60)
    assert llm.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0].token_ids == expected[0]
    kv = llm.engine.core.kv_manager
    assert kv.stats.hits == 0
    again = prompts[0] + expected[0][:10]
    out = llm.generate([{"prompt_token_ids": again}], SamplingParams(temperature=0, max_tokens=10))
    assert kv.stats.hits == 48 and out[0].outputs[0].token_ids == expected[0][10:20]
    assert kv.pool.num_free_blocks == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_gemma3_hybrid_layout_in_cuda_graphs(gemma3):
    """The decode steps replay CUDA graphs whose attention reads each group's block table: transformers' tokens."""
    path, prompts, expected = gemma3
    llm = LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks_override=32, debug_invariants=True)
    assert llm.engine.core.runner.graphs is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=60))
    assert [o.outputs[0].token_ids for o in outs] == expected
