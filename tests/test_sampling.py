"""Sampling parameters checked on real output of a tiny model (references computed with transformers)."""

import random

import pytest
import torch
from tiny_models import EOS_ID

from aserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, debug_invariants=True)


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def prompt(n, seed=0):
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(2, 384) for _ in range(n)]}


def gen1(llm, p, **kw):
    return llm.generate(p, SamplingParams(**kw))[0].outputs[0]


def test_seeded_sampling_is_reproducible_regardless_of_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(prompt(10), params)[0].outputs[0].token_ids
    others = [prompt(5 + i, seed=i + 10) for i in range(5)]
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(others[:2] + [prompt(10)] + others[2:], [noise, noise, params, noise, noise, noise])
    assert batch[2].outputs[0].token_ids == alone
    other_seed = gen1(llm, prompt(10), temperature=1.0, seed=99, max_tokens=20, ignore_eos=True).token_ids
    assert other_seed != alone


def test_n_samples(llm):
    out = llm.generate(prompt(12), SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert llm.engine.core.kv_manager.pool.num_free_blocks == llm.engine.core.num_kv_blocks


def test_n_samples_share_prompt_blocks_without_prefix_caching(tiny_model):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, enable_prefix_caching=False, debug_invariants=True)
    engine = llm.engine
    engine.add_request("r", prompt(40), SamplingParams(n=3, temperature=1.0, max_tokens=4))
    engine.step()
    # 40 prompt tokens: blocks 0 and 1 (full) are shared by all three samples; each has its own third block.
    blocks = [engine.core.kv_manager.block_ids(f"r#{i}") for i in range(3)]
    assert blocks[0][:2] == blocks[1][:2] == blocks[2][:2]
    assert len({b[2] for b in blocks}) == 3
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.kv_manager.stats.hits == 2 * 32  # the second and third sample hit two blocks each
    # An unrelated request with the same prompt does not hit those blocks.
    engine.add_request("s", prompt(40), SamplingParams(max_tokens=1))
    engine.step()
    assert engine.core.kv_manager.stats.hits == 2 * 32


def test_greedy_equivalents(llm):
    p = prompt(20, seed=3)
    greedy = gen1(llm, p, temperature=0, max_tokens=12, ignore_eos=True).token_ids
    assert gen1(llm, p, temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True, seed=1).token_ids == greedy
    assert gen1(llm, p, temperature=0.8, top_p=1e-6, max_tokens=12, ignore_eos=True, seed=2).token_ids == greedy
    assert gen1(llm, p, temperature=0.8, min_p=1.0, max_tokens=12, ignore_eos=True, seed=3).token_ids == greedy


def test_top_k_restricts_support(llm, hf_model):
    p = prompt(15, seed=4)
    logits = hf_model(torch.tensor([p["prompt_token_ids"]])).logits[0, -1]
    top2 = set(logits.topk(2).indices.tolist())
    outs = llm.generate([p] * 40, SamplingParams(temperature=5.0, top_k=2, max_tokens=1))
    seen = {o.outputs[0].token_ids[0] for o in outs}
    assert seen <= top2 and len(seen) == 2


def test_logprobs_match_transformers(llm, hf_model):
    p = prompt(9, seed=5)
    out = gen1(llm, p, temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    ids = list(p["prompt_token_ids"])
    assert len(out.logprobs) == 6
    for token_id, lp in zip(out.token_ids, out.logprobs):
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)
        top = ref.topk(3)
        assert token_id in lp and lp[token_id].rank == 1  # greedy: the sampled token is the most likely
        assert abs(lp[token_id].logprob - ref[token_id].item()) < 1e-4
        assert len(lp) == 3  # the sampled token is also the top-1
        for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert lp[tid].rank == rank and abs(lp[tid].logprob - value) < 1e-4
            assert lp[tid].decoded_token == llm.get_tokenizer().decode([tid])
        ids.append(token_id)


def test_penalties_match_reference_loop(llm, hf_model):
    p = prompt(60, seed=6)
    kw = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    got = gen1(llm, p, temperature=0, max_tokens=15, ignore_eos=True, **kw).token_ids
    prompt_ids = list(p["prompt_token_ids"])
    out: list[int] = []
    for _ in range(15):
        logits = hf_model(torch.tensor([prompt_ids + out])).logits[0, -1].float()
        seen = set(prompt_ids) | set(out)
        for t in seen:
            logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
        for t in set(out):
            logits[t] -= 0.4 * out.count(t) + 0.5
        out.append(int(logits.argmax()))
    assert got == out
    assert got != gen1(llm, p, temperature=0, max_tokens=15, ignore_eos=True).token_ids


def test_logit_bias_forces_bans_and_shifts_tokens(llm, hf_model):
    """OpenAI's logit_bias: +100 forces a token (greedy or sampled), -100 on the greedy token leaves the runner-up
    (transformers' logits); a smaller bias shifts the logits by exactly that much (the reference loop); logprobs
    stay those of the raw logits, as in vLLM."""
    p = prompt(15, seed=9)
    ids = list(p["prompt_token_ids"])
    logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
    first, second = logits.topk(2).indices.tolist()
    for temperature in (0, 1.0):
        forced = gen1(llm, p, temperature=temperature, max_tokens=5, ignore_eos=True, logit_bias={7: 100}, seed=3)
        assert forced.token_ids == [7] * 5
    banned = gen1(llm, p, temperature=0, max_tokens=1, logit_bias={first: -100}, logprobs=0)
    assert banned.token_ids == [second]
    raw = torch.log_softmax(logits, -1)[second].item()
    assert abs(banned.logprobs[0][second].logprob - raw) < 1e-4
    bias = {5: 3.0, 11: 2.5, first: -1.5}
    got = gen1(llm, p, temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias).token_ids
    out: list[int] = []
    for _ in range(8):
        row = hf_model(torch.tensor([ids + out])).logits[0, -1].float()
        for t, b in bias.items():
            row[t] += b
        out.append(int(row.argmax()))
    assert got == out and got != gen1(llm, p, temperature=0, max_tokens=8, ignore_eos=True).token_ids
    with pytest.raises(ValueError, match="vocabulary"):
        gen1(llm, p, logit_bias={10**6: 1.0})


def test_logit_bias_with_async_scheduling(tiny_model):
    """The overlapped sampler (async scheduling) applies logit_bias too, greedy and sampled."""
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, async_scheduling=True, max_model_len=128)
    params = [SamplingParams(temperature=t, max_tokens=6, ignore_eos=True, seed=1, logit_bias={9: 100})
              for t in (0, 0.8)]  # fmt: skip
    outs = llm.generate([prompt(4), prompt(6)], params)
    assert [o.outputs[0].token_ids for o in outs] == [[9] * 6, [9] * 6]


def test_allowed_token_ids(llm, hf_model, tiny_model):
    """vLLM's allowed_token_ids: only those tokens are sampled (greedy: the most likely of them by transformers'
    logits), logprobs stay those of the raw logits; the overlapped sampler (async scheduling) masks too."""
    p = prompt(15, seed=9)
    logits = hf_model(torch.tensor([p["prompt_token_ids"]])).logits[0, -1].float()
    allowed = [3, 50, 200]
    greedy = gen1(llm, p, temperature=0, max_tokens=1, allowed_token_ids=allowed, logprobs=0)
    [token] = greedy.token_ids
    assert token == max(allowed, key=lambda t: logits[t].item())
    assert abs(greedy.logprobs[0][token].logprob - torch.log_softmax(logits, -1)[token].item()) < 1e-4
    sampled = gen1(llm, p, temperature=1.5, seed=2, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed)
    assert set(sampled.token_ids) <= set(allowed) and len(set(sampled.token_ids)) > 1
    overlapped = LLM(tiny_model, dtype="float32", enforce_eager=True, async_scheduling=True, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[9, 11])
    assert set(overlapped.generate(p, params)[0].outputs[0].token_ids) <= {9, 11}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        gen1(llm, p, allowed_token_ids=[10**6])


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = prompt(300, seed=4)["prompt_token_ids"]  # longer than max_model_len (256)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=4, temperature=0,
                                                                 truncate_prompt_tokens=200))[0]  # fmt: skip
    assert out.prompt_token_ids == ids[-200:]
    kept = gen1(llm, {"prompt_token_ids": ids[-200:]}, max_tokens=4, temperature=0)
    assert out.outputs[0].token_ids == kept.token_ids
    with pytest.raises(ValueError, match="max_model_len"):
        gen1(llm, {"prompt_token_ids": ids}, truncate_prompt_tokens=257)


def test_eos_min_tokens_ignore_eos_stop_token_ids(llm):
    # This prompt makes the tiny model emit EOS after 8 tokens (see the parity references).
    p = {"prompt_token_ids": prompt(3)["prompt_token_ids"]}
    plain = gen1(llm, p, temperature=0, max_tokens=24)
    assert plain.token_ids[-1] == EOS_ID and plain.finish_reason == "stop" and len(plain.token_ids) == 8
    longer = gen1(llm, p, temperature=0, max_tokens=24, min_tokens=12)
    assert len(longer.token_ids) >= 12 and EOS_ID not in longer.token_ids[:12]
    assert longer.token_ids[:7] == plain.token_ids[:7]
    ignored = gen1(llm, p, temperature=0, max_tokens=24, ignore_eos=True)
    assert len(ignored.token_ids) == 24 and ignored.finish_reason == "length"
    stop_id = plain.token_ids[3]
    stopped = gen1(llm, p, temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    assert stopped.token_ids == plain.token_ids[: plain.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    # the stop token (like EOS) is no text, even with special tokens kept
    kept = gen1(llm, p, temperature=0, max_tokens=24, stop_token_ids=[stop_id], skip_special_tokens=False)
    assert kept.text == llm.get_tokenizer().decode(stopped.token_ids[:-1], skip_special_tokens=False)
    assert gen1(llm, p, temperature=0, max_tokens=24, skip_special_tokens=False).text == llm.get_tokenizer().decode(
        plain.token_ids[:-1], skip_special_tokens=False
    )


def test_stop_strings(llm):
    p = prompt(8, seed=8)
    full = gen1(llm, p, temperature=0, max_tokens=30, ignore_eos=True)
    text = full.text
    assert len(text) > 10
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = gen1(llm, p, temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "zzzz-never"])
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) < len(full.token_ids)
    kept = gen1(llm, p, temperature=0, max_tokens=30, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_async_scheduling_gives_the_same_outputs(llm, tiny_model, monkeypatch):
    """One batch mixing every kind of request: async scheduling (step N+1 launched before step N's tokens are on
    the host) returns exactly what one-step-at-a-time scheduling does. Seeded sampling, n, stop strings, stop ids,
    EOS, logprobs and min_tokens overlap; penalties switch the overlap off while they are live."""
    from aserve.worker.model_runner import ModelRunner

    stop_text = gen1(llm, prompt(8, seed=8), temperature=0, max_tokens=30, ignore_eos=True).text[12:15]
    cases = [
        (prompt(3), dict(temperature=0, max_tokens=24)),  # EOS after 8 tokens
        (prompt(20, seed=1), dict(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True)),
        (prompt(9, seed=2), dict(temperature=1.0, top_k=20, top_p=0.9, seed=7, n=2, max_tokens=16)),
        (prompt(8, seed=8), dict(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_text])),
        (prompt(30, seed=3), dict(temperature=0, max_tokens=1)),
        (prompt(12, seed=4), dict(temperature=0.7, seed=11, max_tokens=12, logprobs=2)),
        (prompt(3), dict(temperature=0, max_tokens=20, min_tokens=10, logprobs=0)),
        (prompt(14, seed=5), dict(temperature=0.8, seed=13, max_tokens=14, presence_penalty=0.5)),
    ]

    def run(engine_llm, subset):
        outs = engine_llm.generate([p for p, _ in subset], [SamplingParams(**kw) for _, kw in subset])
        # Logprobs to 4 decimals: a batch of another size (a finished request still in the step after its EOS)
        # may change the last bits of a matmul.
        return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                  c.logprobs and [{t: (round(lp.logprob, 4), lp.rank) for t, lp in d.items()} for d in c.logprobs])
                 for c in o.outputs] for o in outs]  # fmt: skip

    overlapped = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, debug_invariants=True,
                     async_scheduling=True)  # fmt: skip
    patched = []
    patch = ModelRunner._patch_inflight
    monkeypatch.setattr(ModelRunner, "_patch_inflight", lambda self, dst, src, tokens: patched.append(len(dst))
                        or patch(self, dst, src, tokens))  # fmt: skip
    no_penalties = cases[:-1]
    assert run(overlapped, no_penalties) == run(llm, no_penalties)
    assert sum(patched) > 50  # the steps did overlap: inputs came from the step still running
    patched.clear()
    assert run(overlapped, cases) == run(llm, cases)
    engine = overlapped.engine
    assert engine.core.inflight is None and not engine.core._sync_requests
    assert engine.core.kv_manager.pool.num_free_blocks == engine.core.num_kv_blocks


def test_max_tokens_defaults_to_context_left(tiny_model):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=40)
    out = gen1(llm, prompt(30), temperature=0, max_tokens=None, ignore_eos=True)
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "kw",
    [
        dict(n=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-3),
        dict(max_tokens=0),
        dict(min_p=2),
        dict(stop=[""]),
        dict(logprobs=-2),
        dict(min_tokens=5, max_tokens=2),
        dict(presence_penalty=3),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={3: 101.0}),
        dict(logit_bias={3: float("nan")}),
        dict(logit_bias={"3": 1.0}),
        dict(logit_bias=[3]),
        dict(allowed_token_ids=[]),
        dict(allowed_token_ids=[-1]),
        dict(truncate_prompt_tokens=0),
        dict(truncate_prompt_tokens=-2),
    ],
)
def test_invalid_sampling_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


class _FakeRequest:
    def __init__(self, params):
        self.sampling_params = params
        self.generator = None
        self.num_output_tokens = 0
        self.output_token_ids = []
        self.prompt_token_ids = [0]
        self.eos_token_id = None
        self.grammar = None


def test_sampler_frequencies_follow_the_distribution():
    """Temperature, top-k and top-p reshape the distribution exactly as specified (20,000 draws)."""
    from aserve.worker.sampler import Sampler

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20_000
    sampler = Sampler(torch.device("cpu"), seed=0)

    def freqs(params, expected):
        reqs = [_FakeRequest(params) for _ in range(n)]
        tokens = torch.tensor([t for (t,) in sampler(logits.expand(n, -1).clone(), reqs).token_ids])
        got = torch.bincount(tokens, minlength=6).double() / n
        sigma = (expected * (1 - expected) / n).sqrt()
        assert torch.all((got - expected).abs() <= 4 * sigma + 1e-9), (got, expected)

    p = torch.softmax(logits[0].double() / 0.7, -1)
    freqs(SamplingParams(temperature=0.7), p)
    top3 = torch.softmax(logits[0].double(), -1)
    top3[3:] = 0
    freqs(SamplingParams(temperature=1.0, top_k=3), top3 / top3.sum())
    # top_p=0.8: the smallest set of most likely tokens whose mass reaches 0.8.
    full = torch.softmax(logits[0].double(), -1)
    keep = (full.cumsum(0) - full) < 0.8
    nucleus = torch.where(keep, full, torch.zeros_like(full))
    freqs(SamplingParams(temperature=1.0, top_p=0.8), nucleus / nucleus.sum())


def test_generate_shows_progress_unless_asked_not_to(llm, capsys):
    params = SamplingParams(max_tokens=2)
    llm.generate(["one", "two", "three"], params)
    err = capsys.readouterr().err
    assert "Generating" in err and "3/3" in err
    llm.generate(["one"], params, use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_reports_each_requests_accepted_drafts_and_last_token_on_the_device(temperature):
    """What a model drafter launches the next drafts from (on_emitted) is what the host result says: per request,
    the number of drafts accepted and the token it emits last; requests without drafts included."""
    from aserve.worker.sampler import Sampler

    gen = torch.Generator().manual_seed(4)
    sampler = Sampler(torch.device("cpu"), seed=1)
    for trial in range(20):
        lens = [int(x) for x in torch.randint(0, 5, (6,), generator=gen)]
        logits = torch.randn(sum(lens) + len(lens), 12, generator=gen) * 3
        argmax, drafts, row = logits.argmax(-1).tolist(), [], 0
        for n in lens:  # drafts mostly right, so that long accepted runs occur
            drafts.append([argmax[row + j] if torch.rand(1, generator=gen) < 0.8 else 11 - argmax[row + j]
                           for j in range(n)])  # fmt: skip
            row += n + 1
        reqs = [_FakeRequest(SamplingParams(temperature=temperature, seed=trial)) for _ in lens]
        seen = []
        out = sampler(logits, reqs, drafts if any(lens) else None,
                      on_emitted=lambda accepted, last: seen.append((accepted.tolist(), last.tolist())))  # fmt: skip
        assert seen == [([len(t) - 1 for t in out.token_ids], [t[-1] for t in out.token_ids])]
