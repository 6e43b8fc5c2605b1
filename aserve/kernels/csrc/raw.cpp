// The extension's Python module: the kernels' C entry points (cpu_kernels.h) with integer pointers (tensors'
// data_ptr()), for the CPU one-token forward (aserve/model/cpu_decode.py), which owns its buffers and makes ~270
// kernel calls per token. A call here costs ~0.9 us against ~2.8 us for the typed op (torch.ops.aserve.*, its
// dispatcher and argument checks) and ~1.8 us through ctypes (bench/cpu_call_overhead.py); like ctypes, they release
// the GIL while the kernel runs. register_ops() registers the typed ops (ops.cpp).
#include <pybind11/pybind11.h>

#include "cpu_kernels.h"

namespace py = pybind11;

void register_ops();  // ops.cpp

namespace {

template <typename T = void>
T *ptr(uintptr_t p) {
    return reinterpret_cast<T *>(p);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("register_ops", &register_ops, "Registers torch.ops.aserve.* (once per process).");
    m.def(
        "add_rms_norm",
        [](uintptr_t x, uintptr_t res, uintptr_t w, uintptr_t out, uintptr_t res_out, int64_t rows, int64_t n,
           float eps, int has_res, int bf16, int nt) {
            ::add_rms_norm(ptr(x), ptr(res), ptr(w), ptr(out), ptr(res_out), rows, n, eps, has_res, bf16, nt);
        },
        nogil);
    m.def(
        "rotary_split",
        [](uintptr_t qkv, uintptr_t cos, uintptr_t sin, uintptr_t q, uintptr_t k, uintptr_t v, int64_t rows,
           int64_t H, int64_t Hkv, int64_t D, int64_t stride_qkv, int64_t stride_cs, int bf16, int nt) {
            ::rotary_split(ptr(qkv), ptr(cos), ptr(sin), ptr(q), ptr(k), ptr(v), rows, H, Hkv, D, stride_qkv,
                           stride_cs, bf16, nt);
        },
        nogil);
    m.def(
        "silu_mul",
        [](uintptr_t gate_up, uintptr_t out, int64_t rows, int64_t n, int bf16, int nt) {
            ::silu_mul(ptr(gate_up), ptr(out), rows, n, bf16, nt);
        },
        nogil);
    m.def(
        "gemv_bf16",
        [](uintptr_t W, uintptr_t x, uintptr_t y, int64_t N, int64_t K, int nt) {
            return ::gemv_bf16(ptr<uint16_t>(W), ptr<uint16_t>(x), ptr<uint16_t>(y), N, K, nt);
        },
        nogil);
    m.def("gemv_bf16_available", &::gemv_bf16_available);
    m.def(
        "gemm_rows",
        [](uintptr_t W, uintptr_t x, uintptr_t y, int64_t M, int64_t N, int64_t K, int64_t x_stride, int64_t y_stride,
           int bf16, int nt) { return ::gemm_rows(ptr(W), ptr(x), ptr(y), M, N, K, x_stride, y_stride, bf16, nt); },
        nogil);
    m.def(
        "gemm_int8",
        [](uintptr_t W, uintptr_t scale, uintptr_t x, uintptr_t y, int64_t M, int64_t N, int64_t K, int64_t x_stride,
           int64_t y_stride, int bf16, int nt, int force_generic) {
            return ::gemm_int8(ptr<int8_t>(W), ptr<float>(scale), ptr(x), ptr(y), M, N, K, x_stride, y_stride, bf16,
                               nt, force_generic);
        },
        nogil);
    m.def(
        "paged_decode_attention",
        [](uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables, uintptr_t seq_lens,
           uintptr_t out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
           int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, float scale, int is_bf16,
           int num_threads, int force_generic, int64_t window, float softcap) {
            return ::paged_decode_attention(ptr(q), ptr(k_cache), ptr(v_cache), ptr<int32_t>(block_tables),
                                            ptr<int32_t>(seq_lens), ptr(out), num_seqs, num_heads, num_kv_heads,
                                            head_dim, block_size, bt_stride, q_stride, out_stride, scale, is_bf16,
                                            num_threads, force_generic, window, softcap);
        },
        nogil);
    m.def(
        "paged_decode_attention_fp8",
        [](uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables, uintptr_t seq_lens,
           uintptr_t out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
           int64_t block_size, int64_t bt_stride, int64_t q_stride, int64_t out_stride, float scale, float k_scale,
           float v_scale, int is_bf16, int num_threads, int force_generic, int64_t window, float softcap) {
            return ::paged_decode_attention_fp8(ptr(q), ptr(k_cache), ptr(v_cache), ptr<int32_t>(block_tables),
                                                ptr<int32_t>(seq_lens), ptr(out), num_seqs, num_heads, num_kv_heads,
                                                head_dim, block_size, bt_stride, q_stride, out_stride, scale, k_scale,
                                                v_scale, is_bf16, num_threads, force_generic, window, softcap);
        },
        nogil);
    m.def(
        "fp8_write_kv",
        [](uintptr_t k, uintptr_t v, uintptr_t k_out, uintptr_t v_out, int64_t n, float k_scale, float v_scale,
           int is_bf16) { ::fp8_write_kv(ptr(k), ptr(v), ptr(k_out), ptr(v_out), n, k_scale, v_scale, is_bf16); },
        nogil);
    m.def(
        "greedy_pick",
        [](uintptr_t logits, int64_t rows, int64_t vocab, int64_t stride, int bf16, uintptr_t idx,
           uintptr_t nonfinite, int num_threads) {
            ::greedy_pick(ptr(logits), rows, vocab, stride, bf16, ptr<int64_t>(idx), ptr<int64_t>(nonfinite),
                          num_threads);
        },
        nogil);
}
