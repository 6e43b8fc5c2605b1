"""The CPU decode attention kernel (aserve/kernels/cpu.py, C compiled on first use) against the pure-torch
reference, and the CPU attention backend using it."""

import pytest
import torch
from attention_cases import poison_outside_window, random_batch

from aserve.kernels import cpu, reference
from aserve.layers.attention.backend import write_kv_cache

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no working C compiler")


@pytest.mark.parametrize(
    ("dtype", "generic"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["f32", "bf16-generic", "bf16-simd"],
)  # simd: the AVX512-BF16 path where the CPU has it
@pytest.mark.parametrize(("heads", "head_dim", "ctx_lens"), [
    ((4, 4), 16, [0, 5, 31, 47, 90]),  # MHA; a request with no context (only the new token)
    ((9, 3), 64, [3, 200, 16, 15]),  # SmolLM2's GQA; block-boundary lengths
    ((32, 8), 128, [600, 1]),
    ((12, 2), 32, [40, 7]),  # shapes without their own copy of the SIMD loops: G 6, D 32
    ((6, 3), 96, [33, 64]),  # G 2, D 96
])  # fmt: skip
def test_decode_kernel_matches_reference(dtype, generic, heads, head_dim, ctx_lens):
    num_heads, num_kv_heads = heads
    bs = 16
    num_blocks = sum(-(-(c + 1) // bs) for c in ctx_lens) + 3
    q, k, v, kv_cache, meta = random_batch([1] * len(ctx_lens), ctx_lens, num_heads, num_kv_heads, head_dim, bs,
                                           num_blocks, dtype)  # fmt: skip
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    ref = reference.paged_attention(q, kv_cache, meta, bs)
    out = torch.full_like(q, float("nan"))
    assert cpu.attention_supports(q, kv_cache[0])
    cpu.paged_decode_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, out,
                                         generic=generic)  # fmt: skip
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize(
    ("dtype", "generic"),
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["f32", "bf16-generic", "bf16-simd"],
)
@pytest.mark.parametrize(("heads", "head_dim", "block_size"), [((8, 2), 64, 16), ((4, 4), 32, 32), ((6, 3), 256, 16)])
@pytest.mark.parametrize("layer", [dict(sliding_window=1), dict(sliding_window=5), dict(sliding_window=20),
                                   dict(sliding_window=40, softcap=3.0, scale=0.2), dict(softcap=2.0)])  # fmt: skip
def test_decode_kernel_sliding_window_and_softcap(dtype, generic, heads, head_dim, block_size, layer):
    """Gemma-like layers (windows shorter than a block, longer than a block, than some contexts; a softcap): the
    kernel equals the reference, and blocks wholly before each window (NaN here) are never read."""
    ctx_lens = [0, 4, 19, 33, 70, 130]
    num_blocks = sum(-(-(c + 1) // block_size) for c in ctx_lens) + 3
    q, k, v, kv_cache, meta = random_batch([1] * len(ctx_lens), ctx_lens, *heads, head_dim, block_size, num_blocks,
                                           dtype)  # fmt: skip
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    ref = reference.paged_attention(q, kv_cache, meta, block_size, **layer)
    if layer.get("sliding_window"):
        kv_cache = poison_outside_window(kv_cache, meta, block_size, layer["sliding_window"])
    out = torch.full_like(q, float("nan"))
    cpu.paged_decode_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, out, generic=generic,
                               **layer)  # fmt: skip
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_cpu_backend_uses_kernel_for_decodes_and_matches_torch_backend(monkeypatch):
    """A mixed batch through CPUAttentionBackend: the decode rows go through the kernel, the rest through SDPA;
    same output as the torch backend (SDPA for all)."""
    from aserve.layers.attention.torch_backend import CPUAttentionBackend, TorchAttentionBackend

    q_lens, ctx_lens = [1, 1, 1, 9, 20], [17, 64, 3, 0, 40]
    q, k, v, kv_cache, meta = random_batch(q_lens, ctx_lens, 6, 2, 32, 16, 40)
    backend = CPUAttentionBackend()
    backend.prepare(meta, 16)
    calls = []
    kernel = cpu.paged_decode_attention
    monkeypatch.setattr(cpu, "paged_decode_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    out = backend.forward(q, k, v, kv_cache.clone(), meta)
    assert calls == [1]
    backend = TorchAttentionBackend()
    backend.prepare(meta, 16)
    expected = backend.forward(q, k, v, kv_cache.clone(), meta)
    assert calls == [1]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
