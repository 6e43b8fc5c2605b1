// The bf16 GEMV of one-row inputs: aserve/kernels/cpu.py describes it.
#include "cpu_common.h"
#include "cpu_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MAX_C 512           /* K <= 16384 */

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

/* y [N] = W [N, K] x [K], all bf16; K % 32 == 0. Returns 0, or -1 for a K it does not take. Rows are read in order,
   one sequential stream per thread, with no software prefetch: the hardware prefetcher keeps up with the stream,
   and prefetches issued ahead of it slowed it by a third (docs/benchmarks.md, "CPU", 2026-12-07). */
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
            for (int j = 0; j < 16; j++) acc[j] = row_dot(W + (b * 16 + j) * K, xv, C);
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
