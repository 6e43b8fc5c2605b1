// The batch-invariant product y [M, N] = x [M, K] W^T: every output element is summed in one fixed order that
// depends on K alone, never on M, the row's place in x, the tile it falls in or the number of threads.
// aserve/kernels/cpu.py describes it.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <stdlib.h>

#define GR_BLOCK 16  /* bf16: output channels per packed block */
#define GR_MR 6      /* x rows per tile */

/* bf16 weights packed once: W [N, K] -> blocks of 16 output channels, k in pairs: Wp[b][p][j][2] = W[16 b + j][2 p,
   2 p + 1], zeros past N and K. A 64-byte load is then one k pair of 16 outputs, which vdpbf16ps multiplies by the
   pair of x broadcast to every lane. */
void gemm_rows_pack_bf16(const uint16_t *W, uint16_t *Wp, int64_t N, int64_t K) {
    const int64_t blocks = (N + GR_BLOCK - 1) / GR_BLOCK, pairs = (K + 1) / 2;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t j = 0; j < GR_BLOCK; j++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t n = b * GR_BLOCK + j, k = 2 * p + e;
                    Wp[((b * pairs + p) * GR_BLOCK + j) * 2 + e] = n < N && k < K ? W[n * K + k] : 0;
                }
}

/* x row r's pair p as one 32-bit word (the second half zero past an odd K: never read beyond the row). */
static inline int32_t x_pair(const uint16_t *x, int64_t p, int64_t K) {
    int32_t v = 0;
    memcpy(&v, x + 2 * p, 2 * p + 1 < K ? 4 : 2);
    return v;
}

#if !(defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_GR_AVX2 1
#define GR_MR_AVX2 4     /* bf16: x rows per tile (8 accumulators of 8 lanes, 4 widened weight vectors) */
#define GR_GROUP_AVX2 4  /* bf16: packed blocks per work item */

/* AVX2 + FMA (no AVX-512 BF16). bf16: x widened to float32 rows first (xf, stride 2 * pairs, a zero past an odd K);
   per output one FMA chain over k in order (k = 2 p, then 2 p + 1, pair after pair) over the same packed weight, a
   32-byte load holding one k pair of 8 outputs, widened in registers (the low half of each 32-bit word is k = 2 p). */
template <int MR, int NB>
static inline __attribute__((always_inline)) void tile_bf16_avx2(const float *xf, int64_t xf_stride,
                                                                 const uint16_t *wp, int64_t pairs, uint16_t *y,
                                                                 int64_t y_stride, int lanes) {
    __m256 a[MR][NB][2];
    for (int i = 0; i < MR; i++)
        for (int b = 0; b < NB; b++) a[i][b][0] = a[i][b][1] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    const int64_t block = pairs * 2 * GR_BLOCK;  /* elements of one packed block */
    for (int64_t p = 0; p < pairs; p++) {
        #pragma GCC unroll 4
        for (int b = 0; b < NB; b++) {
            const uint16_t *w = wp + b * block + p * 2 * GR_BLOCK;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)w);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + GR_BLOCK));
            const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
            const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
            const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
            const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
            #pragma GCC unroll 4
            for (int i = 0; i < MR; i++) {
                const __m256 xe = _mm256_broadcast_ss(xf + i * xf_stride + 2 * p);
                const __m256 xo = _mm256_broadcast_ss(xf + i * xf_stride + 2 * p + 1);
                a[i][b][0] = _mm256_fmadd_ps(even0, xe, a[i][b][0]);
                a[i][b][1] = _mm256_fmadd_ps(even1, xe, a[i][b][1]);
                a[i][b][0] = _mm256_fmadd_ps(odd0, xo, a[i][b][0]);
                a[i][b][1] = _mm256_fmadd_ps(odd1, xo, a[i][b][1]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int b = 0; b < NB; b++) {
            float out[GR_BLOCK];
            _mm256_storeu_ps(out, a[i][b][0]);
            _mm256_storeu_ps(out + 8, a[i][b][1]);
            const int n = b == NB - 1 ? lanes : GR_BLOCK;
            for (int j = 0; j < n; j++) y[i * y_stride + b * GR_BLOCK + j] = f32_to_bf16(out[j]);
        }
}

/* Rows [m0, m_end) against nb <= GR_GROUP_AVX2 blocks: tiles of 4 rows by one block (8 accumulators), the last
   rows one at a time against all nb blocks (8 accumulators at nb = 4: decode's one row keeps as many FMA chains
   in flight). Every output's chain is the same whichever tile computes it. */
static void rows_bf16_avx2(const float *xf, int64_t xf_stride, const uint16_t *wp, int64_t pairs, uint16_t *y,
                           int64_t y_stride, int64_t m0, int64_t m_end, int nb, int lanes) {
    const int64_t block = pairs * 2 * GR_BLOCK;
    int64_t m = m0;
    for (; m + GR_MR_AVX2 <= m_end; m += GR_MR_AVX2)
        for (int b = 0; b < nb; b++)
            tile_bf16_avx2<GR_MR_AVX2, 1>(xf + m * xf_stride, xf_stride, wp + b * block, pairs,
                                          y + m * y_stride + b * GR_BLOCK, y_stride, b == nb - 1 ? lanes : GR_BLOCK);
    for (; m < m_end; m++) {
        const float *xr = xf + m * xf_stride;
        uint16_t *yr = y + m * y_stride;
        switch (nb) {
            case 4: tile_bf16_avx2<1, 4>(xr, xf_stride, wp, pairs, yr, y_stride, lanes); break;
            case 3: tile_bf16_avx2<1, 3>(xr, xf_stride, wp, pairs, yr, y_stride, lanes); break;
            case 2: tile_bf16_avx2<1, 2>(xr, xf_stride, wp, pairs, yr, y_stride, lanes); break;
            default: tile_bf16_avx2<1, 1>(xr, xf_stride, wp, pairs, yr, y_stride, lanes); break;
        }
    }
}

/* float32: per output 16 partial sums over k = j mod 16 (two 8-lane FMA chains over chunks of 16 k's, the last
   chunk's missing k's loaded as zeros), added in the portable loops' tree. Tiles of 2 x rows by NR outputs. */
static inline float sum16_tree(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);                                                    /* j += j + 8 */
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));     /* j += j + 4 */
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                    /* j += j + 2 */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));                                  /* j += j + 1 */
}

template <int MR, int NR>
static inline __attribute__((always_inline)) void tile_f32_avx2(const float *x, int64_t x_stride, const float *w,
                                                                int64_t K, float *y, int64_t y_stride) {
    __m256 a[MR][NR][2];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) a[i][j][0] = a[i][j][1] = _mm256_setzero_ps();
    const int64_t C = (K + 15) / 16, rest = K - 16 * (C - 1);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rest), lane);
    const __m256i mask_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rest - 8), lane);
    for (int64_t c = 0; c < C; c++) {
        const bool whole = c < C - 1 || rest == 16;
        __m256 w0[NR], w1[NR];
        for (int j = 0; j < NR; j++) {
            const float *wc = w + j * K + 16 * c;
            w0[j] = whole ? _mm256_loadu_ps(wc) : _mm256_maskload_ps(wc, mask_lo);
            w1[j] = whole ? _mm256_loadu_ps(wc + 8) : _mm256_maskload_ps(wc + 8, mask_hi);
        }
        for (int i = 0; i < MR; i++) {
            const float *xc = x + i * x_stride + 16 * c;
            const __m256 x0 = whole ? _mm256_loadu_ps(xc) : _mm256_maskload_ps(xc, mask_lo);
            const __m256 x1 = whole ? _mm256_loadu_ps(xc + 8) : _mm256_maskload_ps(xc + 8, mask_hi);
            for (int j = 0; j < NR; j++) {
                a[i][j][0] = _mm256_fmadd_ps(w0[j], x0, a[i][j][0]);
                a[i][j][1] = _mm256_fmadd_ps(w1[j], x1, a[i][j][1]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) y[i * y_stride + j] = sum16_tree(a[i][j][0], a[i][j][1]);
}

static void rows_f32(const float *W, const float *x, float *y, int64_t m0, int64_t m_end, int64_t n0, int64_t nr,
                     int64_t K, int64_t x_stride, int64_t y_stride) {
    for (int64_t n = n0; n < n0 + nr; n += 2) {
        const float *w = W + n * K;
        const bool two = n + 1 < n0 + nr;
        int64_t m = m0;
        for (; m + 2 <= m_end; m += 2) {
            if (two) tile_f32_avx2<2, 2>(x + m * x_stride, x_stride, w, K, y + m * y_stride + n, y_stride);
            else tile_f32_avx2<2, 1>(x + m * x_stride, x_stride, w, K, y + m * y_stride + n, y_stride);
        }
        if (m < m_end) {
            if (two) tile_f32_avx2<1, 2>(x + m * x_stride, x_stride, w, K, y + m * y_stride + n, y_stride);
            else tile_f32_avx2<1, 1>(x + m * x_stride, x_stride, w, K, y + m * y_stride + n, y_stride);
        }
    }
}

/* bf16 work items: (slab of x rows, group of GR_GROUP_AVX2 blocks); x widened to float32 first. */
static int gemm_rows_bf16(const void *W, const void *x, void *y, int64_t M, int64_t N, int64_t K,
                          int64_t x_stride, int64_t y_stride, int64_t slabs, int64_t slab, int nt, int par) {
    const int64_t blocks = (N + GR_BLOCK - 1) / GR_BLOCK, pairs = (K + 1) / 2, xf_stride = 2 * pairs;
    const int64_t groups = (blocks + GR_GROUP_AVX2 - 1) / GR_GROUP_AVX2;
    float *xf = (float *)malloc(sizeof(float) * M * xf_stride);
    if (!xf) return -2;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = (const uint16_t *)x + m * x_stride;
        for (int64_t k = 0; k < xf_stride; k++) xf[m * xf_stride + k] = k < K ? bf16_to_f32(xr[k]) : 0.0f;
    }
    #pragma omp parallel for schedule(static) collapse(2) num_threads(nt) if(par)
    for (int64_t s = 0; s < slabs; s++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t m0 = s * slab, m_end = m0 + slab < M ? m0 + slab : M, b0 = g * GR_GROUP_AVX2;
            const int nb = (int)(blocks - b0 < GR_GROUP_AVX2 ? blocks - b0 : GR_GROUP_AVX2);
            const int64_t n0 = b0 * GR_BLOCK, last = n0 + (nb - 1) * GR_BLOCK;
            const int lanes = (int)(N - last < GR_BLOCK ? N - last : GR_BLOCK);  /* outputs in the last block */
            rows_bf16_avx2(xf, xf_stride, (const uint16_t *)W + n0 * pairs * 2, pairs, (uint16_t *)y + n0,
                           y_stride, m0, m_end, nb, lanes);
        }
    free(xf);
    return 0;
}

#elif !(defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__))
/* Portable order (no AVX-512 BF16, no AVX2). bf16: per output, the two products of each k pair added in turn, pair after pair.
   float32: 16 partial sums over k = j mod 16, added in a fixed tree. */
static float dot_portable_bf16(const uint16_t *Wp, const uint16_t *x, int64_t n, int64_t K) {
    const int64_t pairs = (K + 1) / 2, b = n / GR_BLOCK, j = n % GR_BLOCK;
    float acc = 0.0f;
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t *w = Wp + ((b * pairs + p) * GR_BLOCK + j) * 2;
        const int32_t xp = x_pair(x, p, K);
        acc += bf16_to_f32(w[0]) * bf16_to_f32((uint16_t)(xp & 0xFFFF));
        acc += bf16_to_f32(w[1]) * bf16_to_f32((uint16_t)((uint32_t)xp >> 16));
    }
    return acc;
}

static float dot_portable_f32(const float *w, const float *x, int64_t K) {
    float acc[16] = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int j = 0; j < 16; j++) acc[j] += w[k + j] * x[k + j];
    for (int j = 0; k < K; k++, j++) acc[j] += w[k] * x[k];
    for (int s = 8; s > 0; s /= 2)
        for (int j = 0; j < s; j++) acc[j] += acc[j + s];
    return acc[0];
}
#else
#include <immintrin.h>
#define HAVE_GR_AVX512 1

/* f32_to_bf16 (cpu_common.h) on 16 lanes, the same integer steps: round to nearest even, no NaN handling. */
static inline __m256i round_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* One k pair of the tile: the pair's weights of NV blocks, each x row's pair broadcast (ODD: the last pair of an odd
   K, whose second half is zero). */
template <int MR, int NV, bool ODD>
static inline __attribute__((always_inline)) void pair_bf16(__m512 (*a)[NV], const uint16_t *x, int64_t x_stride,
                                                            const uint16_t *wp, int64_t block, int64_t p, int64_t K) {
    __m512bh w[NV];
    #pragma GCC unroll 8
    for (int j = 0; j < NV; j++) w[j] = (__m512bh)_mm512_loadu_si512(wp + j * block + p * 2 * GR_BLOCK);
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        int32_t xp;
        if (ODD) xp = x_pair(x + i * x_stride, p, K);
        else memcpy(&xp, x + i * x_stride + 2 * p, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp);
        #pragma GCC unroll 8
        for (int j = 0; j < NV; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], w[j], xb);
    }
}

/* bf16: MR x rows against NV packed blocks (16 NV outputs): per output one vdpbf16ps chain over the k pairs, in
   order. lanes: how many outputs of the last block are stored (16 for whole blocks). */
template <int MR, int NV>
static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *wp,
                                                            int64_t K, uint16_t *y, int64_t y_stride, int lanes) {
    __m512 a[MR][NV];
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        #pragma GCC unroll 8
        for (int j = 0; j < NV; j++) a[i][j] = _mm512_setzero_ps();
    const int64_t full = K / 2, block = (K + 1) / 2 * 2 * GR_BLOCK;
    for (int64_t p = 0; p < full; p++) pair_bf16<MR, NV, false>(a, x, x_stride, wp, block, p, K);
    if (K % 2) pair_bf16<MR, NV, true>(a, x, x_stride, wp, block, full, K);
    const __mmask16 last = lanes >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << lanes) - 1u);
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        #pragma GCC unroll 8
        for (int j = 0; j < NV; j++)
            _mm256_mask_storeu_epi16(y + i * y_stride + GR_BLOCK * j, j == NV - 1 ? last : (__mmask16)0xFFFF,
                                     round_bf16x16(a[i][j]));
}

template <int NV>
static void rows_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *wp, int64_t K, uint16_t *y,
                      int64_t y_stride, int64_t m0, int64_t m_end, int lanes) {
    int64_t m = m0;
    for (; m + GR_MR <= m_end; m += GR_MR)
        tile_bf16<GR_MR, NV>(x + m * x_stride, x_stride, wp, K, y + m * y_stride, y_stride, lanes);
    switch (m_end - m) {
        case 5: tile_bf16<5, NV>(x + m * x_stride, x_stride, wp, K, y + m * y_stride, y_stride, lanes); break;
        case 4: tile_bf16<4, NV>(x + m * x_stride, x_stride, wp, K, y + m * y_stride, y_stride, lanes); break;
        case 3: tile_bf16<3, NV>(x + m * x_stride, x_stride, wp, K, y + m * y_stride, y_stride, lanes); break;
        case 2: tile_bf16<2, NV>(x + m * x_stride, x_stride, wp, K, y + m * y_stride, y_stride, lanes); break;
        case 1: tile_bf16<1, NV>(x + m * x_stride, x_stride, wp, K, y + m * y_stride, y_stride, lanes); break;
    }
}

/* float32: per output one 16-lane FMA chain over chunks of 16 k's (the last one masked), its lanes then summed by
   hsum16 for outputs in whole blocks of 16, by _mm512_reduce_add_ps for the N % 16 last ones. */
template <int MR, int NR>
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t x_stride, const float *w,
                                                           int64_t K, __m512 (*r)[GR_BLOCK], int n_off) {
    __m512 a[MR][NR];
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        #pragma GCC unroll 8
        for (int j = 0; j < NR; j++) a[i][j] = _mm512_setzero_ps();
    const int64_t C = (K + 15) / 16;
    const __mmask16 tail = K % 16 ? (__mmask16)((1u << (K % 16)) - 1u) : (__mmask16)0xFFFF;
    for (int64_t c = 0; c < C; c++) {
        const __mmask16 mk = c < C - 1 ? (__mmask16)0xFFFF : tail;
        __m512 wv[NR];
        #pragma GCC unroll 8
        for (int j = 0; j < NR; j++) wv[j] = _mm512_maskz_loadu_ps(mk, w + j * K + 16 * c);
        #pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mk, x + i * x_stride + 16 * c);
            #pragma GCC unroll 8
            for (int j = 0; j < NR; j++) a[i][j] = _mm512_fmadd_ps(wv[j], xv, a[i][j]);
        }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        #pragma GCC unroll 8
        for (int j = 0; j < NR; j++) r[i][n_off + j] = a[i][j];
}

template <int MR>
static void block_f32(const float *W, const float *x, float *y, int64_t m0, int64_t n0, int64_t nr, int64_t K,
                      int64_t x_stride, int64_t y_stride) {
    __m512 r[MR][GR_BLOCK];
    const float *xb = x + m0 * x_stride, *wb = W + n0 * K;
    if (nr == GR_BLOCK)
        for (int j = 0; j < GR_BLOCK; j += 4) tile_f32<MR, 4>(xb, x_stride, wb + j * K, K, r, j);
    else
        for (int j = 0; j < nr; j++) tile_f32<MR, 1>(xb, x_stride, wb + j * K, K, r, j);
    for (int i = 0; i < MR; i++) {
        float *row = y + (m0 + i) * y_stride + n0;
        if (nr == GR_BLOCK) _mm512_storeu_ps(row, hsum16(r[i]));
        else
            for (int j = 0; j < nr; j++) row[j] = _mm512_reduce_add_ps(r[i][j]);
    }
}

static void rows_f32(const float *W, const float *x, float *y, int64_t m0, int64_t m_end, int64_t n0, int64_t nr,
                     int64_t K, int64_t x_stride, int64_t y_stride) {
    int64_t m = m0;
    for (; m + GR_MR <= m_end; m += GR_MR) block_f32<GR_MR>(W, x, y, m, n0, nr, K, x_stride, y_stride);
    for (; m < m_end; m++) block_f32<1>(W, x, y, m, n0, nr, K, x_stride, y_stride);
}

/* bf16 work items: (slab of x rows, group of 4 or 2 blocks: narrower groups for few rows, more items). */
static int gemm_rows_bf16(const void *W, const void *x, void *y, int64_t M, int64_t N, int64_t K,
                          int64_t x_stride, int64_t y_stride, int64_t slabs, int64_t slab, int nt, int par) {
    const int nv = M >= GR_MR && (N + 63) / 64 * slabs >= 16 ? 4 : 2;  /* enough items for the threads */
    const int64_t width = nv * GR_BLOCK, groups = (N + width - 1) / width, pairs = (K + 1) / 2;
    #pragma omp parallel for schedule(static) collapse(2) num_threads(nt) if(par)
    for (int64_t s = 0; s < slabs; s++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t m0 = s * slab, m_end = m0 + slab < M ? m0 + slab : M, n0 = g * width;
            const int64_t blocks = (N - n0 + GR_BLOCK - 1) / GR_BLOCK < nv ? (N - n0 + GR_BLOCK - 1) / GR_BLOCK : nv;
            const int lanes = (int)(N - n0 - (blocks - 1) * GR_BLOCK);  /* outputs in the last block */
            const uint16_t *wp = (const uint16_t *)W + n0 * pairs * 2, *xs = (const uint16_t *)x;
            uint16_t *ys = (uint16_t *)y + n0;
            switch (blocks) {
                case 4: rows_bf16<4>(xs, x_stride, wp, K, ys, y_stride, m0, m_end, lanes); break;
                case 3: rows_bf16<3>(xs, x_stride, wp, K, ys, y_stride, m0, m_end, lanes); break;
                case 2: rows_bf16<2>(xs, x_stride, wp, K, ys, y_stride, m0, m_end, lanes); break;
                default: rows_bf16<1>(xs, x_stride, wp, K, ys, y_stride, m0, m_end, lanes); break;
            }
        }
    return 0;
}
#endif

int gemm_rows(const void *W, const void *x, void *y, int64_t M, int64_t N, int64_t K, int64_t x_stride,
              int64_t y_stride, int bf16, int nt) {
    if (K < 1) return -1;
    /* Small products (under ~1M multiply-adds and a weight under 64K elements: a few microseconds) on one thread: a
       parallel region costs more there. (Few rows stream the weight: worth the threads from 64K elements.) */
    const int par = M * N * K >= (1 << 20) || N * K >= (1 << 16);
#if defined(HAVE_GR_AVX512) || defined(HAVE_GR_AVX2)
    /* Work items: (slab of x rows, group of output channels), each sweeping its slab in tiles over its group's
       weights; slabs of equal size, so that the threads' shares are. How the work is cut changes no sum. */
    const int64_t slabs = (M + 47) / 48, slab = (M + slabs - 1) / slabs;  /* <= 48 rows each, as even as can be */
    if (bf16) return gemm_rows_bf16(W, x, y, M, N, K, x_stride, y_stride, slabs, slab, nt, par);
    const int64_t blocks = (N + GR_BLOCK - 1) / GR_BLOCK;
    #pragma omp parallel for schedule(static) collapse(2) num_threads(nt) if(par)
    for (int64_t s = 0; s < slabs; s++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n0 = b * GR_BLOCK, nr = N - n0 < GR_BLOCK ? N - n0 : GR_BLOCK;
            const int64_t m_end = (s + 1) * slab < M ? (s + 1) * slab : M;
            rows_f32((const float *)W, (const float *)x, (float *)y, s * slab, m_end, n0, nr, K, x_stride, y_stride);
        }
    return 0;
#else
    #pragma omp parallel for schedule(static) collapse(2) num_threads(nt) if(par)
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            if (bf16)
                ((uint16_t *)y)[m * y_stride + n] =
                    f32_to_bf16(dot_portable_bf16((const uint16_t *)W, (const uint16_t *)x + m * x_stride, n, K));
            else
                ((float *)y)[m * y_stride + n] = dot_portable_f32((const float *)W + n * K, (const float *)x +
                                                                  m * x_stride, K);
        }
    return 0;
#endif
}
