"""Speculative decoding's pieces without a model: n-gram lookup and its follow index, config validation, the adaptive
policy and its cost model, and which CUDA graph a decode or verification step replays."""

import random

import pytest

from aserve.spec import ngram
from aserve.spec.config import SpeculativeConfig
from aserve.spec.ngram import propose_ngram
from aserve.spec.policy import MAX_PROBE_EVERY, PROBE_EVERY, SpecPolicy, StepCostModel, expected_tokens


@pytest.mark.parametrize("vocab, lookup_min", [(3, 2), (8, 2), (8, 3), (1000, 2), (1000, 4)])
def test_follow_index_never_rules_out_a_proposal(monkeypatch, vocab, lookup_min):
    """FollowIndex, fed one growing sequence: where it says no proposal can follow the next token, propose_ngram
    finds none for any next token (every id of the vocabulary and a new one); over a window of 12 tokens here, so
    that m-grams leave it. It rules out proposals only where they are impossible, and does rule some out."""
    monkeypatch.setattr(ngram, "_WINDOW", 12)
    rng = random.Random(vocab * 10 + lookup_min)
    tokens, index, ruled_out, possible = [], ngram.FollowIndex(lookup_min - 1), 0, 0
    # Fed first at 41 tokens (past the window), then every 7th length, then each: the jumps give the same answers.
    sparse = ngram.FollowIndex(lookup_min - 1)
    for i in range(80):
        tokens.append(rng.randrange(vocab))
        if i == 40 or (i > 40 and i % 7 == 6) or i > 70:
            assert sparse.could_propose(tokens) == index.could_propose(tokens), (i, tokens)
        if index.could_propose(tokens):
            possible += 1
            continue
        ruled_out += 1
        for x in [*range(vocab), vocab]:
            assert propose_ngram(tokens + [x], 3, lookup_min, 5) == [], (tokens, x)
    assert ruled_out and (possible or vocab == 1000)


def test_ngram_lookup():
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], 3, 1, 3) == [4, 9, 1]
    assert propose_ngram([1, 2, 3, 4, 9, 8, 2, 3], 2, 2, 3) == [4, 9]  # the longest match wins; then n=2
    assert propose_ngram([1, 2, 3], 3, 2, 3) == []
    assert propose_ngram([5, 5, 5, 5], 2, 1, 2) == [5]  # the most recent match, cut at the end
    assert propose_ngram([1, 2], 0, 1, 2) == []


@pytest.mark.parametrize(
    "cfg",
    ['{"method": "medusa"}', {"method": "ngram", "num_speculative_tokens": 0},
     {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, {"method": "draft_model"},
     {"method": "layer_skip"}, {"method": "ngram", "bogus": 1}, "not json"],
)  # fmt: skip
def test_bad_speculative_configs(cfg):
    with pytest.raises(ValueError):
        SpeculativeConfig.parse(cfg)


class _Req:
    def __init__(self, accepted, trials):
        self.spec_accepted, self.spec_trials = accepted, trials


def test_adaptive_policy_drafts_only_where_it_pays():
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": "auto"})
    # Memory-bound at small batches (time flat in tokens), compute-bound beyond 64 tokens.
    cost = StepCostModel({1: 1.0, 8: 1.0, 64: 1.05, 128: 2.0, 512: 8.0})
    policy = SpecPolicy(cfg, cost)
    good, bad = _Req(90, 100), _Req(0, 100)
    assert policy.num_drafts(good, 1) == cfg.num_speculative_tokens  # free verification: draft the most
    assert policy.num_drafts(bad, 1) == 0  # never accepted: not worth even a small cost
    assert policy.num_drafts(good, 128) == 0  # compute-bound batch: k+1 tokens cost k+1 times as much
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    policy.observe(bad, 4, 4)
    assert bad.spec_accepted == pytest.approx(4)


def test_adaptive_policy_prices_the_lost_overlap_and_probes():
    """With async scheduling a drafting step costs the overlap (sync_overhead) and an empty proposal counts as a
    rejection; requests held at k = 0 draft one token together, first after PROBE_EVERY steps, then at doubling
    intervals while nothing is accepted (up to MAX_PROBE_EVERY), and every PROBE_EVERY steps again once a draft is."""
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": "auto"})
    cost = StepCostModel({1: 1.0, 2: 1.0, 8: 1.0})  # verification free in step time
    policy = SpecPolicy(cfg, cost, overlap=True)
    assert policy.empty_is_rejection and not SpecPolicy(cfg, cost).empty_is_rejection
    low = _Req(0, 100)  # nothing accepted lately: the prior alone keeps the estimate at 1/102
    weak = _Req(2, 10)  # 0.25
    policy.begin_step()
    assert policy.num_drafts(weak, 1) > 0
    for _ in range(20):
        cost.observe_sync_overhead(0.5)  # a step without overlap costs half a step more
    assert cost.sync_overhead == pytest.approx(0.5, rel=0.02)
    assert policy.num_drafts(weak, 1) == 0 and policy.num_drafts(low, 1) == 0
    policy = SpecPolicy(cfg, cost, overlap=True)
    probes = []
    for _ in range(PROBE_EVERY * (1 + 2 + 4 + 8 + 16 + 16)):
        policy.begin_step()
        probes.append(policy.num_drafts(low, 1))
    assert set(probes) == {0, 1}  # one token per probe
    probed_at = [i + 1 for i, k in enumerate(probes) if k]
    assert probed_at == [PROBE_EVERY * n for n in (1, 3, 7, 15, 31, 47)]  # the interval doubles up to 512 steps
    assert MAX_PROBE_EVERY == 16 * PROBE_EVERY
    policy.observe(low, 1, 1)  # a probe's draft accepted: the next probe within PROBE_EVERY steps
    probes = []
    for _ in range(PROBE_EVERY):
        policy.begin_step()
        probes.append(policy.num_drafts(low, 1))
    assert probes[-1] == 1 and sum(probes) == 1
    assert policy.num_drafts(_Req(90, 100), 1) == cfg.num_speculative_tokens  # high acceptance still pays


def test_cost_model_learns_from_observed_steps():
    """A seed that calls verification free (flat step times) makes the policy draft; measured verify steps that
    cost twice a plain step correct it after a few observations."""
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": "auto"})
    cost = StepCostModel({1: 1.0, 8: 1.0, 64: 1.0})
    policy = SpecPolicy(cfg, cost)
    req = _Req(50, 100)  # acceptance ~0.5
    assert policy.num_drafts(req, 8) > 0
    for _ in range(10):
        cost.observe(8, 1.0)
        for k in range(1, cfg.num_speculative_tokens + 1):
            cost.observe(8 * (k + 1), 1.0 + k)  # verification costs grow with the tokens verified
    assert cost.time(16) == pytest.approx(2.0, rel=0.05) and cost.time(64) >= cost.time(40)
    assert policy.num_drafts(req, 8) == 0
    cost.observe(2, 0.5)  # never cheaper with more tokens: times are non-decreasing in the step size
    assert cost.time(1) <= cost.time(2) <= cost.time(8)


def test_graph_keys_cover_decode_and_verification_steps():
    """Which CUDA graph (requests, tokens) a step replays: decodes the smallest request bucket; verification steps
    (queries of up to k + 1 tokens, any mix of draft counts) the smallest bucket whose tokens hold them; longer
    queries, more requests than the verification buckets, or more tokens than the buffers run eagerly."""
    from types import SimpleNamespace

    from aserve.worker.cuda_graphs import VERIFY_MAX_REQUESTS, StepGraphs

    runner = SimpleNamespace(max_num_batched_tokens=256, cuda_graph_sizes=None)
    graphs = StepGraphs(runner, None, None, max_requests=128, max_query_len=5)
    assert graphs.key_for(1, 1, 1) == (1, 1) and graphs.key_for(3, 3, 1) == (4, 4)
    assert graphs.key_for(128, 128, 1) == (128, 128) and graphs.key_for(129, 129, 1) is None
    assert graphs.key_for(1, 5, 5) == (1, 5)  # one request, 4 drafts
    assert graphs.key_for(3, 3 + 4, 5) == (4, 8)  # three requests, one with 4 drafts: 7 tokens in 4 x 2
    assert graphs.key_for(16, 80, 5) == (16, 80)
    assert graphs.key_for(2, 7, 6) is None  # a longer query than verification graphs take (a prompt chunk)
    assert graphs.key_for(VERIFY_MAX_REQUESTS + 1, VERIFY_MAX_REQUESTS + 2, 2) is None
    assert graphs.key_for(64, 320, 5) is None  # 64 x 5 tokens: more than the buffers hold
    assert all(t <= 256 and b <= t <= 5 * b for b, t in graphs.keys)
    decode_only = StepGraphs(runner, None, None, max_requests=128)
    assert decode_only.key_for(1, 2, 2) is None and decode_only.key_for(8, 8, 1) == (8, 8)
