// Weight-only INT8 products (W8A16): aserve/kernels/cpu.py describes them.
#include "cpu_common.h"
#include "cpu_kernels.h"

#define I8_XF 16384        /* a thread's float32 copy of x rows (64 KB on its stack): 16384 / K rows per pass */
#define I8_MAX_K I8_XF
#define I8_BLOCK 16        /* output rows per work item */

static void row_to_f32(const void *x, int bf16, int64_t K, float *out) {
    if (bf16) {
        const uint16_t *xh = (const uint16_t *)x;
        for (int64_t k = 0; k < K; k++) out[k] = bf16_to_f32(xh[k]);
    } else {
        memcpy(out, x, (size_t)K * sizeof(float));
    }
}

/* One row's dot product: 16 partial sums, which the compiler vectorises without reordering any one sum. */
static float dot_generic(const int8_t *w, const float *xf, int64_t K) {
    float acc[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int j = 0; j < 16; j++) acc[j] += (float)w[k + j] * xf[k + j];
    float s = 0.0f;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; k < K; k++) s += (float)w[k] * xf[k];
    return s;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1

static inline __m512 w16(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}

/* Weight rows are read one after another, each from start to end: one sequential stream per thread, which the
   hardware prefetcher keeps up with (rows read side by side, several streams at a stride of K, streamed at a third
   of the rate on a Zen 4 core; software prefetches ahead of the stream slowed it too). Each 16-weight vector is
   widened once for the MB rows of x; with one x row, two accumulators per row (16-lane partial sums of alternate
   16-weight steps), with more, one per x row. */
template <int MB>
static inline void row_fast(const int8_t *w, int64_t K, const float *xf, __m512 (*acc)[I8_BLOCK], int r) {
    constexpr int U = MB == 1 ? 2 : 1;
    __m512 a[U][MB];
    for (int u = 0; u < U; u++)
        for (int j = 0; j < MB; j++) a[u][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * U <= K; k += 16 * U)
        for (int u = 0; u < U; u++) {
            const __m512 wv = w16(w + k + 16 * u);
            for (int j = 0; j < MB; j++)
                a[u][j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf + j * K + k + 16 * u), a[u][j]);
        }
    for (; k < K; k += 16) {
        const __m512 wv = w16(w + k);
        for (int j = 0; j < MB; j++) a[0][j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf + j * K + k), a[0][j]);
    }
    for (int j = 0; j < MB; j++) {
        __m512 t = a[0][j];
        for (int u = 1; u < U; u++) t = _mm512_add_ps(t, a[u][j]);
        acc[j][r] = t;
    }
}

template <int MB>
static void block_vec(const int8_t *W, const float *scale, const float *xf, int64_t n0, int64_t K,
                      float (*s)[I8_BLOCK]) {
    __m512 acc[MB][I8_BLOCK];
    for (int r = 0; r < I8_BLOCK; r++) row_fast<MB>(W + (n0 + r) * K, K, xf, acc, r);
    const __m512 sc = _mm512_loadu_ps(scale + n0);
    for (int j = 0; j < MB; j++) _mm512_storeu_ps(s[j], _mm512_mul_ps(hsum16(acc[j]), sc));
}
#define HAVE_AVX2_I8 0
#else
#define HAVE_AVX512 0
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2_I8 1

static inline __m256 w8(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

static inline float hsum8(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* AVX2: weight row w against MB rows of xf (row stride K), K % 8 == 0, read as the AVX-512 path reads it (one row
   after another): s[j][r] = the dot product with x row j, times the row's scale. 8-lane partial sums; U
   accumulators per x row, so that MB x U FMA chains are in flight. */
template <int MB>
static inline void row_avx2(const int8_t *w, float scale, int64_t K, const float *xf, float (*s)[I8_BLOCK], int r) {
    constexpr int U = MB == 1 ? 4 : MB == 2 ? 2 : 1;
    __m256 a[U][MB];
    for (int u = 0; u < U; u++)
        for (int j = 0; j < MB; j++) a[u][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * U <= K; k += 8 * U)
        for (int u = 0; u < U; u++) {
            const __m256 wv = w8(w + k + 8 * u);
            for (int j = 0; j < MB; j++)
                a[u][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + j * K + k + 8 * u), a[u][j]);
        }
    for (; k < K; k += 8) {
        const __m256 wv = w8(w + k);
        for (int j = 0; j < MB; j++) a[0][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + j * K + k), a[0][j]);
    }
    for (int j = 0; j < MB; j++) {
        __m256 t = a[0][j];
        for (int u = 1; u < U; u++) t = _mm256_add_ps(t, a[u][j]);
        s[j][r] = hsum8(t) * scale;
    }
}

/* A whole block of 16 outputs for MB x rows, one weight row at a time. */
template <int MB>
static void block_vec(const int8_t *W, const float *scale, const float *xf, int64_t n0, int64_t K,
                      float (*s)[I8_BLOCK]) {
    for (int r = 0; r < I8_BLOCK; r++) row_avx2<MB>(W + (n0 + r) * K, scale[n0 + r], K, xf, s, r);
}
#else
#define HAVE_AVX2_I8 0
#endif
#endif

#define I8_MB 4  /* rows of x per block pass */

/* s[j][r]: output n0 + r (r < rows <= 16) for x row j (j < mb <= 4; xf holds them, row stride K), times its
   scale. */
static void block_outputs(const int8_t *W, const float *scale, const float *xf, int64_t n0, int64_t rows, int64_t K,
                          int64_t mb, int fast, float (*s)[I8_BLOCK]) {
#if HAVE_AVX512 || HAVE_AVX2_I8
    if (fast && rows == I8_BLOCK) {  /* block_vec: the AVX-512 or the AVX2 one, whichever this build has */
        switch (mb) {
            case 1: block_vec<1>(W, scale, xf, n0, K, s); return;
            case 2: block_vec<2>(W, scale, xf, n0, K, s); return;
            case 3: block_vec<3>(W, scale, xf, n0, K, s); return;
            default: block_vec<4>(W, scale, xf, n0, K, s); return;
        }
    }
#endif
    (void)fast;
    for (int64_t j = 0; j < mb; j++)
        for (int64_t r = 0; r < rows; r++) s[j][r] = dot_generic(W + (n0 + r) * K, xf + j * K, K) * scale[n0 + r];
}

int gemm_int8(const int8_t *W, const float *scale, const void *x, void *y, int64_t M, int64_t N, int64_t K,
              int64_t x_stride, int64_t y_stride, int bf16, int nt, int force_generic) {
    if (K <= 0 || K > I8_MAX_K) return -1;
    const int fast = !force_generic && ((HAVE_AVX512 && K % 16 == 0) || (HAVE_AVX2_I8 && K % 8 == 0));
    const int64_t rows_per_pass = I8_XF / K;  /* x rows converted to float32 at once */
    const int64_t blocks = (N + I8_BLOCK - 1) / I8_BLOCK;
    const size_t elem = bf16 ? 2 : 4;
    #pragma omp parallel num_threads(nt)
    {
        float xf[I8_XF];
        for (int64_t m0 = 0; m0 < M; m0 += rows_per_pass) {
            const int64_t mn = M - m0 < rows_per_pass ? M - m0 : rows_per_pass;
            for (int64_t i = 0; i < mn; i++) row_to_f32((const char *)x + (m0 + i) * x_stride * elem, bf16, K, xf + i * K);
            /* static and nowait: every pass gives a thread the same blocks (their rows still in its cache) */
            #pragma omp for schedule(static) nowait
            for (int64_t b = 0; b < blocks; b++) {
                const int64_t n0 = b * I8_BLOCK, rows = N - n0 < I8_BLOCK ? N - n0 : I8_BLOCK;
                for (int64_t i = 0; i < mn; i += I8_MB) {
                    const int64_t mb = mn - i < I8_MB ? mn - i : I8_MB;
                    float s[I8_MB][I8_BLOCK];
                    block_outputs(W, scale, xf + i * K, n0, rows, K, mb, fast, s);
                    for (int64_t j = 0; j < mb; j++) {
                        char *out = (char *)y + (m0 + i + j) * y_stride * elem;
                        for (int64_t r = 0; r < rows; r++) {
                            if (bf16) ((uint16_t *)out)[n0 + r] = f32_to_bf16(s[j][r]);
                            else ((float *)out)[n0 + r] = s[j][r];
                        }
                    }
                }
            }
        }
    }
    return 0;
}
