"""Speculative decoding: greedy outputs unchanged by every method, sampling distribution unchanged (chi-square),
no KV leaks, the adaptive policy, metrics."""

import collections
import json
import random

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.core.scheduler import Scheduler
from aserve.spec.policy import StepCostModel
from aserve.worker.model_runner import ModelRunner
from aserve.worker.sampler import Sampler

MAX_NEW = 40


def prompts_for():
    rng = random.Random(3)
    return [{"prompt_token_ids": ([5, 6, 7, 8, 9] * 8)[:n]} for n in (12, 25)] + [
        {"prompt_token_ids": [rng.randrange(2, 384) for _ in range(n)]} for n in (7, 33, 60)
    ]


@pytest.fixture(scope="module")
def greedy_reference(tiny_model):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    return [o.outputs[0].token_ids for o in llm.generate(prompts_for(), params)]


def spec_configs(tiny_model_factory):
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        "layer_skip": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3},
        "draft_model_self": {"method": "draft_model", "model": tiny_model_factory("gqa"), "num_speculative_tokens": 4},
        "draft_model_other": {"method": "draft_model", "model": tiny_model_factory("mha"), "num_speculative_tokens": 2},
        "auto": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": "auto"},
    }


@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model_self", "draft_model_other", "auto"])
@pytest.mark.parametrize("engine", ["default", "chunked-16", "preemption", "async"])
def test_greedy_outputs_unchanged(tiny_model, tiny_model_factory, greedy_reference, method, engine):
    extra = {"default": {}, "chunked-16": {"max_num_batched_tokens": 16},
             "preemption": {"num_gpu_blocks_override": 12, "max_model_len": 128},
             # with CUDA graphs on a GPU
             "async": {"async_scheduling": True, "enforce_eager": not torch.cuda.is_available()}}[engine]  # fmt: skip
    extra = {"enforce_eager": True, **extra}
    llm = LLM(tiny_model, dtype="float32", debug_invariants=True,
              speculative_config=spec_configs(tiny_model_factory)[method], **extra)  # fmt: skip
    outs = llm.generate(prompts_for(), SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference
    stats = llm.engine.stats
    if method != "auto":
        assert stats.spec_draft_tokens_total > 0
    if method == "draft_model_self":  # the target drafting for itself: every draft is accepted
        assert stats.spec_accepted_tokens_total == stats.spec_draft_tokens_total
        assert stats.steps_total < MAX_NEW  # several tokens per step
    if engine == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv_manager.pool.num_free_blocks == llm.engine.core.num_kv_blocks


def test_aborted_speculative_requests_free_their_blocks(tiny_model, tiny_model_factory):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, debug_invariants=True,
              speculative_config=spec_configs(tiny_model_factory)["draft_model_self"])  # fmt: skip
    engine = llm.engine
    for i, p in enumerate(prompts_for()):
        engine.add_request(str(i), p, SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert (
        engine.stats.spec_draft_tokens_total > 0
        and engine.core.kv_manager.pool.num_free_blocks < engine.core.num_kv_blocks
    )
    for i in range(len(prompts_for())):
        engine.abort_request(str(i))
    assert not engine.has_unfinished_requests()
    assert (
        engine.core.kv_manager.pool.num_free_blocks == engine.core.num_kv_blocks
        and not engine.core.kv_manager.req_to_blocks
    )


def test_stop_conditions_inside_an_accepted_run(tiny_model, tiny_model_factory, greedy_reference):
    """max_tokens and stop tokens that fall inside a run of accepted drafts end the request there."""
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True,
              speculative_config=spec_configs(tiny_model_factory)["draft_model_self"])  # fmt: skip
    ref = greedy_reference[3]
    out = llm.generate(prompts_for()[3], SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
    assert out.token_ids == ref[:7] and out.finish_reason == "length"
    stop_id = ref[10]
    out = llm.generate(prompts_for()[3], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))
    assert out[0].outputs[0].token_ids == ref[: ref.index(stop_id) + 1]


# -- the output distribution --------------------------------------------------------------------------------------

N_SAMPLES = 20_000
PROMPT8 = {"prompt_token_ids": [2, 3, 4, 5, 2, 3, 4]}


def sample_pairs(path, spec, seed, top_p=1.0, async_scheduling=False):
    """Tokens 2 and 3 of N_SAMPLES requests (with speculation, both come out of one verification step)."""
    # Async scheduling with CUDA graphs on a GPU
    eager = not (async_scheduling and torch.cuda.is_available())
    llm = LLM(path, dtype="float32", enforce_eager=eager, speculative_config=spec, seed=seed, max_num_seqs=512,
              max_num_batched_tokens=4096, async_scheduling=async_scheduling)  # fmt: skip
    outs = llm.generate([PROMPT8] * N_SAMPLES, SamplingParams(temperature=1.0, top_p=top_p, max_tokens=3,
                                                              ignore_eos=True))  # fmt: skip
    return collections.Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs), llm.engine.stats


def _chi2_sf(stat: float, df: int) -> float:
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()  # fmt: skip


def chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """Two-sample chi-square test of homogeneity; cells expected below 5 are pooled."""
    cells = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    table, pooled = [], [0, 0]
    for c in cells:
        total = a[c] + b[c]
        if min(total * na, total * nb) / (na + nb) < 5:
            pooled[0] += a[c]
            pooled[1] += b[c]
        else:
            table.append((a[c], b[c]))
    if sum(pooled):
        table.append(tuple(pooled))
    stat = 0.0
    for x, y in table:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return _chi2_sf(stat, len(table) - 1)


def goodness_of_fit_p(counts: collections.Counter, probs: dict) -> float:
    """Chi-square test of samples against known cell probabilities (every cell expected >= 5 here)."""
    n = sum(counts.values())
    stat = sum((counts[c] - n * p) ** 2 / (n * p) for c, p in probs.items())
    return _chi2_sf(stat, len(probs) - 1)


@pytest.fixture(scope="module")
def vocab8(tiny_model_factory):
    return tiny_model_factory("vocab8")


@pytest.fixture(scope="module")
def exact_pairs(vocab8):
    """P(token 2, token 3) computed exactly with transformers: sum over token 1 of p(t1) p(t2|t1) p(t3|t1,t2)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vocab8, dtype=torch.float32).eval()
    prompt = PROMPT8["prompt_token_ids"]

    def next_probs(seq):
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0, -1].double().softmax(-1).tolist()

    exact = collections.defaultdict(float)
    for t1, p1 in enumerate(next_probs(prompt)):
        for t2, p2 in enumerate(next_probs(prompt + [t1])):
            for t3, p3 in enumerate(next_probs(prompt + [t1, t2])):
                exact[(t2, t3)] += p1 * p2 * p3
    assert min(exact.values()) * N_SAMPLES > 5  # every cell is populated: the tests have power everywhere
    return dict(exact)


# The runs are deterministic (fixed seeds, CPU): each test's outcome is fixed; the 1 % level is the chance of a
# false rejection for a seed drawn at random.
@pytest.fixture(scope="module")
def plain_pairs(vocab8, exact_pairs):
    pairs = sample_pairs(vocab8, None, seed=1)[0]
    assert goodness_of_fit_p(pairs, exact_pairs) > 0.01  # the plain sampler itself is right
    return pairs


NGRAM8 = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SKIP8 = {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("spec", [NGRAM8, SKIP8], ids=["ngram", "layer_skip"])
def test_speculative_sampling_is_lossless(vocab8, plain_pairs, exact_pairs, spec, async_scheduling):
    pairs, stats = sample_pairs(vocab8, spec, seed=2, async_scheduling=async_scheduling)
    assert stats.spec_draft_tokens_total > N_SAMPLES and stats.spec_accepted_tokens_total > N_SAMPLES // 10
    assert chi_square_p(plain_pairs, pairs) > 0.01
    assert goodness_of_fit_p(pairs, exact_pairs) > 0.01


def test_a_wrong_verifier_is_caught(vocab8, plain_pairs, exact_pairs, monkeypatch):
    real = Sampler._candidates

    def accept_always(self, logits, rows, drafts, draft_probs):
        candidates, accepted = real(self, logits, rows, drafts, draft_probs)
        if accepted is not None:
            accepted = self._draft_ids(drafts, logits.device) >= 0
        return candidates, accepted

    monkeypatch.setattr(Sampler, "_candidates", accept_always)
    pairs, _ = sample_pairs(vocab8, SKIP8, seed=2)
    assert chi_square_p(plain_pairs, pairs) < 0.01
    assert goodness_of_fit_p(pairs, exact_pairs) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM8, SKIP8], ids=["ngram", "layer_skip"])
def test_speculative_sampling_is_lossless_with_top_p(vocab8, spec):
    plain = sample_pairs(vocab8, None, seed=1, top_p=0.8)[0]
    pairs, _ = sample_pairs(vocab8, spec, seed=2, top_p=0.8)
    assert chi_square_p(plain, pairs) > 0.01


# -- pieces ---------------------------------------------------------------------------------------------------------


def test_layer_skip_needs_fewer_layers_than_the_model(tiny_model):
    with pytest.raises(ValueError, match="num_layers"):
        LLM(tiny_model, dtype="float32", enforce_eager=True,
            speculative_config={"method": "layer_skip", "num_layers": 2})  # fmt: skip


@pytest.mark.parametrize("spec", ["ngram-auto", "ngram-4"])
def test_async_scheduling_overlaps_steps_without_drafts(tiny_model, greedy_reference, spec, monkeypatch):
    """Speculation with async scheduling: greedy outputs unchanged; with drafts rarely accepted, auto holds the
    requests at k = 0 and most steps are launched behind the one in flight. The step costs auto prices are pinned
    (a step of n tokens: 1 + n / 8 ms; measured ones on a loaded machine would now and then make drafts look
    free)."""
    k = "auto" if spec == "ngram-auto" else 4
    monkeypatch.setattr(ModelRunner, "measure_step_times", lambda self: {n: 1e-3 * (1 + n / 8) for n in (1, 8, 64)})
    monkeypatch.setattr(StepCostModel, "observe", lambda self, num_tokens, seconds: None)
    monkeypatch.setattr(StepCostModel, "observe_sync_overhead", lambda self, seconds: None)
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, async_scheduling=True, debug_invariants=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1})  # fmt: skip
    outs, overlapped, launches = _generate_counting_overlap(llm)
    assert [o.outputs[0].token_ids for o in outs] == greedy_reference
    if spec == "ngram-auto":
        assert overlapped > len(launches) // 2, launches
    else:
        assert llm.engine.stats.spec_draft_tokens_total > 0
    assert llm.engine.core.kv_manager.pool.num_free_blocks == llm.engine.core.num_kv_blocks


def _generate_counting_overlap(llm):
    """Generates prompts_for() greedily. -> (outputs, steps launched behind one in flight, every launch as
    (overlap, behind))."""
    core = llm.engine.core
    launches = []
    launch = core.launch

    def counting(work):
        if work.sched is not None:  # (None: only waits for the step in flight)
            launches.append((work.overlap, core.inflight is not None))
        return launch(work)

    core.launch = counting
    outs = llm.generate(prompts_for(), SamplingParams(temperature=0, max_tokens=MAX_NEW))
    return outs, sum(1 for overlap, behind in launches if overlap and behind), launches


def test_steps_after_which_no_ngram_can_match_overlap(tiny_model, greedy_reference, monkeypatch):
    """n-gram k = 4, prompt_lookup_min 2, async scheduling: a step after whose token no n-gram can match (its request's
    last token occurs nowhere earlier) asks for no drafts, so the next step is launched behind it: more steps
    overlap than with every step asking, the same greedy outputs, drafts still proposed where the prompts repeat."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    results = {}
    for rule in (True, False):
        if not rule:
            monkeypatch.setattr(Scheduler, "_no_ngram_can_follow", lambda self, request, num_new: False)
        llm = LLM(tiny_model, dtype="float32", enforce_eager=True, async_scheduling=True, debug_invariants=True,
                  speculative_config=spec)  # fmt: skip
        outs, overlapped, launches = _generate_counting_overlap(llm)
        assert [o.outputs[0].token_ids for o in outs] == greedy_reference
        assert llm.engine.stats.spec_draft_tokens_total > 0
        assert llm.engine.core.kv_manager.pool.num_free_blocks == llm.engine.core.num_kv_blocks
        results[rule] = overlapped
    assert results[True] > results[False], results


def test_spec_metrics_exported(tiny_model, tiny_model_factory):
    from aserve.core.metrics import PrometheusMetrics

    llm = LLM(tiny_model, dtype="float32", enforce_eager=True,
              speculative_config=spec_configs(tiny_model_factory)["draft_model_self"])  # fmt: skip
    metrics = PrometheusMetrics("tiny")
    llm.engine.stats.add_listener(metrics)
    llm.generate(prompts_for()[:2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    text = metrics.render().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("aserve:spec_decode") and 'position="0"' not in line}  # fmt: skip
    assert values["aserve:spec_decode_num_drafts_total"] > 0
    assert values["aserve:spec_decode_num_accepted_tokens_total"] == values["aserve:spec_decode_num_draft_tokens_total"]
    assert 'aserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text


# -- the embedded model, and serving -------------------------------------------------------------------------------

PASSAGE = (
    'Copy the following text: "Paged attention stores keys and values in fixed-size blocks. Prefix caching shares '
    'blocks between requests."'
)


@pytest.mark.parametrize(
    "spec",
    [{"method": "ngram", "num_speculative_tokens": 4},
     {"method": "layer_skip", "num_layers": 10, "num_speculative_tokens": 3},
     {"method": "ngram", "num_speculative_tokens": "auto"},
     {"method": "draft_model", "model": None, "num_speculative_tokens": 3}],
    ids=["ngram", "layer_skip", "auto", "draft_model"],
)  # fmt: skip
def test_default_model_greedy_unchanged(spec):
    """SmolLM2 in float32 (bf16 rounding could flip near-ties between batch shapes): same greedy text. draft_model:
    the embedded model drafts for itself (its converted directory as the draft), with its own KV cache."""
    if spec["method"] == "draft_model":
        from aserve.models.model_path import resolve_model

        spec = {**spec, "model": resolve_model(None)[0]}
    questions = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", PASSAGE)]
    params = SamplingParams(temperature=0, max_tokens=60)
    base = LLM(dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_memory_gb=0.1).chat(questions, params)
    llm = LLM(dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_memory_gb=0.1, speculative_config=spec)
    outs = llm.chat(questions, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert "Paris" in outs[0].outputs[0].text
    if spec["method"] == "ngram" and spec["num_speculative_tokens"] != "auto":
        assert llm.engine.stats.spec_accepted_tokens_total > 10  # the repeated sentence is drafted from the prompt


async def test_server_streams_with_speculation(tiny_model, tiny_model_factory, greedy_reference):
    from aiohttp.test_utils import TestClient, TestServer

    from aserve import EngineArgs
    from aserve.engine.async_engine import AsyncEngine
    from aserve.entrypoints.openai.server import build_app

    engine = AsyncEngine.from_engine_args(EngineArgs(
        model=tiny_model, dtype="float32", enforce_eager=True,
        speculative_config=json.dumps({"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3}),
    ))  # fmt: skip
    client = TestClient(TestServer(build_app(engine, "tiny"), handler_cancellation=True))
    await client.start_server()
    try:
        prompt = prompts_for()[3]["prompt_token_ids"]
        resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                                                            "stream": True})  # fmt: skip
        text = await resp.text()
        tokens = engine.engine.tokenizer.encode("".join(
            __import__("json").loads(e[6:])["choices"][0]["text"] for e in text.split("\n\n") if e.startswith("data: {")
        ), add_special_tokens=False)  # fmt: skip
        assert engine.engine.stats.spec_accepted_tokens_total > 0
        metrics = await (await client.get("/metrics")).text()
        assert "aserve:spec_decode_num_accepted_tokens_total" in metrics
        assert text.endswith("data: [DONE]\n\n") and tokens
    finally:
        await client.close()
