"""Triton kernel writing a step's new K/V into the paged cache by slot mapping (slot = block * block_size + offset;
a negative slot marks a padding token, which writes nothing)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl


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
    tl.store(k_cache_ptr + slot * stride_c_slot + offs, tl.load(k_ptr + tok * stride_k_tok + offs, mask=ok), mask=ok)
    tl.store(v_cache_ptr + slot * stride_c_slot + offs, tl.load(v_ptr + tok * stride_v_tok + offs, mask=ok), mask=ok)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
):
    """k/v [T, Hkv, D] (each token's heads contiguous) -> k_cache/v_cache [num_blocks, block_size, Hkv, D]."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(2) == 1 and k.stride(1) == head_dim and v.stride(2) == 1 and v.stride(1) == head_dim
    assert k_cache.is_contiguous() or k_cache.stride(1) == num_kv_heads * head_dim
    row = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), k_cache.stride(1),
        ROW=row, ROW_PAD=triton.next_power_of_2(row), USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(),
    )  # fmt: skip
