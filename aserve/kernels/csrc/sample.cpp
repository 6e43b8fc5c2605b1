// The greedy pick (first maximum, non-finite flag per row): aserve/kernels/cpu.py describes it.
#include "cpu_common.h"
#include "cpu_kernels.h"

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
