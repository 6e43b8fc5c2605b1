"""Deterministic mode's kernels: every row the same bits whatever the rows around it, and close to a torch reference.
CPU: the product gemm_rows (aserve/kernels/cpu.py) and the per-token attention backend. Triton (interpreted on CPU
without a GPU; float32 and float16 there, the interpreter's bf16 dot being wrong on CPU): the matmul and the paged
attention, including prompt chunks against decodes, split-KV segments, sliding windows and soft-capping."""

import pytest
import torch
from attention_cases import random_batch

from aserve.kernels import cpu
from aserve.kernels.reference import paged_attention
from aserve.layers.attention.backend import AttentionMetadata, AttentionParams, write_kv_cache
from aserve.layers.attention.batch_invariant import BatchInvariantCPUAttentionBackend

needs_cpu_kernels = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the CPU kernels")


# -- CPU ----------------------------------------------------------------------------------------------------------


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(960, 576), (37, 64), (50, 40), (16, 17), (100, 3)])
def test_gemm_rows_is_row_invariant_and_close_to_torch(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(70, k, generator=gen).to(dtype)
    prepared = cpu.gemm_rows_prepare(w)
    y = cpu.gemm_rows(prepared, x, n)
    expected = x.float() @ w.float().T
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    for m in (1, 2, 5, 6, 7, 13, 64):
        for start in (0, 3, 70 - m):
            assert torch.equal(cpu.gemm_rows(prepared, x[start : start + m], n), y[start : start + m]), (m, start)
    with torch.inference_mode():  # one thread: the same bits
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(cpu.gemm_rows(prepared, x, n), y)
        finally:
            torch.set_num_threads(threads)


def cached_kv(kv_cache, meta):
    """The k / v rows the cache holds at each token's slot (what a forward writes back first)."""
    hkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
    return kv_cache[0].view(-1, hkv, d)[meta.slot_mapping], kv_cache[1].view(-1, hkv, d)[meta.slot_mapping]


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 20])
def test_cpu_attention_backend_per_token(dtype, window):
    """A prompt's rows are the same in one step beside decodes and another prompt, chunked beside other requests, and
    close to the reference."""
    backend = BatchInvariantCPUAttentionBackend()
    params = AttentionParams(sliding_window=window)

    def batch(q_lens, ctx_lens, seed):
        q, k, v, kv_cache, meta = random_batch(q_lens, ctx_lens, 8, 2, 64, 16, 64, dtype=dtype, seed=seed)
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return q, kv_cache, meta

    q, kv_cache, meta = batch([1, 1, 70, 9], [40, 3, 0, 130], seed=0)
    backend.prepare(meta, 16)
    out = backend.forward(q, *cached_kv(kv_cache, meta), kv_cache, meta, params)
    expected = paged_attention(q, kv_cache, meta, 16, sliding_window=window)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=1e-2)
    # The 70-token prompt (rows 2..71) again, in chunks beside a decode of another request.
    for chunks in ([1, 30, 39], [70], [69, 1]):
        start = 0
        for n in chunks:
            q2, cache2, meta2 = batch([1, n], [5, start], seed=1)
            cache2.copy_(kv_cache)  # the prompt's keys and values where its block table says
            blocks = meta.block_tables[2, : -(-(start + n) // 16)]
            meta2.block_tables[1, : len(blocks)] = blocks
            q2[1:] = q[2 + start : 2 + start + n]
            backend.prepare(meta2, 16)
            got = backend.forward(q2, *cached_kv(cache2, meta2), cache2, meta2, params)
            assert torch.equal(got[1:], out[2 + start : 2 + start + n]), (chunks, n)
            start += n


# -- Triton (interpreted without a GPU) ----------------------------------------------------------------------------

triton = pytest.importorskip("triton")
from aserve.kernels import batch_invariant_attention as bi_attention  # noqa: E402
from aserve.kernels import batch_invariant_matmul as bi_matmul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("n, k, bias", [(100, 72, True), (64, 128, False), (17, 40, False)])
def test_triton_matmul_is_row_invariant_and_close_to_torch(dtype, n, k, bias):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(70, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    y = bi_matmul.matmul(x, w, b)
    expected = x.float() @ w.float().T + (b.float() if bias else 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    for m in (1, 3, 17, 33, 64, 65):
        for start in (0, 70 - m):
            assert torch.equal(bi_matmul.matmul(x[start : start + m], w, b), y[start : start + m]), (m, start)


@pytest.mark.parametrize("dtype", [d for d in TRITON_DTYPES if d != torch.float32])
def test_flat_two_k_ranges_are_row_invariant(monkeypatch, dtype):
    """A 16-bit weight with fewer few-row tiles than SMs and K >= FLAT_SPLIT_MIN_K (lowered here): the flat_split
    candidate's two K ranges, one program each up to 64 rows and one after the other in a program beyond, give
    a row the same bits at every M and at every tile."""
    monkeypatch.setattr(bi_matmul, "FLAT_SPLIT_MIN_K", 128)
    n, k = 40, 200
    cfg = bi_matmul.CANDIDATES["flat_split"](n, k, dtype)
    assert (cfg["SPLIT_K"], cfg["K_SPLIT"]) == (2, 128)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(70, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    y = bi_matmul.matmul(x, w, b, cfg)
    expected = x.float() @ w.float().T + b.float()
    torch.testing.assert_close(y.float(), expected, atol=2e-2 * expected.abs().max().item(), rtol=2e-2)
    for m in (1, 16, 17, 33, 64, 65):
        for start in (0, 70 - m):
            assert torch.equal(bi_matmul.matmul(x[start : start + m], w, b, cfg), y[start : start + m]), (m, start)
    assert bi_matmul.differing_row_counts(w, cfg) == []


# Small tiles and four K ranges of 64 so that the interpreter runs every launch mode quickly: "across" up to 32 rows
# (3 output tiles, half of PROGRAMS), in-program from 33; K = 200 (K masked), 224 (last range short), 256 (even ranges).
SPLIT_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4, K_SPLIT=64, GROUP_M=8, num_warps=4, num_stages=2,
                    PROGRAMS=6)  # fmt: skip
FEW_BATCHES = (1, 2, 3, 4, 8, 16, 17, 32, 33, 64)
SPLIT_CASES = [(torch.float32, True, 224, range(1, 65)), (torch.float16, False, 200, FEW_BATCHES),
               (torch.float32, False, 256, FEW_BATCHES)]  # fmt: skip
if DEVICE == "cuda":
    SPLIT_CASES.append((torch.bfloat16, True, 224, range(1, 65)))


@pytest.mark.parametrize("dtype, bias, k, batches", SPLIT_CASES)
def test_triton_split_k_matmul_is_row_invariant(dtype, bias, k, batches):
    """A target row alone and at a random place among 0..63 random others: the same bits in every launch mode (the
    K ranges summed by separate programs and combined, or by one program range after range); close to the
    reference."""
    n = 80
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    pool = torch.randn(64, k, generator=gen).to(dtype).to(DEVICE)
    target = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    alone = bi_matmul.matmul(target, w, b, SPLIT_CONFIG)
    expected = target.float() @ w.float().T + (b.float() if bias else 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.float(), expected, atol=tol * expected.abs().max().item(), rtol=tol)
    for m in (1, 33, 64):
        x = torch.cat([target, pool[: m - 1]])
        y = bi_matmul.matmul(x, w, b, SPLIT_CONFIG, across=True)
        assert torch.equal(y, bi_matmul.matmul(x, w, b, SPLIT_CONFIG, across=False)), m
        assert torch.equal(y[0], alone[0]), m
    for m in batches:
        place = int(torch.randint(0, m, (), generator=gen))
        others = pool[torch.randperm(64, generator=gen)[: m - 1]]
        x = torch.cat([others[:place], target, others[place:]])
        assert torch.equal(bi_matmul.matmul(x, w, b, SPLIT_CONFIG)[place], alone[0]), (m, place)


def test_split_configs_depend_on_the_weight_alone():
    """Llama-3-8B's linears: K ranges of whole BLOCK_K steps covering K, none empty; enough programs for one row."""
    for name, make in bi_matmul.CANDIDATES.items():
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (2048, 4096), (100, 72)):
            cfg = make(n, k, torch.bfloat16)
            assert cfg == make(n, k, torch.bfloat16) and cfg["K_SPLIT"] % cfg["BLOCK_K"] == 0, (name, n, k)
            assert (cfg["SPLIT_K"] - 1) * cfg["K_SPLIT"] < k <= cfg["SPLIT_K"] * cfg["K_SPLIT"], (name, n, k)
    assert bi_matmul.split_config(6144, 4096)["SPLIT_K"] == 8
    assert bi_matmul.split_config(28672, 4096)["SPLIT_K"] == 2
    assert bi_matmul.split_config(100, 72)["SPLIT_K"] == 1
    # 16-bit weights: one K range, tiles by M; float32: the split configuration
    assert bi_matmul.config_for(6144, 4096, torch.bfloat16)["SPLIT_K"] == 1
    assert bi_matmul.config_for(6144, 4096, torch.float32) == bi_matmul.split_config(6144, 4096, torch.float32)
    # flat_split, Qwen3-30B-A3B's o: 128 few-row tiles for 132 SMs, two K ranges; no tile past 128 x 128 (two
    # accumulators); the others one range
    assert bi_matmul.CANDIDATES["flat_split"](4096, 4096, torch.bfloat16) == bi_matmul.config_for(
        4096, 4096, torch.bfloat16
    )
    o = bi_matmul.CANDIDATES["flat_split"](2048, 4096, torch.bfloat16)
    assert (o["SPLIT_K"], o["K_SPLIT"]) == (2, 2048) and all(bm * bn <= 128 * 128 for _, bm, _, bn, _ in o["ROW_TILES"])
    assert bi_matmul.use_across(o, 64, 2048, bi_matmul.row_tile(o, 64, 2048))
    assert not bi_matmul.use_across(o, 65, 2048, bi_matmul.row_tile(o, 65, 2048))
    cfg = bi_matmul.config_for(4096, 4096, torch.bfloat16)
    tiles = [bi_matmul.row_tile(cfg, m, 4096) for m in (1, 17, 64, 128, 256, 384, 4096)]
    assert [(t["BLOCK_M"], t["BLOCK_N"], t["num_stages"]) for t in tiles] == [
        (16, 16, 8), (32, 32, 8), (64, 32, 6), (64, 64, 6), (128, 64, 6), (128, 128, 6), (128, 256, 3)]  # fmt: skip
    # from 65 rows the tile follows N too: the first of 128 x 256 .. 64 x 64 with >= 96 programs, 128 x 128 (three
    # stages, two programs an SM) where 128 x 256 would take more than one wave
    big = bi_matmul.config_for(28672, 4096, torch.bfloat16)
    tiles = [bi_matmul.row_tile(big, m, 28672) for m in (128, 129, 1023)]
    assert [(t["BLOCK_M"], t["BLOCK_N"], t["num_warps"], t["num_stages"]) for t in tiles] == [
        (128, 256, 8, 4), (128, 128, 8, 3), (128, 128, 8, 3)]  # fmt: skip
    assert [entry[0] for entry in bi_matmul.flat_row_tiles(4096)] == [1, 17, 33, 65, 129, 257, 513, 641, 1024]
    # a GPU with fewer SMs and less shared memory (an A100's 108 and 163 KiB, an L4's 58 and 99 KiB): every tile's
    # stages fit its shared memory, and the wave is its SM count
    for n in (4096, 28672):
        for sms, smem in ((108, 163 * 1024), (58, 99 * 1024)):
            tiles = bi_matmul.flat_row_tiles(n, sms, smem)
            assert all((bm + bn) * 64 * 2 * stages <= smem for _, bm, _, bn, stages in tiles), (n, sms)
    assert bi_matmul.flat_row_tiles(4096, 108, 163 * 1024)[3] == (65, 64, 4, 64, 3)  # 128 tiles: past one wave


def test_checked_config_keeps_the_tiles_by_m_only_where_rows_keep_their_bits(monkeypatch, caplog):
    """On the device at load: the flat configuration where a probe row gives the same bits alone and at every
    ROW_TILES boundary; where it does not (a kernel whose result for a row changes at 65 rows), the split
    configuration for that shape, with a warning; one check per shape."""
    monkeypatch.setattr(bi_matmul, "_VERDICTS", {})
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(0)).to(torch.float16).to(DEVICE)
    assert bi_matmul.differing_row_counts(w, bi_matmul.config_for(40, 72, w.dtype)) == []
    assert bi_matmul.checked_config(w) == bi_matmul.config_for(40, 72, w.dtype)

    real = bi_matmul.matmul
    calls = []

    def drifting(x, weight, bias=None, config=None, across=None):
        calls.append(x.shape[0])
        y = real(x, weight, bias, config, across)
        return y * 1.001 if x.shape[0] >= 65 and config.get("ROW_TILES") else y

    monkeypatch.setattr(bi_matmul, "matmul", drifting)
    w2 = w[:24].clone()
    assert bi_matmul.differing_row_counts(w2, bi_matmul.config_for(24, 72, w.dtype)) == [65, 1023, 1024]
    with caplog.at_level("WARNING", logger="aserve"):
        assert bi_matmul.checked_config(w2) == bi_matmul.split_config(24, 72, w.dtype)
    assert "[24, 72]" in caplog.text and "[65, 1023, 1024]" in caplog.text
    calls.clear()
    assert bi_matmul.checked_config(w2) == bi_matmul.split_config(24, 72, w.dtype) and calls == []


class PagedRequests:
    """A pool of pages with one long target request's keys and values (positions 0..L-1) and random others; steps
    are built from (q rows, block-table row, sequence length) per request."""

    H, HKV, D, BLOCK, BLOCKS = 4, 2, 24, 16, 48

    def __init__(self, dtype, length: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.length = dtype, length
        shape = (self.BLOCKS, self.BLOCK, self.HKV, self.D)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        self.blocks = torch.randperm(self.BLOCKS, generator=gen)[: -(-length // self.BLOCK)].int()
        self.q = torch.randn(length, self.H, self.D, generator=gen).to(dtype).to(DEVICE)
        self.gen = gen

    def target(self, start: int, end: int):
        return self.q[start:end], self.blocks, end

    def other(self, q_len: int, context: int):
        blocks = torch.randint(0, self.BLOCKS, (-(-(context + q_len) // self.BLOCK),), generator=self.gen).int()
        q = torch.randn(q_len, self.H, self.D, generator=self.gen).to(self.dtype).to(DEVICE)
        return q, blocks, context + q_len

    def attend(self, requests, seg_keys: int, split: bool, **params):
        q = torch.cat([r[0] for r in requests])
        qsl = [0]
        for r in requests:
            qsl.append(qsl[-1] + r[0].shape[0])
        tables = torch.zeros(len(requests), max(len(r[1]) for r in requests), dtype=torch.int32)
        for i, r in enumerate(requests):
            tables[i, : len(r[1])] = r[1]
        seq_lens = torch.tensor([r[2] for r in requests], dtype=torch.int32)
        segments = -(-max(r[2] for r in requests) // seg_keys) if split else 0
        out = bi_attention.attention(q, self.k_cache, self.v_cache, tables.to(DEVICE), seq_lens.to(DEVICE),
                                     torch.tensor(qsl, dtype=torch.int32, device=DEVICE), seg_keys, segments,
                                     **params)  # fmt: skip
        return out, qsl

    def reference(self, **params):
        length = self.length
        meta = AttentionMetadata(length, 0, torch.zeros(length, dtype=torch.long), torch.tensor([0, length]),
                                 torch.tensor([length]), self.blocks.unsqueeze(0).to(DEVICE), [0, length], [length],
                                 length, length)  # fmt: skip
        kv = torch.stack([self.k_cache, self.v_cache])
        return paged_attention(self.q, kv, meta, self.BLOCK, **params)


ATTENTION_CASES = [(torch.float32, {}), (torch.float32, {"sliding_window": 40}),
                   (torch.float32, {"softcap": 3.0, "scale": 0.3}), (torch.float16, {})]  # fmt: skip
ATTENTION_CASES_SLOW = [(dtype, params) for dtype in TRITON_DTYPES[1:]
                        for params in ({"sliding_window": 40}, {"softcap": 3.0, "scale": 0.3})]  # fmt: skip


@pytest.mark.parametrize(
    "dtype, params", ATTENTION_CASES + [pytest.param(*case, marks=pytest.mark.slow) for case in ATTENTION_CASES_SLOW]
)
def test_triton_attention_is_batch_invariant(dtype, params):
    """The target's rows (150 keys, segments of 64) in one step, in chunks beside other requests, and each as a
    decode with split-KV segments and without: the same bits; close to the reference."""
    pool = PagedRequests(dtype, 150)
    seg = 64
    full, _ = pool.attend([pool.target(0, 150)], seg, split=False, **params)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), pool.reference(**params).float(), atol=atol, rtol=1e-2)
    for start, end in ((0, 70), (70, 150)):
        out, qsl = pool.attend([pool.other(1, 10), pool.other(7, 100), pool.target(start, end), pool.other(40, 3)],
                               seg, split=False, **params)  # fmt: skip
        assert torch.equal(out[qsl[2] : qsl[3]], full[start:end]), (start, end)
    for pos in (0, 64, 149):
        for split in (False, True):
            out, qsl = pool.attend([pool.other(1, 30), pool.target(pos, pos + 1), pool.other(1, 200)], seg, split,
                                   **params)  # fmt: skip
            assert torch.equal(out[qsl[1]], full[pos]), (pos, split)


def test_segment_keys():
    assert bi_attention.segment_keys(2048) == 512
    assert bi_attention.segment_keys(131072) == 8192
    assert bi_attention.segment_keys(100000) % bi_attention.TILE_N == 0
