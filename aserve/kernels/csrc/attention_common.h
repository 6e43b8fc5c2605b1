// Shared by the decode attention kernels (attention.cpp: float32 / bfloat16 caches, attention_fp8.cpp: FP8 e4m3
// caches): the exp2 polynomial, the sliding window's span of a request, soft-capping.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

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
