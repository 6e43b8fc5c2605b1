// Shared by the decode attention kernels (attention.cpp: float32 / bfloat16 caches, attention_fp8.cpp: FP8 e4m3
// caches): the exp2 polynomial, the sliding window's span of a request, soft-capping, the portable loops over rows.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

#include "cpu_common.h"

/* 2**x for x <= 0 (x >= -126 after clamping): integer part into the exponent, a degree-6 polynomial for the
   fraction (relative error ~2e-7). Plain arithmetic, so loops over it vectorise. */
static inline float exp2_neg(float x) {
    x = x < -126.0f ? -126.0f : x;
    float fl = (float)(int)x;
    fl = fl > x ? fl - 1.0f : fl;                 /* floor */
    float f = x - fl;                             /* [0, 1) */
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t e = (int32_t)fl + 127;
    uint32_t u = (uint32_t)e << 23;
    float s;
    memcpy(&s, &u, 4);
    return p * s;
}

#define MAX_D 256
#define MAX_G 32

/* The work items' chunk for the threads' dynamic schedule: a request's KV heads together (one chunk each) once
   there are requests for every thread; fewer (batch-1 decode): one head a chunk, so every thread takes heads. */
static inline int64_t heads_chunk(int64_t num_seqs, int64_t num_kv_heads, int num_threads) {
    return num_seqs >= num_threads ? num_kv_heads : 1;
}

/* A work item's keys, with a sliding window: the query (the request's last token, position full_len - 1) sees
   keys full_len - window .. full_len - 1. The item's loops run over the request's blocks from the one holding the
   first of them (blocks wholly before the window are never read): `bt` and `len` below describe the request from
   that block on, and the first `skip` tokens of it are outside the window (weight 0). */
typedef struct {
    const int32_t *bt;  /* block-table row from the first block read */
    int64_t len, skip;
} window_span;

static inline window_span span_of(const int32_t *bt_row, int64_t full_len, int64_t window, int64_t block_size) {
    const int64_t first = window > 0 && full_len > window ? full_len - window : 0;
    const int64_t lo = first / block_size * block_size;
    window_span w = {bt_row + lo / block_size, full_len - lo, first - lo};
    return w;
}

/* Soft-capping of scores in log2 units: s -> cap * tanh(s / cap) (cap = softcap * log2(e); 0: none). */
static inline void softcap_scores(float *sg, int64_t from, int64_t to, float cap) {
    if (cap > 0.0f)
        for (int64_t t = from; t < to; t++) sg[t] = cap * tanhf(sg[t] / cap);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The lanes j of the 16 tokens from t0 with from <= t0 + j < to. */
static inline __mmask16 lanes_between(int64_t t0, int64_t from, int64_t to) {
    const uint32_t below_to = to - t0 >= 16 ? 0xFFFFu : to > t0 ? (1u << (to - t0)) - 1u : 0u;
    const uint32_t below_from = from - t0 >= 16 ? 0xFFFFu : from > t0 ? (1u << (from - t0)) - 1u : 0u;
    return (__mmask16)(below_to & ~below_from);
}
#endif

/* One (request, KV head) work item in portable loops, each K/V row of one head widened to float32 by
   load(cache, base, kv) (base: the row's first element): both decode kernels' general path. Queries are scaled by
   q_mul1 * q_mul2 (the softmax scale and log2(e): scores in log2 units), outputs by out_scale. D is a compile-time
   constant at the common call sites (fixed-length inner loops vectorise without remainder handling). */
template <typename Cache, typename LoadRow>
static inline __attribute__((always_inline)) void attend_item_rows(
        const void *q, const Cache *k_cache, const Cache *v_cache, const int32_t *block_tables,
        const int32_t *seq_lens, void *out, int64_t item, int64_t num_kv_heads, int64_t G, const int64_t D,
        int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, float q_mul1, float q_mul2,
        float out_scale, int is_bf16, int64_t window, float cap, LoadRow load) {
    const int64_t row = num_kv_heads * D;  /* elements between consecutive tokens of one head */
    const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
    const window_span span = span_of(block_tables + s * bt_stride, seq_lens[s], window, block_size);
    const int64_t len = span.len, skip = span.skip;
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], kv[MAX_D], l[MAX_G];
    for (int64_t g = 0; g < G; g++) {
        const int64_t off = s * q_stride + (h * G + g) * D;
        for (int64_t d = 0; d < D; d++) {
            float x = is_bf16 ? bf16_to_f32(((const uint16_t *)q)[off + d]) : ((const float *)q)[off + d];
            qf[g][d] = x * q_mul1 * q_mul2;  /* scores in log2 units: exp2 below */
            acc[g][d] = 0.0f;
        }
    }
    float *scores = (float *)malloc(sizeof(float) * (len > 0 ? len : 1) * G);  /* [G][len] */
    /* pass 1: scores (walking the block table block by block: no division per token) */
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
      const int64_t blk = span.bt[b];
      const int64_t t_end = t0 + block_size < len ? t0 + block_size : len;
      for (int64_t t = t0; t < t_end; t++) {
        const int64_t base = (blk * block_size + (t - t0)) * row + h * D;
        load(k_cache, base, kv);
        for (int64_t g = 0; g < G; g++) {
            float dot = 0.0f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; d++) dot += qf[g][d] * kv[d];
            scores[g * len + t] = dot;
        }
      }
    }
    /* pass 2: softmax weights, in place (0 before the window) */
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * len;
        float mx = -INFINITY, sum = 0.0f;
        softcap_scores(sg, skip, len, cap);
        for (int64_t t = 0; t < skip; t++) sg[t] = 0.0f;
        #pragma omp simd reduction(max:mx)
        for (int64_t t = skip; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = skip; t < len; t++) {
            float p = exp2_neg(sg[t] - mx);
            sg[t] = p;
            sum += p;
        }
        l[g] = sum;
    }
    /* pass 3: weighted sum of V */
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
      const int64_t blk = span.bt[b];
      const int64_t t_end = t0 + block_size < len ? t0 + block_size : len;
      for (int64_t t = t0; t < t_end; t++) {
        const int64_t base = (blk * block_size + (t - t0)) * row + h * D;
        load(v_cache, base, kv);
        for (int64_t g = 0; g < G; g++) {
            const float p = scores[g * len + t];
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * kv[d];
        }
      }
    }
    free(scores);
    for (int64_t g = 0; g < G; g++) {
        const float inv = l[g] > 0.0f ? out_scale / l[g] : 0.0f;
        const int64_t off = s * out_stride + (h * G + g) * D;
        for (int64_t d = 0; d < D; d++) {
            float x = acc[g][d] * inv;
            if (is_bf16) ((uint16_t *)out)[off + d] = f32_to_bf16(x);
            else ((float *)out)[off + d] = x;
        }
    }
}
