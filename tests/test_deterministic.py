"""Deterministic mode (`LLM(deterministic=True)`, `aserve serve --deterministic`): a request's token ids and logprobs
are the same bits alone and beside random other requests, with any token budget (chunked prompts), with and without
a prefix-cache hit, through forced preemption, with n-gram and layer-skip speculation and async scheduling, in float32
and bf16, greedy and seeded; through the HTTP server with the openai client; for Gemma 2 / 3 and mixture-of-experts
models too (their batch-invariant functions and routing row by row here). The kernels themselves:
tests/test_batch_invariant_kernels.py."""

import concurrent.futures
import random

import pytest
import torch
import torch.nn.functional as F

from aserve import LLM, SamplingParams
from aserve.kernels import cpu
from aserve.kernels.reference import select_experts
from aserve.layers import batch_invariant

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


@pytest.mark.parametrize("variant", ["qwen3", "mistral_sliding", "phi3", "qwen2", "gemma2", "gemma3", "mixtral",
                                     "qwen3_moe"])  # fmt: skip
def test_other_families(tiny_model_factory, variant):
    model = tiny_model_factory(variant)
    llm = deterministic_llm(model, "bfloat16", max_num_batched_tokens=32)
    expected = {kind: result(llm.generate([TARGET], params, use_tqdm=False)[0]) for kind, params in TARGETS.items()}
    assert run_targets(llm, 9, seed=5) == expected


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["budget-16", "budget-64", "budget-64-no-prefix-cache", "preemption"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["gemma2", "gemma3", "mixtral", "qwen3_moe"])
def test_family_engines(tiny_model_factory, variant, dtype, engine):
    """Gemma 2 / 3 (soft-capping, sliding windows, GeGLU, (1 + w) norms) and mixture-of-experts models (experts on
    varying token subsets): alone, in its own engine, equals alone and beside 1-31 others in each engine."""
    model = tiny_model_factory(variant)
    llm = deterministic_llm(model, dtype, enable_prefix_caching=False)
    expected = {kind: result(llm.generate([TARGET], params, use_tqdm=False)[0]) for kind, params in TARGETS.items()}
    llm = check_engine(model, (dtype, expected), engine, batch_sizes=(1, 9, 31))
    if engine == "preemption":
        assert llm.engine.stats.num_preemptions_total > 0
    elif "prefix-cache" not in engine:
        assert llm.engine.stats.prefix_cache_hits_total > 0


def test_gemma_functions_are_per_row():
    """Gemma's batch-invariant GeGLU, soft-cap and norm give a row the same bits alone and among other rows, at
    widths where torch splits a tensor between threads mid-row (where its GELU-tanh takes a scalar path for some
    elements and a vectorised one for others, which round differently); tanh_rows is within a few ulps of tanh."""
    gen = torch.Generator().manual_seed(0)
    x = torch.linspace(-12, 12, 100001)
    assert (batch_invariant.tanh_rows(x) - torch.tanh(x.double()).float()).abs().max() < 5e-7
    w = torch.randn(2 * 2303, generator=gen) * 0.2
    functions = (batch_invariant.gelu_tanh_and_mul, lambda t: batch_invariant.soft_cap(t, 10.0),
                 lambda t: batch_invariant.gemma_rms_norm(t, w, 1e-6))  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(67, 2 * 2303, generator=gen) * 3).to(dtype)
        for f in functions:
            full = f(x)
            for rows in (1, 2, 5, 30):
                assert torch.equal(f(x[-rows:]), full[-rows:])
            assert torch.equal(torch.cat([f(x[i : i + 1]) for i in range(0, 67, 11)]), full[0:67:11])
    gate_up = torch.randn(5, 256, generator=gen)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(batch_invariant.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up)


def test_expert_routing_is_per_row():
    """The routing of deterministic mode's expert blocks (softmax, top-k, renormalisation) gives a row the same
    bits alone and among any number of other rows."""
    gen = torch.Generator().manual_seed(0)
    for experts, top_k, renormalize in ((4, 2, True), (8, 2, False), (128, 8, True)):
        logits = torch.randn(513, experts, generator=gen) * 3
        weights, ids = select_experts(logits, top_k, renormalize)
        for rows in (1, 2, 7, 64, 300):
            w, i = select_experts(logits[-rows:], top_k, renormalize)
            assert torch.equal(w[-1], weights[-1]) and torch.equal(i[-1], ids[-1])


def test_unsupported_models_are_refused(tiny_model_factory):
    with pytest.raises(ValueError, match="deterministic mode"):
        LLM(tiny_model_factory("gqa"), deterministic=True, quantization="int8")
    with pytest.raises(ValueError, match="deterministic mode supports .*GPT2LMHeadModel is not among them"):
        batch_invariant.check_supported("GPT2LMHeadModel", None)


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
