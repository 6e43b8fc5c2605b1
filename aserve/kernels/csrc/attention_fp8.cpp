// Decode attention over an FP8 (float8_e4m3fn) paged KV cache, and the write of one token's K/V into it:
// aserve/kernels/cpu.py describes them.
#include "attention_common.h"
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <math.h>
#include <stdlib.h>

/* e4m3 -> float32, exactly: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2**-9);
   0x7F and 0xFF are NaN (e4m3fn has no infinity). */
static float fp8_e4m3_to_f32(uint8_t b) {
    const int e = (b >> 3) & 0xF, m = b & 7;
    const float x = (b & 0x7F) == 0x7F ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
    return b & 0x80 ? -x : x;
}

/* Every e4m3 byte's value, built once (thread-safe: a function-local static). */
struct fp8_table {
    float v[256];
    fp8_table() {
        for (int i = 0; i < 256; i++) v[i] = fp8_e4m3_to_f32((uint8_t)i);
    }
};

static const float *fp8_values(void) {
    static const fp8_table table;
    return table.v;
}

/* float32 -> e4m3 as torch's cast (c10's fp8e4m3fn_from_fp32_value): round to nearest even, subnormals by adding
   and removing 2**14 (whose float32 ulp is e4m3's subnormal step, 2**-9), 480 and beyond (and NaN) -> NaN. */
static inline uint8_t f32_to_fp8_e4m3(float f) {
    const uint32_t denorm = 141u << 23;  /* 2**14 */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u >= 1087u << 20) {  /* 480 */
        r = 0x7F;
    } else if (u < 121u << 23) {  /* below 2**-6: subnormal */
        float a, d;
        memcpy(&a, &u, 4);
        memcpy(&d, &denorm, 4);
        a += d;
        memcpy(&u, &a, 4);
        r = (uint8_t)(u - denorm);
    } else {
        u += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1u);
        r = (uint8_t)(u >> 20);
    }
    return r | (uint8_t)(sign >> 24);
}

void fp8_write_kv(const void *k, const void *v, void *k_out, void *v_out, int64_t n, float k_scale, float v_scale,
                  int is_bf16) {
    for (int i = 0; i < 2; i++) {
        const void *x = i ? v : k;
        uint8_t *o = (uint8_t *)(i ? v_out : k_out);
        const float scale = i ? v_scale : k_scale;
        for (int64_t j = 0; j < n; j++) {
            float y = (is_bf16 ? bf16_to_f32(((const uint16_t *)x)[j]) : ((const float *)x)[j]) / scale;
            y = y < -448.0f ? -448.0f : y > 448.0f ? 448.0f : y;  /* NaN stays NaN */
            o[j] = f32_to_fp8_e4m3(y);
        }
    }
}

/* One (request, KV head) work item in attention_common.h's portable loops, each K/V row widened through the table
   `lut`. qk_scale: the softmax scale times k_scale (and log2(e): scores in log2 units); out_scale: v_scale. */
static inline __attribute__((always_inline)) void attend_item_fp8(
        const void *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *block_tables,
        const int32_t *seq_lens, void *out, int64_t item, int64_t num_kv_heads, int64_t G, const int64_t D,
        int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, float qk_scale, float out_scale,
        int is_bf16, int64_t window, float cap, const float *lut) {
    attend_item_rows(q, k_cache, v_cache, block_tables, seq_lens, out, item, num_kv_heads, G, D, block_size, bt_stride,
                     q_stride, out_stride, qk_scale, 1.0f, out_scale, is_bf16, window, cap,
                     [=](const uint8_t *cache, int64_t base, float *kv) {
                         const uint8_t *p = cache + base;
                         for (int64_t d = 0; d < D; d++) kv[d] = lut[p[d]];
                     });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512_FP8 1
#define FP8_FAST_MAX_G 8

/* 16 e4m3 bytes -> 16 floats, each 2**-8 times the byte's value: a byte sign-extended to 16 bits and shifted left by
   7 holds e4m3's sign, exponent and mantissa where a float16 has them (bit 14, a copy of the sign, cleared), and
   float16's exponent bias is e4m3's + 8; vcvtph2ps widens that exactly, subnormals included. NaN stays NaN. */
static inline __attribute__((always_inline)) __m512 fp8x16_to_f32_scaled(const uint8_t *p) {
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16((short)0xBF80));
    const __m256i low7 = _mm256_set1_epi16(0x7F);
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(x, low7), low7);
    return _mm512_cvtph_ps(_mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(0x7E00)));
}

/* Prefetch `bytes` of one head's rows of up to 16 tokens (from position t of a request; bt its block-table row) into
   L1, if t < len. */
static inline __attribute__((always_inline)) void prefetch_fp8(const uint8_t *cache, const int32_t *bt, int64_t t,
                                                                int64_t len, int64_t block_size, int64_t row,
                                                                int64_t head_off, int64_t bytes) {
    if (t >= len) return;
    const int64_t blk = bt[t / block_size], first = t % block_size;
    const int64_t last = first + 16 < block_size ? first + 16 : block_size;
    for (int64_t j = first; j < last; j++) {
        const char *p = (const char *)(cache + (blk * block_size + j) * row + head_off);
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
}

/* One work item with AVX-512 (D = 16 C, G <= FP8_FAST_MAX_G, block_size % 16 == 0), float32 arithmetic throughout:
   pass 1 widens 16 tokens' K rows into kf, then each query head's 16 dot products (FMA, one transpose-and-add tree);
   pass 3 walks the tokens once per 64 dimensions (one cache line of a row), weights times widened V rows into G x 4
   accumulators. The conversion's 2**-8 is folded into the scales: qk_scale * 256 into the query, out_scale * 256
   into the output. Always inlined at call sites with constant G and C. */
static inline __attribute__((always_inline)) void attend_item_fp8_avx512(
        const void *q, const uint8_t *k_cache, const uint8_t *v_cache, const int32_t *block_tables,
        const int32_t *seq_lens, void *out, int64_t item, int64_t num_kv_heads, const int64_t G, const int64_t C,
        int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, float qk_scale, float out_scale,
        int is_bf16, int64_t window, float cap) {
    const int64_t D = 16 * C;
    const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
    const window_span span = span_of(block_tables + s * bt_stride, seq_lens[s], window, block_size);
    const int64_t len = span.len, skip = span.skip, row = num_kv_heads * D;
    const int32_t *bt = span.bt;
    const __m512 qs = _mm512_set1_ps(qk_scale * 256.0f);
    __m512 qv[FP8_FAST_MAX_G][MAX_D / 16];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < C; c++) {
            const int64_t off = s * q_stride + (h * G + g) * D + 16 * c;
            const __m512 x = is_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                           _mm256_loadu_si256((const __m256i *)((const uint16_t *)q + off))), 16))
                                     : _mm512_loadu_ps((const float *)q + off);
            qv[g][c] = _mm512_mul_ps(x, qs);
        }
    const int64_t padded = len > 0 ? (len + 15) / 16 * 16 : 16;
    float *scores = (float *)aligned_alloc(64, sizeof(float) * padded * G);  /* [G][padded] */
    float kf[16][MAX_D] __attribute__((aligned(64)));
    /* pass 1 (the next 16 tokens' K rows are prefetched) */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t blk = bt[t0 / block_size];
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        prefetch_fp8(k_cache, bt, t0 + 32, len, block_size, row, h * D, D);
        if (t0 == 0) prefetch_fp8(k_cache, bt, 16, len, block_size, row, h * D, D);
        const uint8_t *kb = k_cache + (blk * block_size + t0 % block_size) * row + h * D;
        for (int64_t j = 0; j < 16; j++) {
            const uint8_t *kp = kb + (j < n ? j : 0) * row;  /* past the end: a row of this block again, masked */
            for (int64_t c = 0; c < C; c++) _mm512_store_ps(kf[j] + 16 * c, fp8x16_to_f32_scaled(kp + 16 * c));
        }
        for (int64_t g = 0; g < G; g++) {
            __m512 v[16];
            for (int64_t j = 0; j < 16; j++) {
                __m512 a = _mm512_mul_ps(qv[g][0], _mm512_load_ps(kf[j]));
                for (int64_t c = 1; c < C; c++) a = _mm512_fmadd_ps(qv[g][c], _mm512_load_ps(kf[j] + 16 * c), a);
                v[j] = a;
            }
            _mm512_store_ps(scores + g * padded + t0, hsum16(v));
        }
    }
    /* pass 2: scores -> softmax weights in place (zero outside skip .. len); the first V rows are fetched meanwhile */
    prefetch_fp8(v_cache, bt, 0, len, block_size, row, h * D, D < 64 ? D : 64);
    prefetch_fp8(v_cache, bt, 16, len, block_size, row, h * D, D < 64 ? D : 64);
    float l[FP8_FAST_MAX_G];
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * padded;
        softcap_scores(sg, skip, len, cap);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t t0 = skip / 16 * 16; t0 < len; t0 += 16)
            mx = _mm512_max_ps(mx, _mm512_mask_load_ps(mx, lanes_between(t0, skip, len), sg + t0));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < padded; t0 += 16) {
            const __m512 p = _mm512_maskz_mov_ps(lanes_between(t0, skip, len),
                                                 exp2_16(_mm512_sub_ps(_mm512_load_ps(sg + t0), m)));
            sum = _mm512_add_ps(sum, p);
            _mm512_store_ps(sg + t0, p);
        }
        l[g] = _mm512_reduce_add_ps(sum);
    }
    /* pass 3, 64 dimensions (4 vectors, one cache line of a row) at a time */
    for (int64_t c0 = 0; c0 < C; c0 += 4) {
        const int64_t cn = C - c0 < 4 ? C - c0 : 4, off = h * D + 16 * c0;
        __m512 acc[FP8_FAST_MAX_G][4];
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < cn; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {  /* block by block: no division per token */
            const int64_t blk = bt[t0 / block_size];
            prefetch_fp8(v_cache, bt, t0 + 2 * block_size, len, block_size, row, off, 16 * cn);
            if (t0 == 0) prefetch_fp8(v_cache, bt, block_size, len, block_size, row, off, 16 * cn);
            const uint8_t *vb = v_cache + blk * block_size * row + off;
            const int64_t t_end = t0 + block_size < len ? t0 + block_size : len;
            for (int64_t t = t0; t < t_end; t++) {
                const uint8_t *vp = vb + (t - t0) * row;
                __m512 vf[4];
                for (int64_t c = 0; c < cn; c++) vf[c] = fp8x16_to_f32_scaled(vp + 16 * c);
                for (int64_t g = 0; g < G; g++) {
                    const __m512 w = _mm512_set1_ps(scores[g * padded + t]);
                    for (int64_t c = 0; c < cn; c++) acc[g][c] = _mm512_fmadd_ps(w, vf[c], acc[g][c]);
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const __m512 inv = _mm512_set1_ps(l[g] > 0.0f ? out_scale * 256.0f / l[g] : 0.0f);
            const int64_t o = s * out_stride + (h * G + g) * D + 16 * c0;
            for (int64_t c = 0; c < cn; c++) {
                const __m512 x = _mm512_mul_ps(acc[g][c], inv);
                if (is_bf16) {  /* round to nearest even, as f32_to_bf16 */
                    const __m512i u = _mm512_castps_si512(x);
                    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                        _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + o + 16 * c),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
                } else {
                    _mm512_storeu_ps((float *)out + o + 16 * c, x);
                }
            }
        }
    }
    free(scores);
}

/* All work items with constant G and C (GG, CC), or with runtime ones (GG, CC = G, C). */
#define FP8_FAST_ITEMS(GG, CC)                                                                                     \
    _Pragma("omp parallel for schedule(dynamic, chunk) num_threads(num_threads)")                                  \
    for (int64_t item = 0; item < items; item++)                                                                  \
        attend_item_fp8_avx512(q, (const uint8_t *)k_cache, (const uint8_t *)v_cache, block_tables, seq_lens, out, \
                               item, num_kv_heads, GG, CC, block_size, bt_stride, q_stride, out_stride, qk_scale,  \
                               v_scale, is_bf16, window, cap);
#endif

/* paged_decode_attention (attention.cpp) over e4m3 caches: K read as k_scale * e4m3 value, V as v_scale * e4m3
   value; q and out float32 or bfloat16 (is_bf16). */
int paged_decode_attention_fp8(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                               const int32_t *seq_lens, void *out, int64_t num_seqs, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t bt_stride,
                               int64_t q_stride, int64_t out_stride, float scale, float k_scale, float v_scale,
                               int is_bf16, int num_threads, int force_generic, int64_t window, float softcap) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    const float cap = softcap * 1.4426950408889634f;  /* scores are kept in log2 units */
    const float qk_scale = scale * k_scale * 1.4426950408889634f;
    if (D > MAX_D || G > MAX_G) return -1;
    const int64_t items = num_seqs * num_kv_heads, chunk = heads_chunk(num_seqs, num_kv_heads, num_threads);
#ifdef HAVE_AVX512_FP8
    if (D % 16 == 0 && G <= FP8_FAST_MAX_G && block_size % 16 == 0 && !force_generic) {
        const int64_t C = D / 16;
        /* the common head shapes get their own copy of the loops (D 64 or 128, up to 8 query heads per KV head) */
        if (C == 4) {
            switch (G) {
                case 1: FP8_FAST_ITEMS(1, 4) return 0;
                case 2: FP8_FAST_ITEMS(2, 4) return 0;
                case 3: FP8_FAST_ITEMS(3, 4) return 0;
                case 4: FP8_FAST_ITEMS(4, 4) return 0;
                case 8: FP8_FAST_ITEMS(8, 4) return 0;
            }
        } else if (C == 8) {
            switch (G) {
                case 1: FP8_FAST_ITEMS(1, 8) return 0;
                case 2: FP8_FAST_ITEMS(2, 8) return 0;
                case 4: FP8_FAST_ITEMS(4, 8) return 0;
                case 8: FP8_FAST_ITEMS(8, 8) return 0;
            }
        }
        FP8_FAST_ITEMS(G, C)
        return 0;
    }
#endif
    const float *lut = fp8_values();
    const uint8_t *kc = (const uint8_t *)k_cache, *vc = (const uint8_t *)v_cache;
    #pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        if (D == 64)
            attend_item_fp8(q, kc, vc, block_tables, seq_lens, out, item, num_kv_heads, G, 64, block_size, bt_stride,
                            q_stride, out_stride, qk_scale, v_scale, is_bf16, window, cap, lut);
        else if (D == 128)
            attend_item_fp8(q, kc, vc, block_tables, seq_lens, out, item, num_kv_heads, G, 128, block_size,
                            bt_stride, q_stride, out_stride, qk_scale, v_scale, is_bf16, window, cap, lut);
        else
            attend_item_fp8(q, kc, vc, block_tables, seq_lens, out, item, num_kv_heads, G, D, block_size, bt_stride,
                            q_stride, out_stride, qk_scale, v_scale, is_bf16, window, cap, lut);
    }
    return 0;
}
