// Add + RMSNorm, rotary with the q/k/v split, SiLU·mul: aserve/kernels/cpu.py describes them.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <math.h>

static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float rnd(float f, int bf16) {  /* round to the model dtype and back */
    return bf16 ? bf16_to_f32(f32_to_bf16(f)) : f;
}

static inline void st(void *p, int64_t i, float f, int bf16) {  /* f already rounded when bf16 (exact) */
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(f);
    else ((float *)p)[i] = f;
}

#define PAR_ROWS(rows) _Pragma("omp parallel for num_threads(nt) if(rows > 1)")

/* Per-row bodies take `bf16` as a compile-time constant: the exported functions branch once per row, inside their
   OpenMP loop (an outlined parallel region would otherwise receive it as a variable), so the per-element dtype
   branch folds away and the loops vectorise. */
#define INLINE static inline __attribute__((always_inline))

INLINE void add_rms_norm_row(const void *x, const void *res, const void *w, void *out, void *res_out, int64_t r,
                             int64_t n, float eps, int has_res, const int bf16) {
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int64_t i = 0; i < n; i++) {
        float h = ld(x, r * n + i, bf16);
        if (has_res) {
            h = rnd(h + ld(res, r * n + i, bf16), bf16);
            st(res_out, r * n + i, h, bf16);
        }
        ss += h * h;
    }
    const float rstd = 1.0f / sqrtf(ss / (float)n + eps);
    const void *src = has_res ? res_out : x;
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        float y = rnd(ld(src, r * n + i, bf16) * rstd, bf16);
        st(out, r * n + i, rnd(y * ld(w, i, bf16), bf16), bf16);
    }
}

INLINE void rotary_split_row(const void *qkv, const void *cos_, const void *sin_, void *q, void *k, void *v, int64_t t,
                             int64_t H, int64_t Hkv, int64_t D, int64_t stride_qkv, int64_t stride_cs, const int bf16) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < H + Hkv; h++) {
        void *dst = h < H ? q : k;
        const int64_t dst_row = h < H ? (t * H + h) * D : (t * Hkv + h - H) * D;
        const int64_t src_row = t * stride_qkv + h * D;
        #pragma omp simd
        for (int64_t j = 0; j < half; j++) {
            const float x1 = ld(qkv, src_row + j, bf16), x2 = ld(qkv, src_row + half + j, bf16);
            const float c = ld(cos_, t * stride_cs + j, bf16), s = ld(sin_, t * stride_cs + j, bf16);
            st(dst, dst_row + j, rnd(rnd(x1 * c, bf16) + rnd(-x2 * s, bf16), bf16), bf16);
            st(dst, dst_row + half + j, rnd(rnd(x2 * c, bf16) + rnd(x1 * s, bf16), bf16), bf16);
        }
    }
    const int64_t vsrc = t * stride_qkv + (H + Hkv) * D;
    #pragma omp simd
    for (int64_t i = 0; i < Hkv * D; i++) st(v, t * Hkv * D + i, ld(qkv, vsrc + i, bf16), bf16);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_AVX512_BF16 1

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 round_bf16x16(__m512 x) {  /* to bf16 (nearest even) and back */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* bf16 rows, n % 16 == 0: exp(-g) = 2**(-g log2 e) (exp2_16). */
static void silu_mul_row_bf16_avx512(const uint16_t *gate_up, uint16_t *out, int64_t r, int64_t n) {
    const uint16_t *g_row = gate_up + r * 2 * n, *u_row = g_row + n;
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 g = load_bf16x16(g_row + i), u = load_bf16x16(u_row + i);
        const __m512 e = exp2_16(_mm512_mul_ps(g, _mm512_set1_ps(-1.4426950408889634f)));
        const __m512 silu = round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        _mm256_storeu_si256((__m256i *)(out + r * n + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, u)));
    }
}
#endif

INLINE void silu_mul_row(const void *gate_up, void *out, int64_t r, int64_t n, const int bf16) {
    for (int64_t i = 0; i < n; i++) {
        const float g = ld(gate_up, r * 2 * n + i, bf16), u = ld(gate_up, r * 2 * n + n + i, bf16);
        st(out, r * n + i, rnd(rnd(g / (1.0f + expf(-g)), bf16) * u, bf16), bf16);
    }
}

/* gate_up [rows, 2n] -> silu(gate) * up [rows, n], rounded as HF's eager code (silu rounded to the dtype, then the
   product). */
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int bf16, int nt) {
    PAR_ROWS(rows)
    for (int64_t r = 0; r < rows; r++) {
#ifdef HAVE_AVX512_BF16
        if (bf16 && n % 16 == 0) {
            silu_mul_row_bf16_avx512((const uint16_t *)gate_up, (uint16_t *)out, r, n);
            continue;
        }
#endif
        if (bf16) silu_mul_row(gate_up, out, r, n, 1);
        else silu_mul_row(gate_up, out, r, n, 0);
    }
}

void add_rms_norm(const void *x, const void *res, const void *w, void *out, void *res_out, int64_t rows, int64_t n,
                  float eps, int has_res, int bf16, int nt) {
    PAR_ROWS(rows)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) add_rms_norm_row(x, res, w, out, res_out, r, n, eps, has_res, 1);
        else add_rms_norm_row(x, res, w, out, res_out, r, n, eps, has_res, 0);
    }
}

/* qkv [T, (H + 2 Hkv) D] rows, cos / sin [T, D] (model dtype) -> q [T, H, D], k, v [T, Hkv, D]. */
void rotary_split(const void *qkv, const void *cos_, const void *sin_, void *q, void *k, void *v, int64_t rows,
                  int64_t H, int64_t Hkv, int64_t D, int64_t stride_qkv, int64_t stride_cs, int bf16, int nt) {
    PAR_ROWS(rows)
    for (int64_t t = 0; t < rows; t++) {
        if (bf16) rotary_split_row(qkv, cos_, sin_, q, k, v, t, H, Hkv, D, stride_qkv, stride_cs, 1);
        else rotary_split_row(qkv, cos_, sin_, q, k, v, t, H, Hkv, D, stride_qkv, stride_cs, 0);
    }
}
