// The CPU kernels as typed torch ops, torch.ops.aserve.*: tensors in, tensors out (or written in place where the
// schema says so), arguments checked before any pointer is taken. The Python functions of aserve/kernels/cpu.py
// call these.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_kernels.h"

namespace typed {

bool is_bf16(const at::Tensor &t) { return t.scalar_type() == at::kBFloat16; }

void check_float(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu(), name, ": a CPU tensor expected");
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                ": float32 or bfloat16 expected, got ", t.scalar_type());
}

void check_like(const at::Tensor &t, const at::Tensor &like, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == like.scalar_type(), name, ": a CPU ", like.scalar_type(),
                " tensor expected");
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x_, const std::optional<at::Tensor> &residual_,
                                                const at::Tensor &weight_, double eps) {
    check_float(x_, "add_rms_norm");
    TORCH_CHECK(x_.dim() == 2, "add_rms_norm: x [rows, n] expected");
    const at::Tensor x = x_.contiguous(), weight = weight_.contiguous();
    check_like(weight, x, "add_rms_norm weight");
    TORCH_CHECK(weight.numel() == x.size(1), "add_rms_norm: weight of ", x.size(1), " expected");
    at::Tensor res = x, res_out = x;
    if (residual_) {
        res = residual_->contiguous();
        check_like(res, x, "add_rms_norm residual");
        TORCH_CHECK(res.sizes() == x.sizes(), "add_rms_norm: residual of x's shape expected");
        res_out = at::empty_like(x);
    }
    at::Tensor out = at::empty_like(x);
    ::add_rms_norm(x.data_ptr(), res.data_ptr(), weight.data_ptr(), out.data_ptr(), res_out.data_ptr(), x.size(0),
                   x.size(1), (float)eps, residual_.has_value(), is_bf16(x), at::get_num_threads());
    return {out, res_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_split(const at::Tensor &qkv, const at::Tensor &cos,
                                                            const at::Tensor &sin, int64_t num_heads,
                                                            int64_t num_kv_heads, int64_t head_dim) {
    check_float(qkv, "rotary_split");
    check_like(cos, qkv, "rotary_split cos");
    check_like(sin, qkv, "rotary_split sin");
    const int64_t t = qkv.size(0);
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim && qkv.stride(1) == 1,
                "rotary_split: qkv [T, (H + 2 Hkv) D] with contiguous rows expected");
    TORCH_CHECK(cos.size(0) == t && cos.size(-1) == head_dim && cos.stride(-1) == 1 && cos.strides() == sin.strides() &&
                    cos.sizes() == sin.sizes(),
                "rotary_split: cos / sin [T, 1, D] of one layout, contiguous rows, expected");
    const auto options = qkv.options();
    at::Tensor q = at::empty({t, num_heads, head_dim}, options);
    at::Tensor k = at::empty({t, num_kv_heads, head_dim}, options);
    at::Tensor v = at::empty({t, num_kv_heads, head_dim}, options);
    ::rotary_split(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), t,
                   num_heads, num_kv_heads, head_dim, qkv.stride(0), cos.stride(0), is_bf16(qkv),
                   at::get_num_threads());
    return {q, k, v};
}

at::Tensor silu_mul(const at::Tensor &gate_up_) {
    check_float(gate_up_, "silu_mul");
    TORCH_CHECK(gate_up_.dim() == 2 && gate_up_.size(1) % 2 == 0, "silu_mul: gate_up [T, 2n] expected");
    const at::Tensor gate_up = gate_up_.contiguous();
    const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
    at::Tensor out = at::empty({rows, n}, gate_up.options());
    ::silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, is_bf16(gate_up), at::get_num_threads());
    return out;
}

at::Tensor gemv(const at::Tensor &weight, const at::Tensor &x_) {
    TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
                    weight.is_contiguous(),
                "gemv: a contiguous CPU bfloat16 weight [N, K] expected");
    TORCH_CHECK(x_.scalar_type() == at::kBFloat16 && x_.dim() == 1 && x_.size(0) == weight.size(1),
                "gemv: x [K] bfloat16 expected");
    const at::Tensor x = x_.contiguous();
    at::Tensor y = at::empty({weight.size(0)}, weight.options());
    const int rc = ::gemv_bf16((const uint16_t *)weight.data_ptr(), (const uint16_t *)x.data_ptr(),
                               (uint16_t *)y.data_ptr(), weight.size(0), weight.size(1), at::get_num_threads());
    TORCH_CHECK(rc == 0, "gemv: K = ", weight.size(1), " not taken (K % 32 == 0, K <= 8192, AVX512-BF16 needed)");
    return y;
}

int64_t gemm_rows_packed_numel(int64_t n, int64_t k) { return (n + 15) / 16 * 16 * ((k + 1) / 2 * 2); }

at::Tensor gemm_rows_prepare(const at::Tensor &weight_) {
    check_float(weight_, "gemm_rows_prepare");
    TORCH_CHECK(weight_.dim() == 2 && weight_.size(1) > 0, "gemm_rows_prepare: a weight [N, K] expected");
    const at::Tensor weight = weight_.contiguous();
    if (!is_bf16(weight)) return weight;
    const int64_t n = weight.size(0), k = weight.size(1);
    at::Tensor packed = at::empty({gemm_rows_packed_numel(n, k)}, weight.options());
    ::gemm_rows_pack_bf16((const uint16_t *)weight.data_ptr(), (uint16_t *)packed.data_ptr(), n, k);
    return packed;
}

at::Tensor gemm_rows(const at::Tensor &prepared, const at::Tensor &x_, int64_t n) {
    check_float(prepared, "gemm_rows");
    check_like(x_, prepared, "gemm_rows x");
    TORCH_CHECK(x_.dim() == 2 && x_.size(1) > 0, "gemm_rows: x [M, K] expected");
    const int64_t k = x_.size(1);
    if (is_bf16(prepared)) {
        TORCH_CHECK(prepared.dim() == 1 && prepared.is_contiguous() && prepared.numel() == gemm_rows_packed_numel(n, k),
                    "gemm_rows: a bfloat16 weight packed by gemm_rows_prepare for [", n, ", ", k, "] expected");
    } else {
        TORCH_CHECK(prepared.dim() == 2 && prepared.is_contiguous() && prepared.size(0) == n && prepared.size(1) == k,
                    "gemm_rows: a contiguous float32 weight [", n, ", ", k, "] expected");
    }
    const at::Tensor x = x_.stride(1) == 1 ? x_ : x_.contiguous();
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    const int status = ::gemm_rows(prepared.data_ptr(), x.data_ptr(), y.data_ptr(), x.size(0), n, k, x.stride(0), n,
                                   is_bf16(x), at::get_num_threads());
    TORCH_CHECK(status == 0, "gemm_rows: no memory for the widened rows");
    return y;
}

at::Tensor gemm_int8(const at::Tensor &weight, const at::Tensor &scale, const at::Tensor &x_, bool generic) {
    TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kChar && weight.dim() == 2 &&
                    weight.is_contiguous(),
                "gemm_int8: a contiguous CPU int8 weight [N, K] expected");
    const int64_t n = weight.size(0), k = weight.size(1);
    TORCH_CHECK(scale.device().is_cpu() && scale.scalar_type() == at::kFloat && scale.numel() == n &&
                    scale.is_contiguous(),
                "gemm_int8: a contiguous float32 scale [N] expected");
    check_float(x_, "gemm_int8");
    TORCH_CHECK(x_.dim() == 2 && x_.size(1) == k, "gemm_int8: x [M, K] expected");
    const at::Tensor x = x_.stride(1) == 1 ? x_ : x_.contiguous();
    at::Tensor y = at::empty({x.size(0), n}, x.options());
    const int rc = ::gemm_int8(weight.data_ptr<int8_t>(), scale.data_ptr<float>(), x.data_ptr(), y.data_ptr(),
                               x.size(0), n, k, x.stride(0), n, is_bf16(x), at::get_num_threads(), generic);
    TORCH_CHECK(rc == 0, "gemm_int8: K = ", k, " not taken (1 <= K <= 16384)");
    return y;
}

void paged_decode_attention(const at::Tensor &q, const at::Tensor &k_cache, const at::Tensor &v_cache,
                            const at::Tensor &block_tables, const at::Tensor &seq_lens, at::Tensor &out,
                            std::optional<double> scale, bool generic, int64_t window, double softcap, double k_scale,
                            double v_scale) {
    check_float(q, "paged_decode_attention");
    TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
                "paged_decode_attention: q [n, H, D] with contiguous heads expected");
    const int64_t n = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == head_dim,
                "paged_decode_attention: contiguous caches [num_blocks, block_size, Hkv, D] expected");
    // an FP8 (e4m3) cache with its per-tensor scales, or one of q's dtype
    const bool fp8 = k_cache.scalar_type() == at::ScalarType::Float8_e4m3fn;
    if (fp8) {
        TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                        v_cache.scalar_type() == k_cache.scalar_type(),
                    "paged_decode_attention: CPU float8_e4m3fn caches expected");
    } else {
        check_like(k_cache, q, "paged_decode_attention k_cache");
        check_like(v_cache, q, "paged_decode_attention v_cache");
        TORCH_CHECK(k_scale == 1.0 && v_scale == 1.0,
                    "paged_decode_attention: k_scale / v_scale apply to a float8_e4m3fn cache only");
    }
    check_like(out, q, "paged_decode_attention out");
    const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
    TORCH_CHECK(block_tables.device().is_cpu() && seq_lens.device().is_cpu() && block_tables.scalar_type() == at::kInt &&
                    seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                    block_tables.size(0) >= n && seq_lens.numel() >= n,
                "paged_decode_attention: block_tables [>= n, max] and seq_lens [>= n] int32 expected");
    TORCH_CHECK(out.dim() == 3 && out.size(0) >= n && out.size(1) == num_heads && out.size(2) == head_dim &&
                    out.stride(2) == 1 && out.stride(1) == head_dim,
                "paged_decode_attention: out [>= n, H, D] with contiguous heads expected");
    TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_decode_attention: H % Hkv != 0");
    const float sm_scale = (float)scale.value_or(std::pow((double)head_dim, -0.5));
    const int rc = fp8 ? ::paged_decode_attention_fp8(
                             q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr<int32_t>(),
                             seq_lens.data_ptr<int32_t>(), out.data_ptr(), n, num_heads, num_kv_heads, head_dim,
                             block_size, block_tables.stride(0), q.stride(0), out.stride(0), sm_scale, (float)k_scale,
                             (float)v_scale, is_bf16(q), at::get_num_threads(), generic, window, (float)softcap)
                       : ::paged_decode_attention(
                             q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr<int32_t>(),
                             seq_lens.data_ptr<int32_t>(), out.data_ptr(), n, num_heads, num_kv_heads, head_dim,
                             block_size, block_tables.stride(0), q.stride(0), out.stride(0), sm_scale, is_bf16(q),
                             at::get_num_threads(), generic, window, (float)softcap);
    TORCH_CHECK_VALUE(rc == 0, "paged_decode_attention: unsupported shape (heads ", num_heads, "/", num_kv_heads,
                      ", D ", head_dim, ")");
}

std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor &logits) {
    check_float(logits, "greedy_pick");
    TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
                "greedy_pick: logits [rows, vocab > 0] with contiguous rows expected");
    const int64_t rows = logits.size(0);
    const auto options = logits.options().dtype(at::kLong);
    at::Tensor idx = at::empty({rows}, options), nonfinite = at::empty({rows}, options);
    ::greedy_pick(logits.data_ptr(), rows, logits.size(1), logits.stride(0), is_bf16(logits),
                  idx.data_ptr<int64_t>(), nonfinite.data_ptr<int64_t>(), at::get_num_threads());
    return {idx, nonfinite.to(at::kBool)};
}

}  // namespace typed

// Registered by a call when the extension is loaded (aserve/kernels/cpu_build.py), not by TORCH_LIBRARY's static
// initialisers: a second build of these kernels loaded into the same process (a benchmark comparing revisions) then
// gets an exception here instead of aborting the process, and can still use its raw entry points. The libraries
// live as long as the process.
void register_ops() {
    static torch::Library *defs = nullptr;
    if (defs) return;
    auto *lib = new torch::Library(torch::Library::DEF, "aserve", std::nullopt, __FILE__, __LINE__);
    lib->def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
    lib->def("rotary_split(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim) -> "
             "(Tensor, Tensor, Tensor)");
    lib->def("silu_mul(Tensor gate_up) -> Tensor");
    lib->def("gemv(Tensor weight, Tensor x) -> Tensor");
    lib->def("gemm_rows_prepare(Tensor weight) -> Tensor");
    lib->def("gemm_rows(Tensor prepared, Tensor x, int n) -> Tensor");
    lib->def("gemm_int8(Tensor weight, Tensor scale, Tensor x, bool generic=False) -> Tensor");
    lib->def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
             "Tensor(a!) out, float? scale=None, bool generic=False, int window=0, float softcap=0.0, "
             "float k_scale=1.0, float v_scale=1.0) -> ()");
    lib->def("greedy_pick(Tensor logits) -> (Tensor, Tensor)");
    auto *cpu = new torch::Library(torch::Library::IMPL, "aserve", c10::DispatchKey::CPU, __FILE__, __LINE__);
    cpu->impl("add_rms_norm", TORCH_FN(typed::add_rms_norm));
    cpu->impl("rotary_split", TORCH_FN(typed::rotary_split));
    cpu->impl("silu_mul", TORCH_FN(typed::silu_mul));
    cpu->impl("gemv", TORCH_FN(typed::gemv));
    cpu->impl("gemm_rows_prepare", TORCH_FN(typed::gemm_rows_prepare));
    cpu->impl("gemm_rows", TORCH_FN(typed::gemm_rows));
    cpu->impl("gemm_int8", TORCH_FN(typed::gemm_int8));
    cpu->impl("paged_decode_attention", TORCH_FN(typed::paged_decode_attention));
    cpu->impl("greedy_pick", TORCH_FN(typed::greedy_pick));
    defs = lib;
}
