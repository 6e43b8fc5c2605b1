"""Triton kernels against their pure-torch references, on random ragged paged batches (Triton's interpreter on CPU;
the same tests run on a GPU at the same shapes)."""

import pytest
import torch
from attention_cases import poison_outside_window, random_batch

from aserve.kernels import reference
from aserve.kernels.cache_write import write_kv
from aserve.kernels.fused import qkv_kv_views
from aserve.kernels.paged_attention import paged_attention
from aserve.kernels.split_kv import attention_counters
from aserve.layers.attention.backend import write_kv_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    "decode-only": ([1, 1, 1, 1, 1], [0, 5, 31, 47, 90]),
    "prefill-no-context": ([7, 16, 33], [0, 0, 0]),
    "mixed-with-context": ([1, 1, 9, 20, 4], [17, 64, 0, 13, 40]),
    "spec-verify-k+1": ([5, 5, 5], [30, 3, 77]),
    "long-context-chunks": ([1, 40, 70], [150, 200, 130]),
}


def run_case(case, heads, head_dim, dtype, num_segments=1, block_size=16, config=None, **layer):
    """`layer`: scale / sliding_window / softcap, given to the kernel and the reference alike."""
    q_lens, ctx_lens = CASES[case]
    num_heads, num_kv_heads = heads
    q, k, v, kv_cache, meta = random_batch(
        q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, 64, dtype, device=DEVICE
    )
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    ref = reference.paged_attention(q, kv_cache, meta, block_size, **layer)
    out = paged_attention(
        q,
        kv_cache[0],
        kv_cache[1],
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        max(q_lens),
        num_segments=num_segments,
        config=config,
        **layer,
    )
    return out.float(), ref.float()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3)])
def test_paged_attention_matches_reference(case, heads):
    out, ref = run_case(case, heads, 32, torch.float32)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# Gemma-like layers: windows shorter than a tile, than a block, than most contexts; scale and soft-capping.
LAYERS = {
    "window-5": dict(sliding_window=5),
    "window-16": dict(sliding_window=16),
    "window-40-softcap": dict(sliding_window=40, softcap=2.0, scale=0.3),
    "softcap": dict(softcap=1.5),
}
SMALL_TILES = dict(BLOCK_M=16, TILE_N=16, num_warps=4, num_stages=2)


@pytest.mark.parametrize("case", [c for c in CASES if c != "decode-only"])
@pytest.mark.parametrize(("heads", "config", "layer"), [
    ((4, 4), None, None), ((4, 4), SMALL_TILES, None), ((9, 3), None, None), ((9, 3), SMALL_TILES, None),
    ((9, 3), SMALL_TILES, "window-5"), ((9, 3), None, "window-40-softcap"), ((4, 4), SMALL_TILES, "window-40-softcap"),
])  # fmt: skip
def test_paged_attention_new_kv_from_qkv_rows(case, heads, config, layer):
    """The step's own K/V read from slices of the fused qkv rows (k_new / v_new), the context's from the pages;
    the small tiles give unmasked tiles of new keys, context tiles and a partial one (and, with a window, tiles
    masked at the window's edge and tiles skipped)."""
    layer = LAYERS.get(layer, {})
    q_lens, ctx_lens = CASES[case]
    num_heads, num_kv_heads = heads
    q, k, v, kv_cache, meta = random_batch(q_lens, ctx_lens, num_heads, num_kv_heads, 32, 16, 64, torch.float32,
                                           device=DEVICE)  # fmt: skip
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    ref = reference.paged_attention(q, kv_cache, meta, 16, **layer)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    k_new, v_new = qkv_kv_views(qkv, num_heads, num_kv_heads, 32)
    out = paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                          max(q_lens), config=config, k_new=k_new, v_new=v_new, **layer)  # fmt: skip
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["decode-only", "mixed-with-context", "long-context-chunks"])
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("config", [None, SMALL_TILES])
def test_paged_attention_sliding_window_and_softcap(case, layer, config):
    out, ref = run_case(case, (8, 2), 32, torch.float32, config=config, **LAYERS[layer])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["decode-only", "mixed-with-context", "long-context-chunks"])
@pytest.mark.parametrize("new_kv", [False, True])
def test_paged_attention_reads_no_block_outside_the_window(case, new_kv):
    """Blocks wholly before a request's window hold NaN: the KV loops start at the window's first block, so the
    output is the reference's (the default tiles span 4 blocks of 16: the loop starts mid-tile)."""
    q_lens, ctx_lens = CASES[case]
    q, k, v, kv_cache, meta = random_batch(q_lens, ctx_lens, 8, 2, 32, 16, 64, torch.float32, device=DEVICE)
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    ref = reference.paged_attention(q, kv_cache, meta, 16, sliding_window=20)
    kv_cache = poison_outside_window(kv_cache, meta, 16, 20)
    k_new, v_new = (k, v) if new_kv and max(q_lens) > 1 else (None, None)
    out = paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc,
                          max(q_lens), sliding_window=20, k_new=k_new, v_new=v_new)  # fmt: skip
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layer", ["window-5", "window-40-softcap"])
def test_paged_attention_sliding_window_split_kv(layer):
    out, ref = run_case("long-context-chunks", (8, 2), 32, torch.float32, num_segments=4, **LAYERS[layer])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 128, 256])  # 256: Gemma's (its prefill tiles must fit shared memory)
def test_paged_attention_head_dims_fp16(head_dim):
    out, ref = run_case("mixed-with-context", (8, 2), head_dim, torch.float16)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("case", ["decode-only", "spec-verify-k+1", "mixed-with-context"])
def test_split_kv_segments_match(case):
    out, ref = run_case(case, (8, 2), 32, torch.float32, num_segments=4)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_split_kv_counters_are_left_at_zero_for_the_next_launch():
    """The last segment of each tile combines and resets the tile's counter: launches that share counters (every
    layer of a CUDA-graph replay) give the same output every time, with more segments than some rows see keys for."""
    q, k, v, kv_cache, meta = random_batch([1, 1, 1], [3, 60, 140], 8, 2, 32, 16, 64, torch.float32, device=DEVICE)
    write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    ref = reference.paged_attention(q, kv_cache, meta, 16)
    counters = attention_counters(16, 2, DEVICE)
    for _ in range(3):
        out = paged_attention(q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, 1,
                              num_segments=8, counters=counters)  # fmt: skip
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert not counters.any()


def test_cache_write_matches_reference_and_skips_padding():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(6, 2, 32, generator=gen).to(DEVICE)
    v = torch.randn(6, 2, 32, generator=gen).to(DEVICE)
    cache = torch.randn(2, 8, 16, 2, 32, generator=gen).to(DEVICE)
    slots = torch.tensor([5, 17, 40, 127, -1, 3], device=DEVICE)
    expected = cache.clone()
    write_kv_cache(k[[0, 1, 2, 3, 5]], v[[0, 1, 2, 3, 5]], expected, slots[[0, 1, 2, 3, 5]])
    write_kv(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_elementwise_kernels_match_torch(dtype):
    from aserve.kernels import fused
    from aserve.layers import elementwise

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen).to(DEVICE, dtype)
    r = torch.randn(5, 96, generator=gen).to(DEVICE, dtype)
    w = torch.randn(96, generator=gen).to(DEVICE, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    for residual in (None, r):
        out, res = fused.add_rms_norm(x, residual, w, 1e-5)
        ref_out, ref_res = elementwise.add_rms_norm(x, residual, w, 1e-5)
        torch.testing.assert_close(out, ref_out, **tol)
        torch.testing.assert_close(res, ref_res, **tol)

    H, Hkv, D = 6, 2, 16
    qkv = torch.randn(7, (H + 2 * Hkv) * D, generator=gen).to(DEVICE, dtype)
    from aserve.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(D, 64, 10000.0, {"rope_type": "default"})
    rot.materialize(torch.device(DEVICE))
    cos, sin = rot(torch.tensor([0, 3, 5, 9, 17, 33, 63], device=DEVICE), dtype)
    want_q, want_k, want_v = elementwise.split_rotate_qkv(qkv, cos, sin, H, Hkv, D)
    for got, want in zip(fused.rotary_split(qkv, cos, sin, H, Hkv, D), (want_q, want_k, want_v)):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, **tol)
    # Into a paged cache, keeping the rotated k in qkv's k columns (paged_attention's k_new).
    caches = torch.zeros(2, 4, 4, Hkv, D, device=DEVICE, dtype=dtype)
    slots = torch.tensor([0, 1, 2, 5, 6, -1, 9], device=DEVICE)
    qkv_kept = qkv.clone()
    q, k_kept, v_kept = fused.rotary_split(qkv_kept, cos, sin, H, Hkv, D, cache=(caches[0], caches[1], slots),
                                           keep_k=True)  # fmt: skip
    torch.testing.assert_close(q, want_q, **tol)
    assert k_kept.data_ptr() == qkv_kept[:, H * D :].data_ptr()  # views of qkv's columns
    torch.testing.assert_close(qkv_kept[:, H * D : (H + Hkv) * D].view(-1, Hkv, D), want_k, **tol)
    torch.testing.assert_close(k_kept, want_k, **tol)
    torch.testing.assert_close(v_kept, qkv[:, (H + Hkv) * D :].view(-1, Hkv, D))
    torch.testing.assert_close(qkv_kept[:, (H + Hkv) * D :], qkv[:, (H + Hkv) * D :])
    torch.testing.assert_close(caches[0].view(-1, Hkv, D)[slots[slots >= 0]], want_k[slots >= 0], **tol)

    gu = torch.randn(4, 2 * 80, generator=gen).to(DEVICE, dtype)
    torch.testing.assert_close(fused.silu_and_mul(gu), elementwise.silu_and_mul(gu), **tol)
    qk = torch.randn(3, (4 + 2 * 2) * 16, generator=gen).to(DEVICE, dtype) * 3
    qw, kw = (torch.rand(16, generator=gen).to(DEVICE, dtype) + 0.5 for _ in range(2))
    want = elementwise.qk_norm(qk, qw, kw, 1e-6, 4, 2, 16)
    got = fused.qk_norm_(qk.clone(), qw, kw, 1e-6, 4, 2, 16)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[:, 6 * 16 :], qk[:, 6 * 16 :])  # v untouched
    # Qwen3's q/k norm inside the rotary kernel = qk_norm_, then rotary (also into a cache, keeping k)
    qkv_n = qkv * 3
    hw = [torch.rand(D, generator=gen).to(DEVICE, dtype) + 0.5 for _ in range(2)]
    normed = fused.qk_norm_(qkv_n.clone(), *hw, 1e-6, H, Hkv, D)
    for got, want in zip(fused.rotary_split(qkv_n, cos, sin, H, Hkv, D, qk_norm=(*hw, 1e-6)),
                         fused.rotary_split(normed, cos, sin, H, Hkv, D)):  # fmt: skip
        torch.testing.assert_close(got, want, **tol)
    want_q, want_k, _ = fused.rotary_split(normed, cos, sin, H, Hkv, D)
    caches.zero_()
    qkv_kept = qkv_n.clone()
    q, k_kept, v_kept = fused.rotary_split(qkv_kept, cos, sin, H, Hkv, D, cache=(caches[0], caches[1], slots),
                                           keep_k=True, qk_norm=(*hw, 1e-6))  # fmt: skip
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k_kept, want_k, **tol)
    torch.testing.assert_close(v_kept, qkv_n[:, (H + Hkv) * D :].view(-1, Hkv, D))
    torch.testing.assert_close(caches[0].view(-1, Hkv, D)[slots[slots >= 0]], want_k[slots >= 0], **tol)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("n", "k", "config"), [
    (37, 256, dict(BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=2)),  # N not a multiple of BLOCK_N
    (64, 192, dict(BLOCK_N=4, BLOCK_K=128, num_warps=4, num_stages=2)),  # K not a multiple of BLOCK_K: 64-wide tiles
    (8, 64, None),  # one K tile (the default configuration shrinks BLOCK_K to 64)
])  # fmt: skip
def test_gemv_matches_linear(n, k, config, bias):
    from aserve.kernels.gemv import gemv

    torch.manual_seed(n + k)
    x = torch.randn(1, k, device=DEVICE)
    w = torch.randn(n, k, device=DEVICE)
    b = torch.randn(n, device=DEVICE) if bias else None
    torch.testing.assert_close(gemv(x, w, b, config=config), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_rows_sums_every_row_as_the_one_row_gemv(dtype, bias):
    """gemv_rows: each row's bits are the one-row GEMV's with the same launch configuration, whatever the number of
    rows, the rows sharing a program and the row's place among them (layer-skip verification and deterministic
    mode rely on it); and it computes x W^T + b."""
    from aserve.kernels.gemv import gemv, gemv_rows

    torch.manual_seed(5)
    n, k = 37, 256
    x = torch.randn(19, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) * 0.1).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    cfg = dict(BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=2)
    alone = torch.cat([gemv(x[i : i + 1], w, b, config=cfg) for i in range(len(x))])
    for m, rows in ((1, 8), (5, 8), (19, 8), (19, 3), (8, 1)):
        assert torch.equal(gemv_rows(x[:m], w, b, config=cfg, rows_per_program=rows), alone[:m]), (m, rows)
    assert torch.equal(gemv_rows(x[7:12], w, b, config=cfg), alone[7:12])
    assert gemv_rows(x[:0], w, b, config=cfg).shape == (0, n)
    torch.testing.assert_close(alone.float(), torch.nn.functional.linear(x, w, b).float(), atol=2e-2, rtol=2e-2)


def test_gemv_refuses_k_without_64_multiple():
    from aserve.kernels.gemv import gemv_config

    assert gemv_config(64, 4096) is not None and gemv_config(64, 100) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.bfloat16])
def test_gemv_fused_silu_mul_matches_unfused(dtype):
    """The down projection with silu(gate) * up in its prologue = silu_and_mul then the GEMV (same rounding)."""
    from aserve.kernels.fused import silu_and_mul
    from aserve.kernels.gemv import gemv

    torch.manual_seed(3)
    n, k = 40, 256
    gate_up = torch.randn(1, 2 * k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) * 0.1).to(dtype)
    cfg = dict(BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2)
    fused = gemv(gate_up, w, config=cfg, silu_mul=True)
    ref = gemv(silu_and_mul(gate_up), w, config=cfg)
    torch.testing.assert_close(fused.float(), ref.float(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(ref.float(), torch.nn.functional.linear(silu_and_mul(gate_up), w).float(),
                               atol=2e-2, rtol=2e-2)  # fmt: skip


def test_rotary_with_cache_write_matches_separate_kernels():
    """rotary_split writing k / v straight into their cache slots = rotary_split, then write_kv (padding slots
    write nothing)."""
    from aserve.kernels import fused
    from aserve.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(5)
    H, Hkv, D, T, bs = 6, 2, 16, 5, 4
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(DEVICE)
    rot = RotaryEmbedding(D, 64, 10000.0, {"rope_type": "default"})
    rot.materialize(torch.device(DEVICE))
    cos, sin = rot(torch.tensor([0, 3, 5, 9, 17], device=DEVICE), torch.float32)
    slots = torch.tensor([7, 0, 12, -1, 3], device=DEVICE)
    fused_cache = torch.randn(2, 4, bs, Hkv, D, generator=gen).to(DEVICE)
    split_cache = fused_cache.clone()
    q_fused = fused.rotary_split(qkv, cos, sin, H, Hkv, D, cache=(fused_cache[0], fused_cache[1], slots))
    q, k, v = fused.rotary_split(qkv, cos, sin, H, Hkv, D)
    write_kv(k, v, split_cache[0], split_cache[1], slots)
    assert torch.equal(q_fused, q)
    assert torch.equal(fused_cache, split_cache)
