// Decode attention over a float32 / bfloat16 paged KV cache (attention_fp8.cpp: an FP8 one): aserve/kernels/cpu.py
// describes it.
#include "attention_common.h"
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <stdlib.h>
#include <math.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#define FAST_MAX_G 8

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Whether AMX tiles may be used: Linux hands a process the tile state on request (oneDNN, in the same process,
   asks too); ASERVE_CPU_AMX=0 says no. Called outside parallel regions. */
static int amx_ready(void) {
    static int state = -1;
    if (state < 0) {
        const char *env = getenv("ASERVE_CPU_AMX");
        state = !(env && env[0] == '0') && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                                   18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return state;
}
#endif

/* Prefetch the rows of up to 16 tokens (from `first` in block `blk`; a whole block when block_size is 16) of one
   head into L1. */
static inline __attribute__((always_inline)) void prefetch_rows(const uint16_t *cache, int64_t blk, int64_t first,
                                                                 int64_t block_size, int64_t row, int64_t head_off,
                                                                 int64_t D) {
    const int64_t last = first + 16 < block_size ? first + 16 : block_size;
    for (int64_t j = first; j < last; j++) {
        const char *p = (const char *)(cache + (blk * block_size + j) * row + head_off);
        for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
    }
}

/* prefetch_rows for the tokens from position t of a request (bt: its block-table row), if t < len. Always inlined
   like prefetch_rows: see the module docstring. */
static inline __attribute__((always_inline)) void prefetch_from(const uint16_t *cache, const int32_t *bt, int64_t t,
                                                                 int64_t len, int64_t block_size, int64_t row,
                                                                 int64_t head_off, int64_t D) {
    if (t < len) prefetch_rows(cache, bt[t / block_size], t % block_size, block_size, row, head_off, D);
}

/* bf16 work item with AVX512-BF16: q . k as bf16 pair dot products (vdpbf16ps) 16 tokens at a time, P @ V with
   two tokens' V rows interleaved so one vdpbf16ps adds both (P rounded to bf16, as flash attention kernels do).
   D = 32 C, G <= FAST_MAX_G, block_size % 16 == 0. Always inlined at call sites with constant G and C, so the
   query, the accumulators and the per-token loops live in registers. */
static inline __attribute__((always_inline)) void attend_item_bf16_avx512(
        const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_tables,
        const int32_t *seq_lens, uint16_t *out, int64_t item, int64_t num_kv_heads, const int64_t G, const int64_t C,
        int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, float scale, int amx,
        int64_t window, float cap) {
    const int64_t D = 32 * C;
    const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
    const window_span span = span_of(block_tables + s * bt_stride, seq_lens[s], window, block_size);
    const int64_t len = span.len, skip = span.skip, row = num_kv_heads * D;
    const int32_t *bt = span.bt;  /* this request's block-table row (from the window's first block) */
    const __m512 sl = _mm512_set1_ps(scale * 1.4426950408889634f);
    __m512bh qv[FAST_MAX_G][MAX_D / 32];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < C; c++)
            qv[g][c] = (__m512bh)_mm512_loadu_si512(q + s * q_stride + (h * G + g) * D + 32 * c);
    /* + 16: pass 3 reads one weight past an odd end (AMX: up to the next multiple of 32), zero there */
    const int64_t padded = (len + 15) / 16 * 16 + 16;
    float *scores = (float *)aligned_alloc(64, sizeof(float) * padded * G);  /* [G][padded] */
    uint16_t *pb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * padded * G);  /* softmax weights in bf16 */
#ifdef HAVE_AMX
    if (amx) {
        /* pass 1 on AMX tiles: scores[16 tokens][G] = K rows (a tile of 16 rows x 32 dims, read in place with the
           cache's row stride) . Q^T (tiles of Q in pair-interleaved layout, loaded once), 32 dims per tile
           multiply; then each query head's column of the 16 x 16 result gathered into a row of `scores`.
           Rows past the request's end (inside the same block) give scores that pass 2 masks out. */
        uint32_t qt[MAX_D / 32][16][16] __attribute__((aligned(64)));
        float cbuf[16 * 16] __attribute__((aligned(64)));
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        cfg.rows[0] = 16, cfg.colsb[0] = G * 4;    /* tmm0: scores [16 tokens][G] float32 */
        cfg.rows[1] = 16, cfg.colsb[1] = 64;       /* tmm1: K [16 tokens][32 dims] bf16 */
        for (int64_t c = 0; c < C; c++) {         /* tmm2 + c: Q^T [16 dim pairs][G] bf16 pairs */
            cfg.rows[2 + c] = 16, cfg.colsb[2 + c] = G * 4;
            for (int64_t k = 0; k < 16; k++)
                for (int64_t g = 0; g < G; g++)
                    memcpy(&qt[c][k][g], q + s * q_stride + (h * G + g) * D + 32 * c + 2 * k, 4);
        }
        _tile_loadconfig(&cfg);
        _tile_loadd(2, qt[0], 64);
        if (C > 1) _tile_loadd(3, qt[1], 64);
        if (C > 2) _tile_loadd(4, qt[2], 64);
        if (C > 3) _tile_loadd(5, qt[3], 64);
        const __m512i col = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
            const int64_t blk = bt[t0 / block_size];
            prefetch_from(k_cache, bt, t0 + 32, len, block_size, row, h * D, D);
            if (t0 == 0) prefetch_from(k_cache, bt, 16, len, block_size, row, h * D, D);
            const uint16_t *kb = k_cache + (blk * block_size + t0 % block_size) * row + h * D;
            _tile_zero(0);
            _tile_loadd(1, kb, row * 2);
            _tile_dpbf16ps(0, 1, 2);
            if (C > 1) { _tile_loadd(1, kb + 32, row * 2); _tile_dpbf16ps(0, 1, 3); }
            if (C > 2) { _tile_loadd(1, kb + 64, row * 2); _tile_dpbf16ps(0, 1, 4); }
            if (C > 3) { _tile_loadd(1, kb + 96, row * 2); _tile_dpbf16ps(0, 1, 5); }
            _tile_stored(0, cbuf, 64);
            for (int64_t g = 0; g < G; g++)
                _mm512_store_ps(scores + g * padded + t0, _mm512_mul_ps(
                    _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32((int)g)), cbuf, 4), sl));
        }
        _tile_release();
    } else
#endif
    /* pass 1 (the next 16 tokens' K rows are prefetched: the loads, not the arithmetic, bound this loop) */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t blk = bt[t0 / block_size];
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        prefetch_from(k_cache, bt, t0 + 32, len, block_size, row, h * D, D);
        if (t0 == 0) prefetch_from(k_cache, bt, 16, len, block_size, row, h * D, D);
        const uint16_t *kb = k_cache + (blk * block_size + t0 % block_size) * row + h * D;
        for (int64_t g = 0; g < G; g++) {
            __m512 v[16];
            for (int64_t j = 0; j < 16; j++) {
                const uint16_t *kp = kb + (j < n ? j : 0) * row;
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < C; c++)
                    a = _mm512_dpbf16_ps(a, qv[g][c], (__m512bh)_mm512_loadu_si512(kp + 32 * c));
                v[j] = a;
            }
            _mm512_store_ps(scores + g * padded + t0, _mm512_mul_ps(hsum16(v), sl));
        }
    }
    /* pass 2: scores -> softmax weights: l sums them unrounded, pass 3 takes them rounded to bf16 (zero past
       the end). The first V rows are fetched meanwhile. */
    prefetch_from(v_cache, bt, 0, len, block_size, row, h * D, D);
    prefetch_from(v_cache, bt, 16, len, block_size, row, h * D, D);
    float l[FAST_MAX_G];
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * padded;
        softcap_scores(sg, skip, len, cap);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t t0 = skip / 16 * 16; t0 < len; t0 += 16) {
            __mmask16 mk = lanes_between(t0, skip, len);
            mx = _mm512_max_ps(mx, _mm512_mask_load_ps(_mm512_set1_ps(-INFINITY), mk, sg + t0));
        }
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < padded; t0 += 16) {
            __mmask16 mk = lanes_between(t0, skip, len);
            __m512 p = _mm512_maskz_mov_ps(mk, exp2_16(_mm512_sub_ps(_mm512_load_ps(sg + t0), m)));
            sum = _mm512_add_ps(sum, p);
            _mm256_store_si256((__m256i *)(pb + g * padded + t0), (__m256i)_mm512_cvtneps_pbh(p));
        }
        l[g] = _mm512_reduce_add_ps(sum);
    }
    free(scores);
    /* pass 3: acc[g][c] lanes hold d = 32c + 8L + e (lo) and 32c + 8L + 4 + e (hi), L the 128-bit lane, e < 4 */
    __m512 acc_lo[FAST_MAX_G][MAX_D / 32], acc_hi[FAST_MAX_G][MAX_D / 32];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < C; c++) acc_lo[g][c] = acc_hi[g][c] = _mm512_setzero_ps();
#ifdef HAVE_AMX
    if (amx && C <= 2) {
        /* P @ V on AMX tiles, 32 tokens at a time: A = P [G][32 tokens] bf16 (rows of pb), B = the V rows of 16
           token pairs interleaved as pass 3 below interleaves them (same lane order), one B tile per (c, lo/hi),
           accumulating in tiles tmm3.. (G rows x 16 lanes each). */
        uint32_t vb[2][2][16][16] __attribute__((aligned(64)));
        float ab[2][2][FAST_MAX_G][16] __attribute__((aligned(64)));
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette_id = 1;
        cfg.rows[1] = G, cfg.colsb[1] = 64;        /* tmm1: P [G][32 tokens] */
        cfg.rows[2] = 16, cfg.colsb[2] = 64;       /* tmm2: V pairs [16][16 lanes] */
        for (int64_t i = 0; i < 2 * C; i++) cfg.rows[3 + i] = G, cfg.colsb[3 + i] = 64;
        _tile_loadconfig(&cfg);
        _tile_zero(3);
        _tile_zero(4);
        if (C > 1) { _tile_zero(5); _tile_zero(6); }
        for (int64_t t0 = 0; t0 < len; t0 += 32) {
            for (int64_t tt = t0 == 0 ? 32 : t0 + 64; tt < t0 + 96; tt += 16)  /* 64 tokens ahead */
                prefetch_from(v_cache, bt, tt, len, block_size, row, h * D, D);
            for (int64_t p = 0; p < 16; p++) {
                const int64_t ta = t0 + 2 * p < len ? t0 + 2 * p : len - 1;
                const int64_t tb = t0 + 2 * p + 1 < len ? t0 + 2 * p + 1 : len - 1;  /* past the end: weight 0 */
                const uint16_t *v0 = v_cache + (bt[ta / block_size] * block_size + ta % block_size) * row + h * D;
                const uint16_t *v1 = v_cache + (bt[tb / block_size] * block_size + tb % block_size) * row + h * D;
                for (int64_t c = 0; c < C; c++) {
                    __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
                    _mm512_store_si512(vb[c][0][p], _mm512_unpacklo_epi16(a, b));
                    _mm512_store_si512(vb[c][1][p], _mm512_unpackhi_epi16(a, b));
                }
            }
            _tile_loadd(1, pb + t0, padded * 2);
            _tile_loadd(2, vb[0][0], 64); _tile_dpbf16ps(3, 1, 2);
            _tile_loadd(2, vb[0][1], 64); _tile_dpbf16ps(4, 1, 2);
            if (C > 1) {
                _tile_loadd(2, vb[1][0], 64); _tile_dpbf16ps(5, 1, 2);
                _tile_loadd(2, vb[1][1], 64); _tile_dpbf16ps(6, 1, 2);
            }
        }
        _tile_stored(3, ab[0][0], 64);
        _tile_stored(4, ab[0][1], 64);
        if (C > 1) { _tile_stored(5, ab[1][0], 64); _tile_stored(6, ab[1][1], 64); }
        _tile_release();
        for (int64_t g = 0; g < G; g++)
            for (int64_t c = 0; c < C; c++)
                acc_lo[g][c] = _mm512_load_ps(ab[c][0][g]), acc_hi[g][c] = _mm512_load_ps(ab[c][1][g]);
    } else
#endif
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {  /* block by block: no division per token */
      const int64_t blk = bt[t0 / block_size];
      prefetch_from(v_cache, bt, t0 + 2 * block_size, len, block_size, row, h * D, D);
      if (t0 == 0) prefetch_from(v_cache, bt, block_size, len, block_size, row, h * D, D);
      const uint16_t *vb = v_cache + blk * block_size * row + h * D;
      const int64_t t_end = t0 + block_size < len ? t0 + block_size : len;
      for (int64_t t = t0; t < t_end; t += 2) {
        /* an odd tail pairs the last token with itself, weight 0 */
        const uint16_t *v0 = vb + (t - t0) * row, *v1 = t + 1 < t_end ? v0 + row : v0;
        __m512bh pp[FAST_MAX_G];
        for (int64_t g = 0; g < G; g++) {
            int32_t pair;
            memcpy(&pair, pb + g * padded + t, 4);
            pp[g] = (__m512bh)_mm512_set1_epi32(pair);
        }
        for (int64_t c = 0; c < C; c++) {
            __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
            __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int64_t g = 0; g < G; g++) {
                acc_lo[g][c] = _mm512_dpbf16_ps(acc_lo[g][c], lo, pp[g]);
                acc_hi[g][c] = _mm512_dpbf16_ps(acc_hi[g][c], hi, pp[g]);
            }
        }
      }
    }
    free(pb);
    for (int64_t g = 0; g < G; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        uint16_t *o = out + s * out_stride + (h * G + g) * D;
        for (int64_t c = 0; c < C; c++) {
            float lo[16], hi[16];
            _mm512_storeu_ps(lo, acc_lo[g][c]);
            _mm512_storeu_ps(hi, acc_hi[g][c]);
            for (int L = 0; L < 4; L++)
                for (int e = 0; e < 4; e++) {
                    o[32 * c + 8 * L + e] = f32_to_bf16(lo[4 * L + e] * inv);
                    o[32 * c + 8 * L + 4 + e] = f32_to_bf16(hi[4 * L + e] * inv);
                }
        }
    }
}

/* All work items with constant G and C (GG, CC), or with runtime ones (GG, CC = G, C). */
#define FAST_ITEMS(GG, CC)                                                                                         \
    _Pragma("omp parallel for schedule(dynamic, chunk) num_threads(num_threads)")                                  \
    for (int64_t item = 0; item < items; item++)                                                                  \
        attend_item_bf16_avx512((const uint16_t *)q, (const uint16_t *)k_cache, (const uint16_t *)v_cache,         \
                                block_tables, seq_lens, (uint16_t *)out, item, num_kv_heads, GG, CC, block_size,   \
                                bt_stride, q_stride, out_stride, scale, amx, window, cap);
#endif

/* One head's row of one token as float32. */
static inline __attribute__((always_inline)) void load_row(const void *cache, int64_t base, int is_bf16,
                                                           const int64_t D, float *kv) {
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)cache + base;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) kv[d] = bf16_to_f32(p[d]);
    } else {
        const float *p = (const float *)cache + base;
        #pragma omp simd
        for (int64_t d = 0; d < D; d++) kv[d] = p[d];
    }
}

/* One (request, KV head) work item over a float32 / bfloat16 cache (attention_common.h's portable loops). */
static inline __attribute__((always_inline)) void attend_item(
        const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
        const int32_t *seq_lens, void *out, int64_t item, int64_t num_kv_heads, int64_t G, const int64_t D,
        int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, float scale, int is_bf16,
        int64_t window, float cap) {
    attend_item_rows(q, k_cache, v_cache, block_tables, seq_lens, out, item, num_kv_heads, G, D, block_size, bt_stride,
                     q_stride, out_stride, scale, 1.4426950408889634f, 1.0f, is_bf16, window, cap,
                     [=](const void *cache, int64_t base, float *kv) { load_row(cache, base, is_bf16, D, kv); });
}

/* q [num_seqs, H, D] (token stride q_stride), out likewise (out_stride); caches [num_blocks, block_size, Hkv, D]
   contiguous; block_tables [num_seqs, bt_stride] int32; seq_lens [num_seqs] int32. is_bf16: 1 bfloat16, 0 float32.
   window: the query sees the `window` most recent keys (0: all); softcap: scaled scores s -> softcap *
   tanh(s / softcap) (0: none). Returns 0, or -1 for shapes it does not take (D > MAX_D, G > MAX_G). */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                           const int32_t *seq_lens, void *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t bt_stride,
                           int64_t q_stride, int64_t out_stride, float scale, int is_bf16, int num_threads,
                           int force_generic, int64_t window, float softcap) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    const float cap = softcap * 1.4426950408889634f;  /* scores are kept in log2 units */
    if (D > MAX_D || G > MAX_G) return -1;
    const int64_t items = num_seqs * num_kv_heads, chunk = heads_chunk(num_seqs, num_kv_heads, num_threads);
#ifdef HAVE_AVX512_BF16
    if (is_bf16 && D % 32 == 0 && G <= FAST_MAX_G && block_size % 16 == 0 && !force_generic) {
        const int64_t C = D / 32;
#ifdef HAVE_AMX
        const int amx = D <= 128 && amx_ready();
#else
        const int amx = 0;
#endif
        /* the common head shapes get their own copy of the loops (D 64 or 128, up to 8 query heads per KV head) */
        if (C == 2) {
            switch (G) {
                case 1: FAST_ITEMS(1, 2) return 0;
                case 2: FAST_ITEMS(2, 2) return 0;
                case 3: FAST_ITEMS(3, 2) return 0;
                case 4: FAST_ITEMS(4, 2) return 0;
                case 8: FAST_ITEMS(8, 2) return 0;
            }
        } else if (C == 4) {
            switch (G) {
                case 1: FAST_ITEMS(1, 4) return 0;
                case 2: FAST_ITEMS(2, 4) return 0;
                case 4: FAST_ITEMS(4, 4) return 0;
                case 8: FAST_ITEMS(8, 4) return 0;
            }
        }
        FAST_ITEMS(G, C)
        return 0;
    }
#endif
    #pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        if (D == 64)
            attend_item(q, k_cache, v_cache, block_tables, seq_lens, out, item, num_kv_heads, G, 64, block_size,
                        bt_stride, q_stride, out_stride, scale, is_bf16, window, cap);
        else if (D == 128)
            attend_item(q, k_cache, v_cache, block_tables, seq_lens, out, item, num_kv_heads, G, 128, block_size,
                        bt_stride, q_stride, out_stride, scale, is_bf16, window, cap);
        else
            attend_item(q, k_cache, v_cache, block_tables, seq_lens, out, item, num_kv_heads, G, D, block_size,
                        bt_stride, q_stride, out_stride, scale, is_bf16, window, cap);
    }
    return 0;
}
