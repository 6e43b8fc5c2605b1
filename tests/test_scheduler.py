"""Scheduler and KV cache manager on CPU with exact block ids (no model involved)."""

from aserve.core.block_pool import BlockHasher
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.outputs import RunnerOutput, SamplerOutput
from aserve.core.request import Request, RequestStatus
from aserve.core.scheduler import Scheduler
from aserve.sampling_params import SamplingParams

BS = 4


def make_scheduler(num_blocks=16, max_num_seqs=8, budget=64, max_model_len=64):
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(kv, max_num_seqs, budget, max_model_len)


def req(rid, tokens, hasher=None, max_tokens=8):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, hasher)


def land(sched, out, token):
    """The step `out` finished: every request it sampled for got `token` (what the model runner would return)."""
    sampled = [s for s in out.scheduled if s.samples]
    result = RunnerOutput(sampled, SamplerOutput([[token] for _ in sampled], [None] * len(sampled), [0] * len(sampled)))
    return sched.update_from_output(out, result)


def run_step(sched, token=7):
    """Schedules a step and 'samples' `token` for every request that samples."""
    out = sched.schedule()
    land(sched, out, token)
    sched.check_invariants()
    return out


def summary(out):
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens, *s.block_ids) for s in out.scheduled]


def test_chunked_prefill_and_mixed_decode_in_one_budget():
    sched = make_scheduler(budget=8)
    sched.add_request(req("a", range(10)))
    sched.add_request(req("b", range(100, 103)))
    assert summary(run_step(sched)) == [("a", 0, 8, [0, 1])]
    # a's last 2 prompt tokens, then b fits in the rest of the budget.
    assert summary(run_step(sched)) == [("a", 8, 2, [0, 1, 2]), ("b", 0, 3, [3])]
    # Both decode one token each.
    assert summary(run_step(sched)) == [("a", 10, 1, [0, 1, 2]), ("b", 3, 1, [3])]
    assert sched.requests["a"].num_tokens == 12 and sched.requests["b"].num_tokens == 5


def test_long_prefill_token_threshold_caps_a_prompt_per_step():
    """With long_prefill_token_threshold a long prompt computes at most that many tokens per step even where the
    budget leaves more, beside running decodes; prompts within it are not chunked."""
    kv = KVCacheManager(32, BS)
    sched = Scheduler(kv, 8, 64, 64, long_prefill_token_threshold=6)
    sched.add_request(req("short", range(5)))
    assert summary(run_step(sched)) == [("short", 0, 5, [0, 1])]
    sched.add_request(req("long", range(100, 114)))
    assert summary(run_step(sched)) == [("short", 5, 1, [0, 1]), ("long", 0, 6, [2, 3])]
    assert summary(run_step(sched)) == [("short", 6, 1, [0, 1]), ("long", 6, 6, [2, 3, 4])]
    assert summary(run_step(sched)) == [("short", 7, 1, [0, 1]), ("long", 12, 2, [2, 3, 4, 5])]


def test_long_prefill_token_threshold_through_the_engine(tiny_model):
    """The flag as a user sets it (offline API): outputs as without it, a 60-token prompt over ceil(60 / 16) steps
    (the first token comes after them), and a negative value refused."""
    import pytest

    from aserve import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(3, 63))}, {"prompt_token_ids": [5, 6, 7]}]
    params = SamplingParams(temperature=0, max_tokens=6)
    plain = LLM(tiny_model, dtype="float32", enforce_eager=True)
    capped = LLM(tiny_model, dtype="float32", enforce_eager=True, long_prefill_token_threshold=16)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in capped.generate(prompts, params)] == want
    fresh = [{"prompt_token_ids": list(range(100, 160))}]  # no prefix-cache hit
    steps = []
    for llm in (plain, capped):
        before = llm.engine.stats.steps_total
        llm.generate(fresh, SamplingParams(temperature=0, max_tokens=1))
        steps.append(llm.engine.stats.steps_total - before)
    assert steps == [1, 4]
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(tiny_model, long_prefill_token_threshold=-1)


def test_running_before_waiting_and_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(3):
        sched.add_request(req(f"r{i}", range(5)))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_waiting == 1
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]


def test_preempts_newest_and_recomputes():
    # 4 blocks of 4 tokens. Two requests of 7 tokens take 2 blocks each; the first decode that needs a third
    # block forces a preemption of the newest request.
    sched = make_scheduler(num_blocks=4, budget=100, max_model_len=16)
    sched.add_request(req("old", range(7)))
    sched.add_request(req("new", range(10, 17)))
    assert summary(run_step(sched)) == [("old", 0, 7, [0, 1]), ("new", 0, 7, [2, 3])]
    # Each now has 8 tokens (7 + 1 sampled), 7 computed: decoding token 8 still fits in 2 blocks.
    assert summary(run_step(sched)) == [("old", 7, 1, [0, 1]), ("new", 7, 1, [2, 3])]
    # Token 9 needs a third block: "new" is preempted, its blocks go to "old".
    out = run_step(sched)
    assert [r.request_id for r in out.preempted] == ["new"]
    assert summary(out) == [("old", 8, 1, [0, 1, 3])]
    new = sched.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and sched.num_preemptions == 1
    assert list(sched.waiting) == [new]
    # "old" finishes at max_tokens=8 after 6 more tokens; then "new" recomputes all 9 known tokens.
    while not sched.requests["old"].num_output_tokens == 7:
        run_step(sched)
    out = run_step(sched)
    assert "old" not in sched.requests
    while "new" in sched.requests and sched.requests["new"].status != RequestStatus.RUNNING:
        out = run_step(sched)
    assert summary(out)[0][:3] == ("new", 0, 9)


def test_finished_and_aborted_requests_free_everything():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(req("a", range(9), max_tokens=2))
    sched.add_request(req("b", range(9)))
    run_step(sched)
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)
    while sched.has_unfinished():
        run_step(sched)
    assert sched.kv.pool.num_free_blocks == 8 and not sched.kv.req_to_blocks
    assert sched.finish_request("unknown", RequestStatus.FINISHED_ABORTED) is None


def test_prefix_hits_exact_blocks_and_last_token_recomputed():
    sched = make_scheduler(num_blocks=16)
    hasher = BlockHasher(BS)
    sched.add_request(req("a", range(12), hasher, max_tokens=1))
    assert summary(run_step(sched)) == [("a", 0, 12, [0, 1, 2])]
    assert "a" not in sched.requests  # finished after one token; its 3 full blocks stay cached
    # Same 12-token prompt: blocks 0 and 1 hit; block 2 would cover the last token, which must be recomputed.
    b = req("b", range(12), hasher, max_tokens=1)
    sched.add_request(b)
    assert summary(run_step(sched)) == [("b", 8, 4, [0, 1, 3])]
    assert b.num_cached_tokens == 8
    # A longer prompt sharing 12 tokens hits all three blocks.
    c = req("c", list(range(12)) + [50, 51], hasher, max_tokens=1)
    sched.add_request(c)
    out = run_step(sched)
    assert summary(out) == [("c", 12, 2, [0, 1, 2, 4])]
    stats = sched.kv.stats
    assert (stats.queries, stats.hits) == (12 + 12 + 14, 0 + 8 + 12)


def test_different_salts_do_not_share():
    sched = make_scheduler(num_blocks=16)
    sched.add_request(req("a", range(9), BlockHasher(BS, "tenant-a"), max_tokens=1))
    run_step(sched)
    b = req("b", range(9), BlockHasher(BS, "tenant-b"), max_tokens=1)
    sched.add_request(b)
    run_step(sched)
    assert b.num_cached_tokens == 0


def test_same_step_sharing_between_siblings():
    """n > 1: siblings scheduled in the same step share the prompt's full blocks at once."""
    sched = make_scheduler(num_blocks=16)
    hasher = BlockHasher(BS)
    for i in range(3):
        sched.add_request(req(f"p#{i}", range(10), hasher, max_tokens=2))
    out = run_step(sched)
    assert summary(out) == [("p#0", 0, 10, [0, 1, 2]), ("p#1", 8, 2, [0, 1, 3]), ("p#2", 8, 2, [0, 1, 4])]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1]


def test_lru_eviction_of_freed_cached_blocks():
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    hasher = BlockHasher(BS)
    sched.add_request(req("a", range(8), hasher, max_tokens=1))
    run_step(sched)  # blocks 0,1 cached; freed tail-first: free list 2 3 1 0
    assert [b.block_id for b in sched.kv.pool.free_block_queue] == [2, 3, 1, 0]
    sched.add_request(req("b", range(100, 112), None, max_tokens=1))  # needs 3 blocks: 2, 3, then evicts 1
    out = run_step(sched)
    assert summary(out) == [("b", 0, 12, [2, 3, 1])]
    c = req("c", list(range(8)) + [9], hasher, max_tokens=1)
    sched.add_request(c)
    run_step(sched)
    assert c.num_cached_tokens == 4  # block 0 survived, block 1 was evicted


def test_async_scheduling_counts_tokens_in_flight():
    """Step N+1 is scheduled before step N's tokens arrive (async scheduling): a request that samples in N decodes
    its in-flight token in N+1, is not scheduled past its last token, and a preempted request with a token in flight
    waits for it before it is re-admitted."""
    sched = make_scheduler(num_blocks=4, budget=100, max_model_len=16)
    a = req("a", range(7), max_tokens=3)
    b = req("b", range(10, 17))
    sched.add_request(a)
    sched.add_request(b)
    step1 = sched.schedule()  # both prompts; each samples one token (in flight)
    assert [(s.num_new_tokens, s.samples) for s in step1.scheduled] == [(7, True), (7, True)]
    assert a.num_inflight == 1 and a.num_tokens == 7
    step2 = sched.schedule()  # before step 1's tokens arrive: each decodes its in-flight token (position 7)
    assert summary(step2) == [("a", 7, 1, [0, 1]), ("b", 7, 1, [2, 3])]
    assert a.num_inflight == 2 and a.num_computed_tokens == 8
    land(sched, step1, 7)  # step 1's tokens arrive
    # Step 3 needs a third block for a's position 8: b, the newest, is preempted with a token still in flight.
    step3 = sched.schedule()
    assert [r.request_id for r in step3.preempted] == ["b"] and summary(step3) == [("a", 8, 1, [0, 1, 3])]
    assert b.status == RequestStatus.PREEMPTED and b.num_inflight == 1
    land(sched, step2, 8)  # step 2's tokens arrive (b's is kept: its recompute includes it)
    assert b.num_tokens == 9 and a.num_output_tokens == 2
    # a has 2 tokens and one more in flight = its max_tokens (3): nothing left to schedule for it; b still waits
    # for blocks (a holds 3 of 4).
    step4 = sched.schedule()
    assert step4.scheduled == [] and a.num_inflight == 1
    outputs = land(sched, step3, 9)  # a's third token: finished by length, blocks freed
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("a", [9], "length")]
    assert a.is_finished and b.num_inflight == 0
    step5 = sched.schedule()  # b is re-admitted and recomputes its 9 tokens
    # Free list: b's blocks (tail first: 3, 2), 3 went to a, then a's freed tail first (3, 1, 0).
    assert summary(step5) == [("b", 0, 9, [2, 3, 1])]
    sched.check_invariants()


def test_paused_requests_are_not_scheduled_and_keep_their_blocks():
    sched = make_scheduler(budget=100)
    sched.add_request(req("a", range(5), max_tokens=20))
    sched.add_request(req("b", range(10, 15), max_tokens=20))
    run_step(sched)
    sched.set_paused(["a", "unknown"], True)
    out = run_step(sched)
    assert summary(out) == [("b", 5, 1, [2, 3])]
    assert sched.kv.get_block_ids("a") == ([0, 1],) and sched.requests["a"].num_tokens == 6
    assert not sched.all_paused()
    sched.set_paused(["b"], True)
    assert sched.all_paused() and sched.schedule().is_empty
    sched.set_paused(["a"], False)
    assert summary(run_step(sched)) == [("a", 5, 1, [0, 1])]
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)  # ended while paused
    assert sched.num_paused == 0 and not sched.all_paused()


def test_a_paused_request_is_preempted_first_for_blocks():
    # "old" is paused: when "new" needs a third block, "old" is preempted (not "new", the newest)
    sched = make_scheduler(num_blocks=4, budget=100, max_model_len=16)
    sched.add_request(req("old", range(7)))
    sched.add_request(req("new", range(10, 17)))
    run_step(sched)
    run_step(sched)
    sched.set_paused(["old"], True)
    out = run_step(sched)
    assert [r.request_id for r in out.preempted] == ["old"]
    assert summary(out) == [("new", 8, 1, [2, 3, 1])]
    old = sched.requests["old"]
    assert old.status == RequestStatus.PREEMPTED and old.paused and list(sched.waiting) == [old]
    run_step(sched)  # paused in the waiting queue: not admitted although blocks are free
    assert old.status == RequestStatus.PREEMPTED
    sched.set_paused(["old"], False)
    while old.status != RequestStatus.RUNNING:
        out = run_step(sched)
    assert ("old", 0, 9) in [x[:3] for x in summary(out)]  # its 9 tokens recomputed once resumed


def test_a_paused_request_gives_its_sequence_slot_to_a_waiting_one():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    sched.add_request(req("a", range(5), max_tokens=20))
    sched.add_request(req("b", range(10, 15), max_tokens=20))
    run_step(sched)
    sched.add_request(req("c", range(20, 25), max_tokens=20))
    assert [s.request.request_id for s in run_step(sched).scheduled] == ["a", "b"]  # no slot for c
    sched.set_paused(["a"], True)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["b", "c"]
    assert sched.requests["a"].status == RequestStatus.PREEMPTED and not sched.kv.get_block_ids("a")[0]


def test_random_pauses_resumes_and_aborts_keep_the_invariants():
    """Random adds, pauses, resumes and aborts with a pool small enough to preempt: the queues and blocks stay
    consistent after every step, and once everything is resumed every request runs to its max_tokens."""
    import random

    rng = random.Random(0)
    sched = make_scheduler(num_blocks=12, max_num_seqs=4, budget=16, max_model_len=64)
    requests, max_tokens = {}, {}
    for step in range(300):
        if step < 200 and rng.random() < 0.3:
            rid = f"r{step}"
            max_tokens[rid] = rng.randint(1, 12)
            requests[rid] = req(rid, range(rng.randint(1, 14)), max_tokens=max_tokens[rid])
            sched.add_request(requests[rid])
        live = list(sched.requests)
        if live and step < 200:
            action, rid = rng.random(), rng.choice(live)
            if action < 0.2:
                sched.set_paused([rid], True)
            elif action < 0.4:
                sched.set_paused([rid], False)
            elif action < 0.45:
                sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                max_tokens.pop(rid)
        if step == 200:
            sched.set_paused(list(sched.requests), False)
        out = sched.schedule()
        land(sched, out, 7)
        sched.check_invariants()
        assert sched.num_paused == sum(r.paused for r in sched.requests.values())
        for s in out.scheduled:
            assert not s.request.paused
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 12
    assert all(requests[rid].num_output_tokens == n for rid, n in max_tokens.items())
    assert sched.num_preemptions > 0 and any(r.num_preemptions and r.status.finished for r in requests.values())
