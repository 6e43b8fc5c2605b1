"""The torch attention backends (the reference, and the CPU one with its C decode kernel) against the
explicit-softmax reference on ragged paged batches."""

import pytest
import torch
from attention_cases import poison_outside_window, random_batch

from aserve.kernels import cpu
from aserve.kernels.reference import paged_attention as reference_paged_attention
from aserve.layers.attention.backend import AttentionParams, write_kv_cache
from aserve.layers.attention.torch_backend import CPUAttentionBackend, TorchAttentionBackend

BACKENDS = {"torch": TorchAttentionBackend, "cpu": CPUAttentionBackend}

CASES = {
    "decode-only": ([1, 1, 1, 1], [0, 5, 31, 47]),
    "prefill-only-no-context": ([7, 16, 33], [0, 0, 0]),
    "mixed-with-context": ([1, 1, 9, 20, 4], [17, 64, 0, 13, 40]),
    "single-long-chunk": ([50], [30]),
    # Short queries (decodes, speculative verification) batched, then a longer chunk.
    "short-queries-batched": ([1, 1, 3, 5, 5, 12], [17, 64, 30, 3, 77, 5]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_torch_backend_matches_reference(case, heads, dtype, backend_name):
    if backend_name == "cpu" and not cpu.available():
        pytest.skip("no working C compiler")
    q_lens, ctx_lens = CASES[case]
    num_heads, num_kv_heads = heads
    block_size = 16
    q, k, v, kv_cache, meta = random_batch(q_lens, ctx_lens, num_heads, num_kv_heads, 32, block_size, 40, dtype)
    backend = BACKENDS[backend_name]()
    backend.prepare(meta, block_size)
    cache = kv_cache.clone()
    out = backend.forward(q, k, v, cache, meta)

    ref_cache = kv_cache.clone()
    write_kv_cache(k, v, ref_cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    ref = reference_paged_attention(q, ref_cache, meta, block_size)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


LAYERS = {
    "w5": AttentionParams(sliding_window=5),
    "w20": AttentionParams(sliding_window=20),
    "w20-softcap": AttentionParams(scale=0.3, sliding_window=20, softcap=2.0),
    "softcap": AttentionParams(softcap=1.5),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_torch_backend_sliding_window_and_softcap(case, layer, dtype, backend_name):
    """Gemma-like layers: the same as the reference, without reading blocks wholly before a window (NaN there);
    the layers' states are built once per step and window."""
    layer = LAYERS[layer]
    if backend_name == "cpu" and not cpu.available():
        pytest.skip("no working C compiler")
    q_lens, ctx_lens = CASES[case]
    q, k, v, kv_cache, meta = random_batch(q_lens, ctx_lens, 8, 2, 32, 16, 40, dtype)
    ref_cache = kv_cache.clone()
    write_kv_cache(k, v, ref_cache, meta.slot_mapping)
    ref = reference_paged_attention(q, ref_cache, meta, 16, layer.scale, layer.sliding_window, layer.softcap)
    window = layer.sliding_window
    cache = kv_cache if window is None else poison_outside_window(ref_cache, meta, 16, window)
    backend = BACKENDS[backend_name]()
    backend.prepare(meta, 16)
    out = backend.forward(q, k, v, cache, meta, layer)
    assert backend._state(meta, window) is backend._state(meta, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_cuda_graphs_only_for_backends_that_need_no_host_work_per_step(tiny_model):
    """A CUDA graph replays the state its capture's prepare() built: the torch backends build theirs on the host
    from each step's requests, so the runner captures no graphs with them (the Triton backend's fits any replay)."""
    from aserve import LLM
    from aserve.layers.attention.triton_backend import TritonAttentionBackend

    runner = LLM(tiny_model, dtype="float32", enforce_eager=True, attention_backend="torch").engine.core.runner
    assert not runner.backend.supports_cuda_graphs and TritonAttentionBackend.supports_cuda_graphs
    runner.capture_cuda_graphs()
    assert runner.graphs is None


def test_every_backend_takes_the_calls_the_model_makes():
    """Each backend's methods take the arguments of the interface (the model calls them positionally, the layer's
    AttentionParams last): a backend whose signature fell behind fails here, not first on a GPU."""
    import inspect

    from aserve.layers.attention import batch_invariant, torch_backend, triton_backend, triton_batch_invariant
    from aserve.layers.attention.backend import AttentionBackend

    modules = (batch_invariant, torch_backend, triton_backend, triton_batch_invariant)
    classes = {c for m in modules for _, c in inspect.getmembers(m, inspect.isclass) if issubclass(c, AttentionBackend)}
    assert len(classes) >= 4
    names = ("rotate_and_write", "attend")
    for cls in classes:
        for name in ("forward", *(names if cls.writes_rotated_kv else ())):
            params = list(inspect.signature(getattr(cls, name)).parameters)
            if name == "rotate_and_write" and cls.fuses_qk_norm:  # then the q/k norm's weights, by keyword
                assert params[-1] == "qk_norm", (cls.__name__, params)
                params = params[:-1]
            assert params[-1] == "params", (cls.__name__, name, params)
            if name == "rotate_and_write":
                assert len(params) == 9, cls.__name__
