"""CPU bfloat16 GEMV (one input row: batch-1 decode) as a small C kernel (aserve/kernels/cpu_build.py compiles it),
called through ctypes.

    y[n] = sum_k W[n, k] x[k]        W [N, K] bf16 row-major, float32 accumulation, y rounded to bf16

At batch 1 every linear streams its whole weight for one row, so the step is bound by how fast the weights come in
from memory. torch.mv reaches ~9-12 GB/s on the 2-core development VM over a model's cold weights; this kernel
~15-18 GB/s: rows in blocks of 16 spread over torch's threads (OpenMP, static), bf16 pair dot products
(vdpbf16ps) against x held in registers, the 16 row sums reduced with one transpose-and-add tree, and the rows 4
blocks ahead prefetched (the hardware prefetcher alone leaves bandwidth unused here).

Needs AVX512-BF16 (Sapphire Rapids and newer) and K % 32 == 0; `supports()` says whether it applies, callers keep
torch.mv otherwise. Reference: torch.mv (the same products, summed in another order).
"""

from __future__ import annotations

import ctypes

import torch

from aserve.kernels import cpu_build

_SOURCE = (
    cpu_build.BF16_C
    + cpu_build.AVX512_C
    + r"""
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MAX_C 256           /* K <= 8192 */
#define PREFETCH_BLOCKS 4   /* how far ahead (in blocks of 16 rows) the weight is prefetched */

/* One row's dot product with x (two accumulators: the dependency chain of vdpbf16ps, not the loads, would bound a
   single one at K = 576). */
static inline __m512 row_dot(const uint16_t *w, const __m512bh *xv, int64_t C) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 1 < C; c += 2) {
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + 32 * c), xv[c]);
        b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(w + 32 * c + 32), xv[c + 1]);
    }
    if (c < C) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + 32 * c), xv[c]);
    return _mm512_add_ps(a, b);
}

/* y [N] = W [N, K] x [K], all bf16; K % 32 == 0. Returns 0, or -1 for a K it does not take. */
int gemv_bf16(const uint16_t *W, const uint16_t *x, uint16_t *y, int64_t N, int64_t K, int nt) {
    const int64_t C = K / 32, blocks = N / 16;
    if (K % 32 != 0 || C > MAX_C) return -1;
    #pragma omp parallel num_threads(nt)
    {
        __m512bh xv[MAX_C];
        for (int64_t c = 0; c < C; c++) xv[c] = (__m512bh)_mm512_loadu_si512(x + 32 * c);
        #pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; b++) {
            __m512 acc[16];
            for (int j = 0; j < 16; j++) {
                const uint16_t *w = W + (b * 16 + j) * K;
                if (b + PREFETCH_BLOCKS < blocks)
                    for (int64_t p = 0; p < 2 * K; p += 64)
                        _mm_prefetch((const char *)(w + PREFETCH_BLOCKS * 16 * K) + p, _MM_HINT_T0);
                acc[j] = row_dot(w, xv, C);
            }
            float s[16];
            _mm512_storeu_ps(s, hsum16(acc));
            for (int j = 0; j < 16; j++) y[b * 16 + j] = f32_to_bf16(s[j]);
        }
        #pragma omp single
        for (int64_t n = blocks * 16; n < N; n++) y[n] = f32_to_bf16(_mm512_reduce_add_ps(row_dot(W + n * K, xv, C)));
    }
    return 0;
}

int gemv_bf16_available(void) { return 1; }
#else
int gemv_bf16(const uint16_t *W, const uint16_t *x, uint16_t *y, int64_t N, int64_t K, int nt) { return -1; }
int gemv_bf16_available(void) { return 0; }
#endif
"""
)

_SIGNATURES = {
    "gemv_bf16": ([ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int], ctypes.c_int),
    "gemv_bf16_available": ([], ctypes.c_int),
}


def library() -> ctypes.CDLL | None:
    """The compiled kernel (None where no compiler works), also for callers that pass raw pointers
    (aserve/model/cpu_decode.py)."""
    return cpu_build.library("gemv", _SOURCE, _SIGNATURES)


def supports(weight: torch.Tensor) -> bool:
    """Whether gemv takes this weight (CPU, bf16, contiguous [N, K] with K % 32 == 0, on a CPU with AVX512-BF16)."""
    lib = library()
    return (
        lib is not None
        and bool(lib.gemv_bf16_available())
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % 32 == 0
        and weight.shape[1] <= 8192
    )


def gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (`supports` holds), x [K] bf16 -> weight @ x [N] bf16."""
    assert x.dtype == torch.bfloat16 and x.shape == (weight.shape[1],)
    x = x.contiguous()
    y = torch.empty(weight.shape[0], dtype=torch.bfloat16)
    rc = library().gemv_bf16(weight.data_ptr(), x.data_ptr(), y.data_ptr(), weight.shape[0], weight.shape[1],
                             torch.get_num_threads())  # fmt: skip
    assert rc == 0
    return y
