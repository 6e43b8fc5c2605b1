"""CPU decode attention that reads the paged KV cache in place: a C kernel (aserve/kernels/csrc/attention.cpp, built
once per machine by aserve/kernels/cpu_build.py) called as the typed op torch.ops.aserve.paged_decode_attention.

The torch path (aserve/layers/attention/torch_backend.py) gathers every decoding request's blocks into a
padded copy with index_select and then runs SDPA: K/V bytes are read, written and read again, and SDPA's CPU kernel
is slow at one query token. Here each (request, KV head) pair is one work item (OpenMP, torch's thread count, a
request's KV heads handed out together so that one core reads all of its cache lines; the runtime is torch's own
libgomp, which the compiled library binds to):

    scores[t, g] = q[g] . K[t] * scale     for the G query heads sharing the KV head, t over the request's tokens,
                                           read block by block through the block table (bf16 rows widened in
                                           registers)
    p = exp(scores - max), l = sum(p)      (a vectorisable exp2 polynomial: libm's expf does not vectorise)
    out[g] = sum_t p[t, g] V[t] / l

float32 and bfloat16 (round to nearest even on the way out). On CPUs with AVX512-BF16 (Sapphire Rapids and newer)
bfloat16 takes a vectorised path: q . k as bf16 pair dot products (vdpbf16ps) for 16 tokens at a time, reduced
with one transpose-and-add tree, and P @ V with two tokens' V rows interleaved so that one vdpbf16ps adds both (P
rounded to bf16 once, vectorised, as flash attention kernels round it). The common head shapes (head_dim 64 or 128;
1, 2, 3, 4 or 8 query heads per KV head) get their own copy of those loops with G and D fixed at compile time, so
the query, the accumulators and the per-token loops stay in registers.

With AMX (Sapphire Rapids and newer; Linux grants the tile state on request; ASERVE_CPU_AMX=0 turns it off), both
products run on tiles where head_dim <= 128: Q . K^T takes 16 K rows straight from the cache (a tile load with the
cache's row stride) against Q held in tiles for the whole item, and P @ V (head_dim <= 64) multiplies 32 tokens'
bf16 weights by their V rows interleaved pairwise into a tile. The sums run in another order than vdpbf16ps's, so
results differ from the AVX-512 path by float32 rounding.

The K/V rows of coming blocks are prefetched (32-64 tokens ahead). prefetch_rows must be always inlined: GCC
dropped its prefetches when it stayed an out-of-line call, which made the kernel ~40 % slower when the cache is in
DRAM (the engine's case: every layer's K/V in turn) while a benchmark that repeats one layer, whose cache stays in
L3, saw nothing. On the 2-core development VM, over 30 layer caches of 64 requests x 320 tokens (SmolLM2 heads):
1.07-1.18 ms per call with AMX, 1.35 without, 1.33-1.49 for the kernel before the compile-time shapes
(docs/benchmarks.md). Reference: aserve/kernels/reference.py paged_attention.
`available()` is False where no compiler works; callers then keep the torch path.
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu_build

# The extension's raw entry points (None where it cannot be built), for callers that own their buffers and pass
# data_ptr()s (aserve/models/cpu_one_token.py).
library = cpu_build.load_all


def available() -> bool:
    return library() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention takes these tensors (CPU, float32 / bfloat16, contiguous rows)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype == q.dtype
        and k_cache.is_contiguous()
        and q.stride(-1) == 1
        and q.stride(-2) == q.shape[-1]
        and q.shape[-1] <= 256
        and available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float | None = None,
    generic: bool = False,
) -> torch.Tensor:
    """One query token per request: q [n, H, D], caches [num_blocks, block_size, Hkv, D], block_tables [>= n, max]
    int32, seq_lens [>= n] int32 (tokens in the cache, the new one included) -> out[:n] = attention (out [>= n, H,
    D], rows contiguous; scale: D**-0.5 if None). `supports` must hold; ValueError for head shapes the kernel does not
    take. `generic`: the portable C loops even where the AVX512-BF16 path applies (tests, benchmarks)."""
    torch.ops.aserve.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out, scale, generic)
    return out
