"""The CPU kernels' Python API: small C kernels (C++ in aserve/kernels/csrc) built once per machine into one torch
extension by aserve/kernels/cpu_build.py, called here as typed ops, torch.ops.aserve.* (tensors in and out, arguments
checked). `load()` builds or loads the extension (the engine does it at start) and keeps it in this module, so that
the availability checks below read a module variable and never call into the build code; where it cannot be built
(no compiler, ASERVE_CPU_KERNELS=0) they say False and callers keep their torch paths. `library()` gives the
extension's raw entry points (integer pointers) to callers that own their buffers (aserve/models/cpu_one_token.py).

Element-wise (csrc/elementwise.cpp), float32 and bfloat16, same contract and rounding as aserve/kernels/fused.py
(HF's eager order; references: aserve.layers.elementwise's add_rms_norm, split_rotate_qkv, silu_and_mul):

    add_rms_norm     x + residual -> (RMSNorm(x + residual) * weight, x + residual)
    rotary_split     fused qkv rows -> rotated q, rotated k, v (each contiguous)
    silu_mul         gate_up rows -> silu(gate) * up

  Each call costs microseconds of Python, where eager torch runs 3-10 ops (~10 us each) and a torch.compile'd region
  pays ~100 us to enter: at batch 1 on a 2-core CPU that overhead is a visible part of every decode step. Rows are
  spread over torch's threads (OpenMP) when there are many; bf16 SiLU·mul on AVX512-BF16 runs 16 lanes with a
  polynomial exp (libm's expf does not vectorise): 1.7-1.9x eager torch.

GEMV (csrc/gemv.cpp), one bf16 input row (batch-1 decode): y[n] = sum_k W[n, k] x[k], W [N, K] row-major, float32
accumulation, y rounded to bf16; reference torch.mv (same products, summed in another order).

  At batch 1 every linear streams its whole weight, so the step is bound by memory: torch.mv reaches ~9-12 GB/s on the
  2-core development VM over a model's cold weights, this kernel ~15-18 GB/s (rows in blocks of 16 over torch's
  threads, vdpbf16ps pair dot products against x held in registers, one transpose-and-add tree per 16 row sums, rows
  read one after another with no software prefetch). Needs AVX512-BF16 (Sapphire Rapids and newer), K % 32 == 0
  and K <= MAX_GEMV_K (x is held as up to 512 vectors of 32 bf16 on each thread's stack; `gemv_supports`).

Batch-invariant product (csrc/gemm_rows.cpp), what deterministic mode runs every linear layer with (aserve/layers/
batch_invariant.py): y [M, N] = x [M, K] W^T, x and W bf16 or float32, float32 sums whose order depends on K alone,
never on M, the row's place in x or the number of threads, so a row's result is the same bits whatever else is in the
batch (oneDNN and MKL pick other kernels, and so other sums, by M; the GEMV above sums one row its own way).

  bf16: the weight is packed once (`gemm_rows_prepare`) into blocks of 16 output channels with k in pairs, so one
  64-byte load holds a k pair of 16 outputs; each output is one vdpbf16ps chain over the k pairs, in order (x's pair
  broadcast to all lanes: oneDNN's own scheme, and about its speed), so there is no horizontal sum at all. Tiles of
  6 x rows by 4 blocks (24 accumulators; 2 blocks where that gives too few work items), work items of (up to 48 x
  rows, 64 or 32 outputs) over torch's threads, small products on one thread. One row is the GEMV of batch-1 decode
  (the CPU one-token forward runs it through `library()`, over the same packed weight). float32: one 16-lane FMA
  chain per output over the plain weight, then the lanes summed by hsum16 (blocks of 16 outputs) or
  _mm512_reduce_add_ps.
  With AVX2 and FMA but no AVX512-BF16: x widened to float32 rows first; bf16, per output one FMA chain over k in
  order over the same packed weight (a 32-byte load is a k pair of 8 outputs, widened in registers), tiles of 4 x
  rows by 16 outputs and, for the rows left over (decode's one row), one row by 64 outputs; float32, per output 16
  partial sums (two 8-lane FMA chains) added in a fixed tree. Normal mode runs this kernel too for bf16 weights of up
  to linear.ROWS_PACKED_MAX rows on CPUs without a native bf16 GEMM (aserve/layers/linear.py). Without either:
  portable loops, the same orders. Reference: torch.nn.functional.linear (same products, summed in another order).

INT8 weight-only products (csrc/gemm_int8.cpp), the CPU side of `--quantization int8`: y [M, N] = (x [M, K] W^T) *
scale, W int8 [N, K] row-major with one float32 scale per output channel, x and y bf16 or float32, float32 sums;
reference aserve/kernels/int8_reference.py int8_linear (same products, summed in another order). The weight is
streamed once per call, half the bytes of bf16 (batch-1 decode is bound by them): 16 output rows per work item over
torch's threads, the rows read one after another (one sequential stream per thread, no software prefetch: rows
read side by side streamed at a third of the rate on a Zen 4 core); with AVX-512, 16 weights at a time widened to
float32 (vpmovsxbd, vcvtdq2ps) and multiplied into x (held as float32 on the thread's stack, 16384 / K rows per pass,
so a block's weights come from memory once per pass), each weight vector widened once for up to four x rows (one x
row: two accumulators a weight row); with AVX2 and FMA, 8 at a time, with 4 / 2 / 1 accumulators an x row for 1 / 2
/ more x rows (K % 8 == 0); elsewhere portable loops the compiler vectorises. K <= 16384 (`gemm_int8_supports`).

Decode attention (csrc/attention.cpp): one query token per request, reading the paged KV cache in place, where the
torch backend gathers every request's blocks into a padded copy for SDPA (K/V read, written and read again; SDPA's
CPU kernel is slow at one query token). Reference: aserve/kernels/reference.py paged_attention.

  One work item per (request, KV head) over torch's OpenMP threads (a request's KV heads handed out together, so one
  core reads all of its cache lines, once there are requests for every thread; with fewer, as in batch-1 decode, one
  head at a time, so every thread takes heads): scores = q . K[t] * scale for the G query heads sharing the KV head,
  block by block through the block table; p = exp(scores - max) with a vectorisable exp2 polynomial; out = sum_t p[t]
  V[t] / l. float32 and bfloat16 (round to nearest even on the way out). With AVX512-BF16, bf16 takes a vectorised
  path (q . k as vdpbf16ps over 16 tokens at a time, P @ V with two tokens' V rows interleaved, P rounded to bf16 once
  as flash attention rounds it); head_dim 64 / 128 with 1, 2, 3, 4 or 8 query heads per KV head get loops with G and D
  fixed at compile time. With AMX (ASERVE_CPU_AMX=0: off), both products run on tiles where head_dim <= 128
  (P @ V: <= 64), summed in another order than vdpbf16ps (float32 rounding differences). The coming blocks' K/V rows are
  prefetched 32-64 tokens ahead; prefetch_rows must be always inlined (out of line, GCC dropped the prefetches: ~40 %
  slower with the cache in DRAM, the engine's case). On the 2-core development VM, 30 layer caches of 64 requests x
  320 tokens (SmolLM2 heads): 1.07-1.18 ms per call with AMX, 1.35 without (docs/benchmarks.md).

  FP8 caches (`--kv-cache-dtype fp8`, csrc/attention_fp8.cpp): float8_e4m3fn pages with per-tensor k_scale / v_scale,
  float32 or bfloat16 queries, the same work items, window and softcap; k_scale folds into the softmax scale, v_scale
  into the output, and all arithmetic is float32 (no bf16 rounding of P). Portable loops widen each row through a
  256-entry table of the e4m3 values; with AVX-512 (F, BW, VL) a byte becomes float16 bits in three integer
  instructions (sign-extend, shift, mask; e4m3's bias is float16's - 8, the 2**8 folded into the scales) and
  vcvtph2ps widens 16 at a time, exactly; pass 1 widens 16 tokens' K rows and takes each query head's dot products
  with FMAs, pass 3 walks the V rows one 64-dimension cache line at a time into G x 4 accumulators. Reference:
  paged_attention over the dequantised cache (x.float() * scale). The one-token forward writes a token's K/V into its
  FP8 slot with fp8_write_kv (raw entry point only): x / scale clamped to +-448, rounded as torch's cast rounds (c10's
  bit manipulation), so the cache holds the bytes FP8KVCache.write would.

Greedy pick (csrc/sample.cpp): per logits row in the model's dtype, the index of the first maximum and whether the row
holds a NaN or an infinity; what the sampler needs of a greedy batch, where torch's way (widen bf16 to float32, a sum
for the finite check, max(dim).indices) took ~4-5 ms per decode step of [64, 49152] rows on the development VM. Same
result as `logits.float().max(dim=-1).indices` (first maximum; -0.0 == 0.0) and `~isfinite(logits.float().sum(-1))`
(the index of a flagged row means nothing). Its GPU twin is aserve/kernels/greedy.py.
"""

from __future__ import annotations

import types

import torch

from aserve.kernels import cpu_build

NOT_LOADED = object()
# The extension's module, set by load(): None where it cannot be built, NOT_LOADED before the first load.
extension: types.ModuleType | None | object = NOT_LOADED

MAX_ATTENTION_HEAD_DIM = 256
MAX_GEMV_K = 16384
MAX_GEMM_INT8_K = 16384


def load() -> types.ModuleType | None:
    """Builds (the first time on this machine) or loads the extension, once per process (cpu_build.load_all()), and
    keeps it here -> the extension's module, or None."""
    global extension
    extension = cpu_build.load_all()
    return extension


def library() -> types.ModuleType | None:
    """The extension's raw entry points (None where it cannot be built); loads it on first use."""
    return load() if extension is NOT_LOADED else extension


def available() -> bool:
    return library() is not None


# -- element-wise ---------------------------------------------------------------------------------------------------


def elementwise_supports(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16) and available()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x [T, n] -> (norm(x + residual) * weight, x + residual); without a residual, (norm(x) * weight, x)."""
    return torch.ops.aserve.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2n] -> silu(gate) * up [T, n]."""
    return torch.ops.aserve.silu_mul(gate_up)


def rotary_split(qkv, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int):
    """qkv [T, (H + 2 Hkv) D], cos / sin [T, 1, D] (model dtype) -> q [T, H, D], k, v [T, Hkv, D]."""
    return torch.ops.aserve.rotary_split(qkv, cos, sin, num_heads, num_kv_heads, head_dim)


# -- GEMV -----------------------------------------------------------------------------------------------------------


def gemv_supports(weight: torch.Tensor) -> bool:
    """Whether gemv takes this weight (CPU, bf16, contiguous [N, K] with K % 32 == 0 and K <= MAX_GEMV_K, on a CPU
    with AVX512-BF16)."""
    lib = library()
    return (
        lib is not None
        and bool(lib.gemv_bf16_available())
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % 32 == 0
        and weight.shape[1] <= MAX_GEMV_K
    )


def gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (`gemv_supports` holds), x [K] bf16 -> weight @ x [N] bf16."""
    return torch.ops.aserve.gemv(weight, x)


# -- batch-invariant product ---------------------------------------------------------------------------------------


def gemm_rows_supports(weight: torch.Tensor) -> bool:
    """Whether gemm_rows takes this weight (CPU, float32 / bfloat16, [N, K]; the kernels built)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and weight.shape[1] > 0
        and available()
    )


def gemm_rows_prepare(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (`gemm_rows_supports` holds) -> what gemm_rows reads: bf16 packed (a copy), float32 as it is."""
    return torch.ops.aserve.gemm_rows_prepare(weight)


def gemm_rows(prepared: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """prepared: gemm_rows_prepare(weight [n, K]), x [M, K] of its dtype -> x @ weight^T [M, n], each row summed in
    the same order whatever M is."""
    return torch.ops.aserve.gemm_rows(prepared, x, n)


# -- INT8 weight-only products --------------------------------------------------------------------------------------


def gemm_int8_supports(weight: torch.Tensor) -> bool:
    """Whether gemm_int8 takes this weight (CPU, int8, contiguous [N, K] with K <= 16384; the kernels built)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.int8
        and weight.dim() == 2
        and weight.is_contiguous()
        and 0 < weight.shape[1] <= MAX_GEMM_INT8_K
        and available()
    )


def gemm_int8(weight: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, generic: bool = False) -> torch.Tensor:
    """weight int8 [N, K] (`gemm_int8_supports` holds), scale float32 [N], x [M, K] bf16 / float32 -> (x @
    weight^T) * scale [M, N] in x's dtype. `generic`: the portable loops even where the AVX-512 path applies."""
    return torch.ops.aserve.gemm_int8(weight, scale, x, generic)


# -- decode attention -----------------------------------------------------------------------------------------------


def attention_supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention takes these tensors (CPU, float32 / bfloat16 queries over a cache of their dtype
    or float8_e4m3fn, contiguous rows)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and k_cache.is_contiguous()
        and q.stride(-1) == 1
        and q.stride(-2) == q.shape[-1]
        and q.shape[-1] <= MAX_ATTENTION_HEAD_DIM
        and available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float | None = None,
    generic: bool = False,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query token per request: q [n, H, D], caches [num_blocks, block_size, Hkv, D], block_tables [>= n, max]
    int32, seq_lens [>= n] int32 (tokens in the cache, the new one included) -> out[:n] = attention (out [>= n, H,
    D], rows contiguous; scale: D**-0.5 if None). `sliding_window`: the query sees only that many most recent keys,
    and blocks wholly before them are not read; `softcap`: scaled scores s -> softcap * tanh(s / softcap).
    float8_e4m3fn caches: keys read as k_scale * their value, values as v_scale * theirs (other caches: 1.0 only).
    `attention_supports` must hold; ValueError for head shapes the kernel does not take. `generic`: the portable C
    loops even where the AVX-512 path applies (tests, benchmarks)."""
    torch.ops.aserve.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out, scale, generic,
                                            sliding_window or 0, softcap or 0.0, k_scale, v_scale)  # fmt: skip
    return out


# -- greedy pick ----------------------------------------------------------------------------------------------------


def sample_supports(logits: torch.Tensor) -> bool:
    return (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(-1) == 1
        and logits.shape[1] > 0
        and library() is not None
    )


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] -> (index of each row's first maximum int64 [rows], row holds NaN/inf bool [rows]).
    `sample_supports` must hold."""
    return torch.ops.aserve.greedy_pick(logits)
