"""Greedy outputs equal transformers' generate token for token, whatever the engine configuration."""

import random

import pytest
import torch
from tiny_models import hf_greedy

from aserve import LLM, SamplingParams

MAX_NEW = 24
PROMPT_LENS = (3, 17, 33, 50, 64)

ENGINE_CONFIGS = {
    "prefix-caching": dict(),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "chunked-7": dict(max_num_batched_tokens=7),
    "chunked-16": dict(max_num_batched_tokens=16),
    # 10 blocks of 16 tokens for 5 requests that grow to 27..88 tokens: some must be preempted and resumed.
    "preemption": dict(num_gpu_blocks_override=10, max_model_len=128),
    # Async scheduling (step N+1 scheduled and launched before step N's tokens are processed; on by default on
    # CUDA), driven on the CPU: in-flight input tokens, EOS one step late, preemption with a token in flight.
    "async": dict(async_scheduling=True),
    "async-chunked-7": dict(async_scheduling=True, max_num_batched_tokens=7),
    "async-preemption": dict(async_scheduling=True, num_gpu_blocks_override=10, max_model_len=128),
}


def prompts_for(seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 384) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    cache = {}

    def get(variant):
        if variant not in cache:
            path = tiny_model_factory(variant)
            cache[variant] = (path, hf_greedy(path, prompts_for(), MAX_NEW))
        return cache[variant]

    return get


SLIDING_BLOCKS = {"mistral_sliding": 4, "gemma2": 12, "gemma3": 22}


def engine_kwargs(variant: str, config: str) -> dict:
    kwargs = ENGINE_CONFIGS[config]
    if config.endswith("preemption") and variant in SLIDING_BLOCKS:
        # their requests give back the blocks behind the window (Gemma: of its sliding layers, whose blocks hold
        # one or two layers each): preempted in fewer blocks, with a 16-token budget
        kwargs = {**kwargs, "num_gpu_blocks_override": SLIDING_BLOCKS[variant], "max_num_batched_tokens": 16}
    return kwargs


@pytest.mark.parametrize(
    "variant",
    ["mha", "gqa", "tied", "llama3_rope", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "mistral_sliding", "gemma2",
     "gemma3", "smollm3"],
)  # fmt: skip
@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_greedy_parity_with_transformers(references, variant, config):
    path, expected = references(variant)
    llm = LLM(path, dtype="float32", enforce_eager=True, debug_invariants=True, **engine_kwargs(variant, config))
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts_for()], SamplingParams(temperature=0, max_tokens=MAX_NEW)
    )
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    for o, exp in zip(outs, expected):
        assert o.outputs[0].finish_reason == ("stop" if exp[-1] == 1 else "length")
    engine = llm.engine
    if config.endswith("preemption"):
        assert engine.core.scheduler.num_preemptions > 0
    if config.startswith("async"):
        assert engine.core.async_scheduling and engine.core.inflight is None
    if "chunked" in config:
        assert engine.stats.scheduled_tokens_total >= sum(PROMPT_LENS)
    # Nothing is left holding a block: all free or cached-evictable.
    assert engine.core.kv_manager.pool.num_free_blocks == engine.core.num_kv_blocks
    assert not engine.core.kv_manager.req_to_blocks


def test_batch_of_one_equals_batch_of_many(tiny_model):
    """Batch composition does not change greedy results (flat batches, no padding)."""
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_for(1)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compiled path is the CPU's")
def test_compiled_cpu_path_matches_transformers(references, monkeypatch):
    """Where the C element-wise kernels cannot be built, CPU runs torch.compile'd element-wise ops for steps of 32+
    tokens (here: the prefill step; decode steps of 5 tokens stay eager): same greedy tokens."""
    from aserve.kernels import cpu

    monkeypatch.setattr(cpu, "elementwise_supports", lambda dtype: False)
    path, expected = references("gqa")
    llm = LLM(path, dtype="float32")
    assert llm.engine.core.runner.compiled
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts_for()], SamplingParams(temperature=0, max_tokens=MAX_NEW)
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's kernels")
def test_native_cpu_elementwise_path_matches_transformers(references):
    """The CPU's C element-wise kernels (aserve/kernels/cpu.py), the default where a compiler works, for
    every step (prefill and decode): same greedy tokens."""
    from aserve.kernels import cpu

    if not cpu.available():
        pytest.skip("no working C compiler")
    path, expected = references("gqa")
    llm = LLM(path, dtype="float32", enforce_eager=True)
    assert llm.engine.core.runner.model.ops.kind == "native"
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts_for()], SamplingParams(temperature=0, max_tokens=MAX_NEW)
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


SLOW = pytest.mark.slow


@pytest.mark.parametrize(("variant", "config"), [
    ("gqa", "chunked-7"), ("gqa", "preemption"),
    pytest.param("gemma2", "chunked-16", marks=SLOW), pytest.param("gemma3", "preemption", marks=SLOW),
])  # fmt: skip
def test_triton_backend_parity(references, variant, config):
    """The Triton attention backend inside the engine (Triton's interpreter on CPU): same greedy tokens (Gemma:
    sliding windows, soft-capped scores)."""
    path, expected = references(variant)
    kwargs = engine_kwargs(variant, config)
    llm = LLM(path, dtype="float32", enforce_eager=True, attention_backend="triton", debug_invariants=True, **kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts_for()], SamplingParams(temperature=0, max_tokens=MAX_NEW)
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize(
    "variant", ["gqa", "qwen3", "phi3", pytest.param("gemma2", marks=SLOW), pytest.param("gemma3", marks=SLOW)]
)
def test_gpu_decode_kernels_parity(references, monkeypatch, variant):
    """The GPU's batch-1 decode path, forced onto the CPU (Triton's interpreter): element-wise Triton kernels,
    rotary fused with the cache write, one-row linears as Triton GEMVs (the down projection with SiLU·mul fused
    into its prologue). One request at a time, so every decode step takes that path: same greedy tokens."""
    import aserve.kernels.gemv as gemv_mod
    from aserve.layers.elementwise import TritonElementwiseOps
    from aserve.layers.linear import Linear
    from aserve.models import loader

    path, expected = references(variant)
    monkeypatch.setattr(loader, "select_elementwise_ops", lambda device, dtype, compile_model: TritonElementwiseOps())
    llm = LLM(path, dtype="float32", enforce_eager=True, attention_backend="triton", max_num_seqs=1)
    model = llm.engine.core.runner.model
    assert model.ops.kind == "triton" and all(layer.self_attn.rotates_into_cache for layer in model.layers)
    if variant == "qwen3":  # q/k norm inside the rotary kernel
        assert all(layer.self_attn.norm_in_rotary for layer in model.layers)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for m in linears:  # the GPU's choice for 16-bit weights, with small tiles (the CPU's oneDNN copy: dropped)
        m.quant_method.use_triton_gemv(m, dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2),
                                       dict(BLOCK_N=8, BLOCK_K=64, num_warps=4, num_stages=3))  # fmt: skip
    assert all(m.gemv_config is not None for m in linears)
    kernel = gemv_mod._gemv_kernel
    calls = []

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    gemv_mod._gemv_kernel = Counting()
    try:
        prompts = prompts_for()[:3]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8))
    finally:
        gemv_mod._gemv_kernel = kernel
    assert [o.outputs[0].token_ids for o in outs] == [e[:8] for e in expected[:3]]
    # every one-token step: 4 linears per layer and lm_head; the prompts' steps: lm_head only
    assert len(calls) == 7 * len(prompts) * (4 * len(model.layers) + 1) + len(prompts)


def test_deleted_llm_is_freed(tiny_model):
    """`del llm; gc.collect()` frees the engine with its weights and KV cache (on a GPU: its memory), so one process
    can load several models in turn."""
    import gc
    import weakref

    llm = LLM(tiny_model, dtype="float32", enforce_eager=True)
    llm.generate("hello", SamplingParams(max_tokens=4))
    engine, kv = weakref.ref(llm.engine), weakref.ref(llm.engine.core.runner.kv_caches)
    del llm
    gc.collect()
    assert engine() is None and kv() is None
