"""Pure-torch references of the Triton kernels: the slowest, most obvious implementations. Kernel tests compare
against these; the torch attention backend also uses write_kv_cache directly."""

from __future__ import annotations

import torch


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, num_blocks, block_size, Hkv, D]: kv_cache[:, slot] = (k, v) for every token."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q, kv_cache, meta, block_size: int) -> torch.Tensor:
    """The slowest, most obvious implementation (after the cache write): a loop over requests with an explicit
    softmax in float32. Kernels are tested against this."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    for i in range(meta.num_reqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        pos = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = kv_cache[0].view(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        v = kv_cache[1].view(-1, num_kv_heads, head_dim)[slots].float().repeat_interleave(group, dim=1)
        qi = q[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * head_dim**-0.5
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        scores.masked_fill_(q_pos[None, :, None] < pos[None, None, :], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
