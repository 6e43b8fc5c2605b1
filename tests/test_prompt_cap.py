"""--max-decode-slowdown (aserve/core/prompt_cap.py): the cap's arithmetic on a step-time model, the scheduler taking
only that many prompt tokens beside decodes (and the whole budget without them), and the flag through the offline
API and the command line."""

from types import SimpleNamespace

import pytest
from test_scheduler import BS, req, run_step, summary

from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.prompt_cap import MIN_PROMPT_TOKENS, PromptCap
from aserve.core.scheduler import Scheduler

UNIT = 2.0**-10  # seconds; the model's times below are exact in binary


class LinearCost:
    """A step-time model T(n) = (base + n) * per_token at n = 1, 2, 4, ... 1024 (StepCostModel's interface)."""

    def __init__(self, base: int, per_token: float = UNIT) -> None:
        self.version = 0
        self.set(base, per_token)

    def set(self, base: int, per_token: float = UNIT) -> None:
        self.base, self.per_token = base, per_token
        self.sizes = [1 << i for i in range(11)]
        self.times = [self.time(n) for n in self.sizes]
        self.version += 1

    def time(self, n: int) -> float:
        return (self.base + n) * self.per_token


def test_cap_is_the_slowdown_in_prompt_tokens():
    """P = (ratio - 1) * T(D) / (cost per token at the largest sizes), within [MIN_PROMPT_TOKENS, budget - D]."""
    cost = LinearCost(base=200)
    assert PromptCap(cost, 2.0, 8192, 256)(64) == 264  # T(64) = 264 tokens' cost
    assert PromptCap(cost, 2.0, 8192, 256)(256) == 456  # a larger batch's slower step carries more
    assert PromptCap(cost, 1.5, 8192, 256)(64) == 132
    assert PromptCap(cost, 3.0, 8192, 256)(64) == 528
    assert PromptCap(cost, 2.0, 300, 256)(64) == 236  # never past what the step's budget leaves
    assert PromptCap(LinearCost(base=0), 1.01, 8192, 256)(1) == MIN_PROMPT_TOKENS  # prompts always progress


def test_cap_follows_the_cost_model():
    cost = LinearCost(base=200)
    cap = PromptCap(cost, 2.0, 8192, 256)
    assert cap(64) == 264
    cost.set(base=400)  # decode steps measured slower: the same slowdown allows more prompt tokens
    assert cap(64) == 464
    cost.set(base=400, per_token=2 * UNIT)  # (the ratio of times is what counts)
    assert cap(64) == 464


def test_the_cap_follows_the_batch_of_live_requests():
    """Beside one decode, the cap is that of the batch the live requests make (at most max_num_seqs): it does not
    shrink while prompts are admitted."""
    cap = PromptCap(LinearCost(base=100), 2.0, 8192, 8)  # cap(B) = 100 + B
    decoding = SimpleNamespace(num_tokens=10, num_inflight=0, num_computed_tokens=9, paused=False, spec_token_ids=[])
    prompting = SimpleNamespace(num_tokens=50, num_inflight=0, num_computed_tokens=0, paused=False, spec_token_ids=[])
    never = lambda request, extra: False  # noqa: E731
    assert cap.step_budget([decoding, prompting], never, 2) == 102
    assert cap.step_budget([decoding, prompting], never, 30) == 108  # 30 live, but a step holds at most 8
    assert cap.step_budget([decoding] * 3, never, 2) == 103  # at least the step's own decodes
    assert cap.step_budget([prompting], never, 5) is None  # nothing decodes: no cap


def make_capped(base: int, budget: int = 64, threshold: int = 0) -> Scheduler:
    cap = PromptCap(LinearCost(base), 2.0, budget, 8)  # cap(B) = base + B
    return Scheduler(KVCacheManager(64, BS), 8, budget, 128, long_prefill_token_threshold=threshold, prompt_cap=cap)


def test_prompt_tokens_beside_decodes_are_capped():
    sched = make_capped(base=24)
    sched.add_request(req("a", range(6)))
    assert summary(run_step(sched)) == [("a", 0, 6, [0, 1])]  # nothing decodes: the whole budget
    sched.add_request(req("long", range(100, 140)))
    # "a" decodes: 26 prompt tokens (cap(2): two live requests) where the budget would give all 40
    assert summary(run_step(sched)) == [("a", 6, 1, [0, 1]), ("long", 0, 26, [2, 3, 4, 5, 6, 7, 8])]
    assert summary(run_step(sched)) == [("a", 7, 1, [0, 1]), ("long", 26, 14, [2, 3, 4, 5, 6, 7, 8, 9, 10, 11])]
    assert summary(run_step(sched)) == [("a", 8, 1, [0, 1, 12]), ("long", 40, 1, [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13])]


def test_a_prompt_ahead_of_decodes_in_the_running_queue_leaves_them_their_step():
    """A running request mid-prompt before a decoding one takes its capped share, and the decode still runs."""
    sched = make_capped(base=16, threshold=20)
    sched.add_request(req("long", range(100, 160)))
    sched.add_request(req("b", range(4)))
    assert summary(run_step(sched)) == [("long", 0, 20, [0, 1, 2, 3, 4]), ("b", 0, 4, [5])]
    assert summary(run_step(sched)) == [("long", 20, 18, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]), ("b", 4, 1, [5, 11])]


def test_uncapped_scheduler_gives_prompts_the_budget():
    sched = Scheduler(KVCacheManager(64, BS), 8, 64, 128)
    sched.add_request(req("a", range(6)))
    run_step(sched)
    sched.add_request(req("long", range(100, 140)))
    assert summary(run_step(sched)) == [("a", 6, 1, [0, 1]), ("long", 0, 40, [2, 3, 4, 5, 6, 7, 8, 9, 10, 11])]


def test_max_decode_slowdown_through_the_engine(tiny_model):
    """The flag as a user sets it (offline API): the same greedy tokens as without it, every step that decoded took
    no more prompt tokens than the cap allows, a prompt reaching an idle engine took the budget, and values in (0, 1]
    are refused."""
    from aserve import LLM, SamplingParams

    lengths = (5, 90, 40, 70)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 300 + 3 for j in range(n)]} for i, n in enumerate(lengths)]
    params = SamplingParams(temperature=0, max_tokens=8)
    plain = LLM(tiny_model, dtype="float32", enforce_eager=True, max_num_batched_tokens=64)
    capped = LLM(tiny_model, dtype="float32", enforce_eager=True, max_num_batched_tokens=64, max_decode_slowdown=1.5)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    scheduler = capped.engine.core.scheduler
    cap, schedule, steps = scheduler.prompt_cap, scheduler.schedule, []

    def recorded():
        live = len(scheduler.requests)
        out = schedule()
        decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1 and s.num_computed_tokens > 0)
        steps.append((decodes, sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1), live))
        return out

    scheduler.schedule = recorded
    assert [o.outputs[0].token_ids for o in capped.generate(prompts, params)] == want
    assert steps[0] == (0, 64, 4)  # nothing decoding yet: the whole budget
    beside = [(d, p, live) for d, p, live in steps if d and p]
    assert beside and all(p <= cap(max(d, live)) for d, p, live in beside)
    assert any(p < 64 - d for d, p, _ in beside)  # the cap, not the budget, bounded some of them
    for bad in (1.0, 0.5, -2.0):
        with pytest.raises(ValueError, match="max_decode_slowdown"):
            LLM(tiny_model, max_decode_slowdown=bad)


def test_max_decode_slowdown_on_the_command_line():
    import argparse

    from aserve.config import EngineArgs
    from aserve.entrypoints.engine_cli_args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--max-decode-slowdown", "2.5"]).max_decode_slowdown == 2.5
    assert parser.parse_args([]).max_decode_slowdown == EngineArgs().max_decode_slowdown == 0.0
