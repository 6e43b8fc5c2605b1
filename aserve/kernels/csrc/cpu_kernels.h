// The CPU kernels' entry points (C linkage: raw pointers in, nothing allocated). bf16 / is_bf16: 1 bfloat16,
// 0 float32; nt / num_threads: OpenMP threads (torch's count).
#pragma once

#include <stdint.h>

extern "C" {

// x + residual -> (RMSNorm(x + residual) * w, x + residual) per row of n; without a residual (has_res 0),
// (RMSNorm(x) * w, x). elementwise.cpp
void add_rms_norm(const void *x, const void *res, const void *w, void *out, void *res_out, int64_t rows, int64_t n,
                  float eps, int has_res, int bf16, int nt);

// qkv [rows, (H + 2 Hkv) D] (row stride stride_qkv), cos / sin [rows, D] (row stride stride_cs) -> rotated
// q [rows, H, D], rotated k and v [rows, Hkv, D]. elementwise.cpp
void rotary_split(const void *qkv, const void *cos_, const void *sin_, void *q, void *k, void *v, int64_t rows,
                  int64_t H, int64_t Hkv, int64_t D, int64_t stride_qkv, int64_t stride_cs, int bf16, int nt);

// gate_up [rows, 2n] -> silu(gate) * up [rows, n]. elementwise.cpp
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int bf16, int nt);

// y [N] = W [N, K] x [K], bf16; 0, or -1 where it does not apply (K % 32, K > 8192, no AVX512-BF16). gemv.cpp
int gemv_bf16(const uint16_t *W, const uint16_t *x, uint16_t *y, int64_t N, int64_t K, int nt);
int gemv_bf16_available(void);

// y [M, N] = x [M, K] W^T, x and y bf16 or float32 with row strides x_stride / y_stride (elements), float32 sums
// in one order per output that depends on K alone (batch-invariant). W: float32 [N, K] row-major; bf16 packed by
// gemm_rows_pack_bf16 (ceil(N / 16) * 16 * ceil(K / 2) * 2 elements). 0, or -1 for K < 1. gemm_rows.cpp
void gemm_rows_pack_bf16(const uint16_t *W, uint16_t *Wp, int64_t N, int64_t K);
int gemm_rows(const void *W, const void *x, void *y, int64_t M, int64_t N, int64_t K, int64_t x_stride,
              int64_t y_stride, int bf16, int nt);

// y [M, N] = (x [M, K] W^T) * scale: W int8 [N, K] row-major, scale float32 [N] (one per output channel), x and y
// bf16 or float32 with row strides x_stride / y_stride (elements), float32 sums; 0, or -1 for K outside
// [1, 16384]. force_generic: the portable loops even where the AVX-512 path applies. gemm_int8.cpp
int gemm_int8(const int8_t *W, const float *scale, const void *x, void *y, int64_t M, int64_t N, int64_t K,
              int64_t x_stride, int64_t y_stride, int bf16, int nt, int force_generic);

// One query token per request over the paged KV cache (window: the most recent keys it sees, 0 all; softcap:
// of the scaled scores, 0 none); 0, or -1 for shapes it does not take. attention.cpp
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                           const int32_t *seq_lens, void *out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t bt_stride,
                           int64_t q_stride, int64_t out_stride, float scale, int is_bf16, int num_threads,
                           int force_generic, int64_t window, float softcap);

// The same over float8_e4m3fn caches, keys read as k_scale * their value and values as v_scale * theirs; q and out
// float32 or bfloat16 (is_bf16). attention_fp8.cpp
int paged_decode_attention_fp8(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                               const int32_t *seq_lens, void *out, int64_t num_seqs, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t bt_stride,
                               int64_t q_stride, int64_t out_stride, float scale, float k_scale, float v_scale,
                               int is_bf16, int num_threads, int force_generic, int64_t window, float softcap);

// One token's k and v [n] (bf16 or float32) -> x / scale clamped to +-448, as e4m3 (round to nearest even: torch's
// cast), into k_out / v_out (a cache slot). attention_fp8.cpp
void fp8_write_kv(const void *k, const void *v, void *k_out, void *v_out, int64_t n, float k_scale, float v_scale,
                  int is_bf16);

// logits [rows, vocab] (row stride `stride`) -> idx [rows] (first maximum), nonfinite [rows]. sample.cpp
void greedy_pick(const void *logits, int64_t rows, int64_t vocab, int64_t stride, int bf16, int64_t *idx,
                 int64_t *nonfinite, int num_threads);
}
