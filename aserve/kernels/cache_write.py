"""Triton kernel writing a step's new K/V into the paged cache by slot mapping (slot = block * block_size + offset;
a negative slot marks a padding token, which writes nothing). An FP8 cache (float8_e4m3fn, `--kv-cache-dtype fp8`)
gets x / scale clamped to +-448 and rounded (to_cache; reference: aserve/layers/attention/backend.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl

FP8_MAX = tl.constexpr(448.0)  # a global a Triton kernel reads must be a constexpr object


@triton.jit
def round_e4m3(x):
    """float32 x (|x| <= 448) -> the nearest e4m3 value (ties to even), still float32, so that the cast to e4m3 is
    exact (Triton's interpreter rounds some values just below a power of two down a binade). Normal values keep
    3 mantissa bits (a carry moves into the exponent); below 2^-6 e4m3's subnormals are multiples of 2^-9."""
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -0x100000
    a = tl.abs(x)
    subnormal = ((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # (+ 1.5 * 2^23: rounds to an integer)
    mag = tl.where(a < 0.015625, subnormal.to(tl.int32, bitcast=True), normal)
    return (mag | (bits & -0x80000000)).to(tl.float32, bitcast=True)  # the sign back (-0.0 too)


@triton.jit
def to_cache(x, scale, dtype: tl.constexpr, QUANT: tl.constexpr):
    """A K/V value as the cache holds it: QUANT (an FP8 cache of `dtype`), x / scale clamped to +-448 and rounded to
    nearest even; else x."""
    if QUANT:
        return round_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)).to(dtype)
    else:
        return x


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_v_tok,
    stride_c_slot,
    k_scale,
    v_scale,
    QUANT: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.gdc_sync(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PAD)
    ok = offs < ROW
    dtype = k_cache_ptr.dtype.element_ty
    k = to_cache(tl.load(k_ptr + tok * stride_k_tok + offs, mask=ok), k_scale, dtype, QUANT)
    v = to_cache(tl.load(v_ptr + tok * stride_v_tok + offs, mask=ok), v_scale, dtype, QUANT)
    tl.store(k_cache_ptr + slot * stride_c_slot + offs, k, mask=ok)
    tl.store(v_cache_ptr + slot * stride_c_slot + offs, v, mask=ok)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
):  # fmt: skip
    """k/v [T, Hkv, D] (each token's heads contiguous) -> k_cache/v_cache [num_blocks, block_size, Hkv, D]; a cache of
    another dtype than k's (FP8) is written quantised by k_scale / v_scale."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(2) == 1 and k.stride(1) == head_dim and v.stride(2) == 1 and v.stride(1) == head_dim
    assert k_cache.is_contiguous() or k_cache.stride(1) == num_kv_heads * head_dim
    row = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k_cache.stride(1), k_scale, v_scale,
        QUANT=k_cache.dtype != k.dtype, ROW=row, ROW_PAD=triton.next_power_of_2(row), USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(),
    )  # fmt: skip
