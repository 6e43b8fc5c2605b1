"""Greedy pick on the CPU: per logits row, the index of the first maximum and whether the row holds a NaN or an
infinity, in one C kernel (aserve/kernels/cpu_build.py compiles it) reading the logits in the model's dtype.

For a batch of greedy requests the sampler needs nothing else from the logits, and torch's way to get the same
([64, 49152] rows: widen bf16 to float32, a sum for the finite check, max(dim).indices) took ~4-5 ms per decode step
on the 2-core development VM, a few percent of the step (docs/benchmarks.md). Same result as
`logits.float().max(dim=-1).indices` (first maximum; -0.0 == 0.0) and `~isfinite(logits.float().sum(-1))` for rows
of finite values and for rows holding NaN or an infinity (flagged; the index of such a row means nothing).
"""

from __future__ import annotations

import ctypes

import torch

from aserve.kernels import cpu_build

_SOURCE = (
    cpu_build.BF16_C
    + r"""
#include <math.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* 16 values from element i of a bf16 or float32 row, masked lanes -inf. */
static inline __m512 load16(const void *row, int64_t i, __mmask16 m, int bf16) {
    if (bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + i);
        __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, x);
    }
    return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, (const float *)row + i);
}

static void pick_row(const void *row, int64_t vocab, int bf16, int64_t *idx, int64_t *nonfinite) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = 0;
    for (int64_t i = 0; i < vocab; i += 16) {
        const __mmask16 m = vocab - i >= 16 ? 0xFFFF : (__mmask16)((1u << (vocab - i)) - 1u);
        const __m512 x = load16(row, i, m, bf16);
        bad |= _mm512_mask_cmp_ps_mask(m, _mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_UNORD_Q);  /* inf, nan */
        mx = _mm512_max_ps(mx, x);
    }
    const float best = _mm512_reduce_max_ps(mx);
    const __m512 b = _mm512_set1_ps(best);
    int64_t at = 0;
    for (int64_t i = 0; i < vocab; i += 16) {
        const __mmask16 m = vocab - i >= 16 ? 0xFFFF : (__mmask16)((1u << (vocab - i)) - 1u);
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, load16(row, i, m, bf16), b, _CMP_EQ_OQ);
        if (hit) {
            at = i + __builtin_ctz(hit);
            break;
        }
    }
    *idx = at;
    *nonfinite = bad != 0;
}
#else
static void pick_row(const void *row, int64_t vocab, int bf16, int64_t *idx, int64_t *nonfinite) {
    float best = -INFINITY;
    int64_t at = 0, bad = 0;
    for (int64_t i = 0; i < vocab; i++) {
        const float x = bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
        bad |= !isfinite(x);
        if (x > best) {
            best = x;
            at = i;
        }
    }
    *idx = at;
    *nonfinite = bad;
}
#endif

/* logits [rows, vocab] (row stride `stride` elements), bf16 (1) or float32 (0) -> idx [rows], nonfinite [rows]. */
void greedy_pick(const void *logits, int64_t rows, int64_t vocab, int64_t stride, int bf16, int64_t *idx,
                 int64_t *nonfinite, int num_threads) {
    const int64_t esize = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        pick_row((const char *)logits + r * stride * esize, vocab, bf16, idx + r, nonfinite + r);
}
"""
)

_SIGNATURES = {
    "greedy_pick": (
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
         ctypes.c_void_p, ctypes.c_int], None),
}  # fmt: skip


def library() -> ctypes.CDLL | None:
    return cpu_build.library("greedy_pick", _SOURCE, _SIGNATURES)


def supports(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(-1) == 1
        and logits.shape[1] > 0
        and library() is not None
    )


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] -> (index of each row's first maximum int64 [rows], row holds NaN/inf bool [rows]).
    `supports` must hold."""
    rows, vocab = logits.shape
    idx = torch.empty(rows, dtype=torch.int64)
    bad = torch.empty(rows, dtype=torch.int64)
    library().greedy_pick(
        logits.data_ptr(), rows, vocab, logits.stride(0), int(logits.dtype == torch.bfloat16), idx.data_ptr(),
        bad.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return idx, bad.bool()
