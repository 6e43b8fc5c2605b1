"""Attention over a flat batch with a paged KV cache (backend.py: the step's metadata and the backend interface;
torch_backend.py: the torch reference and the CPU backend; triton_backend.py: the GPU backend).

The backend is chosen once at engine start, by select_attention_backend (the `attention_backend` engine argument):

auto     Triton on a GPU; on CPU the C decode kernel's backend where it compiles, else the torch reference
torch    the torch reference (on CPU, with the C decode kernel where it compiles)
triton   Triton (on CPU tensors too, through Triton's interpreter: tests)

Deterministic mode (`deterministic`) takes a batch-invariant backend instead: triton_batch_invariant.py on a GPU (or
with `triton`), batch_invariant.py on CPU (every query token on the C decode kernel).

A quantised KV cache (`kv_cache_dtype` fp8: backend.py) is read by every backend above: on CPU the C decode kernel
reads FP8 pages in place, and prompts dequantise the blocks they gather (one log line says so); deterministic mode's
backends cannot read it, and refuse it at start.
"""

from __future__ import annotations

import logging

import torch

from aserve.kernels import cpu
from aserve.layers.attention.backend import AUTO, AttentionBackend, KVCacheDtype
from aserve.layers.attention.batch_invariant import BatchInvariantCPUAttentionBackend
from aserve.layers.attention.torch_backend import CPUAttentionBackend, TorchAttentionBackend

logger = logging.getLogger("aserve")


def select_attention_backend(name: str, hf_config, dtype: torch.dtype, max_num_seqs: int, device: torch.device,
                             deterministic: bool = False, max_model_len: int = 0,
                             kv_cache_dtype: KVCacheDtype = AUTO) -> AttentionBackend:  # fmt: skip
    """`deterministic` (deterministic mode): a batch-invariant backend, triton_batch_invariant.py on a GPU or with
    `triton` (its split-KV segments sized from `max_model_len`), else batch_invariant.py on CPU. `kv_cache_dtype`:
    the KV cache's element type, which the backend reads and writes."""
    num_heads, num_kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    if deterministic and kv_cache_dtype.quantized:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype.name!r} cannot run in deterministic mode: its "
                         "batch-invariant attention reads only an unquantised KV cache (use auto)")  # fmt: skip
    if deterministic:
        return _batch_invariant_backend(name, num_heads, num_kv_heads, head_dim, dtype, max_num_seqs, device,
                                        max_model_len)  # fmt: skip
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from aserve.layers.attention.triton_backend import TritonAttentionBackend  # Triton: optional

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, max_num_seqs, device, kv_cache_dtype)
    if device.type == "cpu" and CPUAttentionBackend.supports(dtype, head_dim):
        if kv_cache_dtype.quantized:
            logger.info("%s KV cache on CPU: decodes read it in place on the C decode kernel, prompts through the "
                        "torch backend's dequantised gather", kv_cache_dtype.name)  # fmt: skip
        return CPUAttentionBackend(kv_cache_dtype)
    return TorchAttentionBackend(kv_cache_dtype)


def _batch_invariant_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             max_num_seqs: int, device: torch.device, max_model_len: int):  # fmt: skip
    if name == "triton" or device.type == "cuda":  # on a GPU, the Triton backend whatever the name
        from aserve.layers.attention.triton_batch_invariant import BatchInvariantTritonAttentionBackend  # Triton

        return BatchInvariantTritonAttentionBackend(num_heads, num_kv_heads, head_dim, max_num_seqs, max_model_len,
                                                    device)  # fmt: skip
    if device.type == "cpu" and CPUAttentionBackend.supports(dtype, head_dim):
        return BatchInvariantCPUAttentionBackend()
    raise ValueError(f"deterministic mode on CPU needs aserve's C kernels (a C++ compiler and ninja; "
                     f"ASERVE_CPU_KERNELS not 0), a float32 / bfloat16 model and head_dim <= "
                     f"{cpu.MAX_ATTENTION_HEAD_DIM}; attention backend {name!r}, {dtype}, head_dim {head_dim} on "
                     f"{device}")  # fmt: skip
