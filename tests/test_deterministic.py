"""Deterministic mode (`LLM(deterministic=True)`, `aserve serve --deterministic`): a request's token ids and logprobs
are the same bits alone and beside random other requests, with any token budget (chunked prompts), with and without
a prefix-cache hit, through forced preemption, with n-gram and layer-skip speculation and async scheduling, in float32
and bf16, greedy and seeded; through the HTTP server with the openai client. The kernels themselves:
tests/test_batch_invariant_kernels.py."""

import concurrent.futures
import random

import pytest

from aserve import LLM, SamplingParams
from aserve.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="deterministic mode on CPU needs the C kernels")

MAX_NEW = 24
# Repeats, so that n-gram speculation finds drafts in it; long enough to be chunked by a budget of 16 or 64.
TARGET = {"prompt_token_ids": ([17, 42, 99, 5, 260, 31] * 8)[:43]}
TARGETS = {
    "greedy": SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True),
    "seeded": SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True
    ),
}
ENGINES = {
    "budget-16": {"max_num_batched_tokens": 16},
    "budget-64": {"max_num_batched_tokens": 64},
    "budget-64-no-prefix-cache": {"max_num_batched_tokens": 64, "enable_prefix_caching": False},
    "budget-2048": {"max_num_batched_tokens": 2048},
    "preemption": {"num_gpu_blocks_override": 12, "max_model_len": 128},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}},
    "layer_skip": {"speculative_config": {"method": "layer_skip", "num_layers": 1, "num_speculative_tokens": 3}},
    "async": {"async_scheduling": True, "max_num_batched_tokens": 64},
}


def others(n: int, seed: int, vocab: int = 384, max_prompt: int = 60) -> list[tuple[dict, SamplingParams]]:
    """n random requests: random prompts and lengths, greedy / seeded / unseeded sampling, with and without
    logprobs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(rng.randint(1, max_prompt))]}
        kind = rng.choice(["greedy", "seeded", "random"])
        params = SamplingParams(
            temperature=0 if kind == "greedy" else rng.choice([0.7, 1.0]),
            seed=rng.randrange(1 << 30) if kind == "seeded" else None,
            max_tokens=rng.randint(1, 20),
            logprobs=rng.choice([None, 2]),
        )
        out.append((prompt, params))
    return out


def result(output) -> tuple:
    """A completion's token ids and every logprob entry, exactly."""
    c = output.outputs[0]
    logprobs = [sorted((t, lp.logprob, lp.rank) for t, lp in entry.items()) for entry in c.logprobs]
    return c.token_ids, logprobs


def run_targets(llm: LLM, n_others: int, seed: int) -> dict:
    """Both targets (greedy, seeded) at random places among n_others random requests -> kind -> result."""
    batch = others(n_others, seed)
    rng = random.Random(seed + 1)
    for kind, params in TARGETS.items():
        batch.insert(rng.randint(0, len(batch)), (dict(TARGET, kind=kind), params))
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p, _ in batch], [s for _, s in batch],
                        use_tqdm=False)  # fmt: skip
    return {p["kind"]: result(o) for (p, _), o in zip(batch, outs) if "kind" in p}


def deterministic_llm(model: str, dtype: str, **kwargs) -> LLM:
    return LLM(model, dtype=dtype, deterministic=True, debug_invariants=True, enforce_eager=True, **kwargs)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def reference(request, tiny_model):
    """Each target alone, in an engine of its own (default budget, no prefix cache)."""
    llm = deterministic_llm(tiny_model, request.param, enable_prefix_caching=False)
    return request.param, {kind: result(llm.generate([TARGET], params, use_tqdm=False)[0])
                           for kind, params in TARGETS.items()}  # fmt: skip


def check_engine(tiny_model, reference, engine: str, batch_sizes) -> LLM:
    dtype, expected = reference
    llm = deterministic_llm(tiny_model, dtype, **ENGINES[engine])
    assert {kind: result(llm.generate([TARGET], params, use_tqdm=False)[0]) for kind, params in TARGETS.items()} == (
        expected
    ), "alone"
    for n in batch_sizes:  # (a prefix-cache hit where the engine has the cache: the target ran alone before)
        assert run_targets(llm, n, seed=n) == expected, f"beside {n} others"
    return llm


@pytest.mark.parametrize("engine", [e for e in ENGINES if e not in ("budget-64", "budget-2048")])
def test_target_alone_equals_target_in_batches(tiny_model, reference, engine):
    llm = check_engine(tiny_model, reference, engine, batch_sizes=(9,))
    if reference[0] == "bfloat16":  # alone, decode steps ran the CPU one-token forward; in batches, the modules
        assert llm.engine.core.runner.model.cpu_one_token is not None
    stats = llm.engine.stats
    if engine == "preemption":
        assert stats.num_preemptions_total > 0
    if engine in ("ngram", "layer_skip"):  # drafts verified (k + 1-token steps); the first layer's, often accepted
        assert stats.spec_draft_tokens_total > 0
        assert engine == "ngram" or stats.spec_accepted_tokens_total > 0
    if "prefix-cache" not in engine and engine != "preemption":
        assert stats.prefix_cache_hits_total > 0


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_target_in_batches_up_to_63_others(tiny_model, reference, engine):
    check_engine(tiny_model, reference, engine, batch_sizes=(1, 2, 7, 15, 31, 48, 63))


def test_draft_model_speculation(tiny_model, tiny_model_factory, reference):
    """A separate draft model (normal kernels: drafts only propose) with sampled drafts: alone equals in a batch."""
    dtype, expected = reference
    spec = {"method": "draft_model", "model": tiny_model_factory("mha"), "num_speculative_tokens": 3}
    llm = deterministic_llm(tiny_model, dtype, speculative_config=spec)
    assert run_targets(llm, 9, seed=9) == expected
    assert llm.engine.stats.spec_draft_tokens_total > 0


@pytest.mark.parametrize("variant", ["qwen3", "mistral_sliding", "phi3", "qwen2"])
def test_other_families(tiny_model_factory, variant):
    model = tiny_model_factory(variant)
    llm = deterministic_llm(model, "bfloat16", max_num_batched_tokens=32)
    expected = {kind: result(llm.generate([TARGET], params, use_tqdm=False)[0]) for kind, params in TARGETS.items()}
    assert run_targets(llm, 9, seed=5) == expected


@pytest.mark.parametrize("variant, kwargs", [("gemma2", {}), ("mixtral", {}), ("gqa", {"quantization": "int8"})])
def test_unsupported_models_are_refused(tiny_model_factory, variant, kwargs):
    with pytest.raises(ValueError, match="deterministic mode"):
        LLM(tiny_model_factory(variant), deterministic=True, **kwargs)


def test_default_model_beside_other_requests():
    """The embedded SmolLM2 (bf16), as the issue saw it: a request alone and beside three others."""
    llm = LLM(max_model_len=1024, max_num_seqs=16, kv_cache_memory_gb=0.25, deterministic=True)
    tok = llm.get_tokenizer()
    target = "Write a short story about a robot who learns to paint. The robot"
    rest = ["Explain quantum computing in simple terms.", "List five fruits and their colors:", "def fibonacci(n):"]
    for params in (SamplingParams(temperature=0, max_tokens=40, logprobs=2),
                   SamplingParams(temperature=0.8, seed=11, max_tokens=40, logprobs=2)):  # fmt: skip
        alone = result(llm.generate([target], params, use_tqdm=False)[0])
        beside = result(llm.generate([rest[0], target, *rest[1:]], params, use_tqdm=False)[1])
        assert beside == alone
        assert tok.decode(alone[0])


@pytest.mark.slow
def test_triton_attention_backend_end_to_end(tiny_model):
    """The GPU attention backend (Triton's interpreter on CPU tensors) in the engine: alone equals in a batch."""
    llm = deterministic_llm(tiny_model, "float32", attention_backend="triton", max_num_batched_tokens=16,
                            max_model_len=256)  # fmt: skip
    expected = {kind: result(llm.generate([TARGET], params, use_tqdm=False)[0]) for kind, params in TARGETS.items()}
    assert run_targets(llm, 5, seed=5) == expected


def test_http_openai_client_alone_and_concurrent(tiny_model):
    """`aserve serve --deterministic` with the official client: a greedy and a seeded request give the same text and
    logprobs alone and sent at once with other requests."""
    openai = pytest.importorskip("openai")
    from aserve_server import running_server

    target = "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys"
    rest = ["Prefix caching shares blocks", "Hello world! 0123456789", "Chunked prefill splits long prompts.",
            "Continuous batching adds", "The lazy dog"]  # fmt: skip
    args = ("--model", tiny_model, "--served-model-name", "tiny", "--dtype", "bfloat16", "--deterministic",
            "--max-model-len", "512", "--max-num-batched-tokens", "32")  # fmt: skip
    with running_server(*args) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(prompt, seed=None):
            resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, logprobs=2, seed=seed,
                                             temperature=0 if seed is None else 0.9,
                                             extra_body={"ignore_eos": True})  # fmt: skip
            choice = resp.choices[0]
            return choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs

        for seed in (None, 7):
            alone = complete(target, seed)
            with concurrent.futures.ThreadPoolExecutor(len(rest) + 1) as pool:
                futures = [pool.submit(complete, p, seed) for p in rest[:2]] + [pool.submit(complete, target, seed)]
                futures += [pool.submit(complete, p, seed) for p in rest[2:]]
                assert all(len(f.result()[1]) == 24 for f in futures)
            assert futures[2].result() == alone
