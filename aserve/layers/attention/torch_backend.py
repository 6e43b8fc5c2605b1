"""The attention backends in torch: the reference (CPU, or any device) and the CPU backend, which is the reference
with a C decode kernel.

TorchAttentionBackend: requests with short queries (decodes, speculative verification: up to SHORT_QUERY tokens) come
first in the batch and go through one padded SDPA call; every other request gets its own SDPA call over its gathered
context. K/V are gathered whole blocks at a time with index_select (several times faster than per-slot indexing on
CPU), and SDPA gets 4-D inputs (its fused CPU kernel).

A layer's AttentionParams give the scale, a sliding window (each request's blocks are gathered from the one holding
its first visible key; the mask hides the rest; the state for a window is built at its first layer of the step) and
soft-capping (written out as transformers' eager attention computes it, since SDPA has none).

CPUAttentionBackend: the same, with a step's decodes (one query token each) read in place from their cache blocks by
the C kernel of aserve/kernels/cpu.py instead of gathered for SDPA. Chosen where that kernel compiles
(ASERVE_CPU_KERNELS=0: not) and takes the model's dtype and head size.

A quantised KV cache (KVCacheDtype, handed to the backend when it is built): the cache write quantises, each
gathered block is dequantised to the query's dtype, and a prompt without context attends to its fresh K/V rounded
as the cache holds them. CPUAttentionBackend's decode kernel reads FP8 pages in place with the layer's k_scale /
v_scale (the KVCacheDtype's scales(params)); its other requests take the dequantising gather above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from aserve.kernels import cpu
from aserve.layers.attention.backend import (
    AUTO,
    FULL_ATTENTION,
    AttentionBackend,
    AttentionMetadata,
    AttentionParams,
    KVCacheDtype,
)


@dataclass(slots=True)
class TorchAttentionState:
    num_short: int  # the first requests, with queries of at most SHORT_QUERY tokens
    block_size: int
    short_max_q: int = 0
    decode_kernel: bool = False  # the short requests go through a decode kernel instead (CPUAttentionBackend)
    # The padded gather of the short requests (when not decode_kernel): block ids, padded context length, query
    # rows [n, max_q] and which of them are real, mask [n, 1, max_q, L] of the keys each query sees.
    short_blocks: torch.Tensor | None = None
    short_len: int = 0
    short_rows: torch.Tensor | None = None
    short_valid: torch.Tensor | None = None
    short_mask: torch.Tensor | None = None
    # Every other request: (start, end, its block ids or None without context, mask or None for plain causal).
    prefills: list[tuple] = field(default_factory=list)
    # The same for each sliding window a layer asks for (built at its first use in the step): window -> state.
    # Only blocks from the first one a request's window reaches are gathered.
    windowed: dict[int, TorchAttentionState] = field(default_factory=dict)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees (broadcast): causal, and within the window."""
    seen = k_pos <= q_pos
    return seen if window is None else seen & (k_pos > q_pos - window)


def first_block(first_query_pos: int, window: int | None, block_size: int) -> int:
    """The first block a request's keys are read from: the one holding its first query's first visible key."""
    return 0 if window is None else max(first_query_pos - window + 1, 0) // block_size


def attention(q, k, v, mask, params: AttentionParams) -> torch.Tensor:
    """q [B, H, Lq, D], k / v [B, Hkv, Lk, D], mask [.., Lq, Lk] (None: causal, Lq == Lk) -> [B, H, Lq, D], with the
    layer's scale; SDPA, or with soft-capping (which SDPA lacks) transformers' eager attention, op for op."""
    if params.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=params.scale,
                                              enable_gqa=True)  # fmt: skip
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if params.scale is None else params.scale)
    scores = torch.tanh(scores / params.softcap) * params.softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


class TorchAttentionBackend(AttentionBackend):
    SHORT_QUERY = 8

    def __init__(self, kv_cache_dtype: KVCacheDtype = AUTO) -> None:
        self.kv = kv_cache_dtype

    def takes_decode_kernel(self, short_max_q: int) -> bool:
        """Whether this step's short requests go through a decode kernel (_decode_kernel) instead of SDPA."""
        return False

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        meta.state = self._build_state(meta, block_size, None)

    def _state(self, meta: AttentionMetadata, window: int | None) -> TorchAttentionState:
        state: TorchAttentionState = meta.state
        if window is None:
            return state
        if window not in state.windowed:
            state.windowed[window] = self._build_state(meta, state.block_size, window)
        return state.windowed[window]

    def _build_state(self, meta: AttentionMetadata, block_size: int, window: int | None) -> TorchAttentionState:
        device = meta.slot_mapping.device
        qsl = meta.query_start_loc_cpu
        num_short = 0
        while num_short < meta.num_reqs and qsl[num_short + 1] - qsl[num_short] <= self.SHORT_QUERY:
            num_short += 1
        state = TorchAttentionState(num_short, block_size)
        if num_short:
            q_lens = [qsl[i + 1] - qsl[i] for i in range(num_short)]
            state.short_max_q = max(q_lens)
            state.decode_kernel = self.takes_decode_kernel(state.short_max_q)
            if not state.decode_kernel:
                self._short_metadata(meta, state, q_lens, block_size, window)
        for i in range(num_short, meta.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            seq_len = meta.seq_lens_cpu[i]
            q_len = end - start
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
            if seq_len == q_len:  # no context in the cache: attend to the fresh k/v
                mask = None if window is None else visible(q_pos, q_pos.T, window)
                state.prefills.append((start, end, None, mask))
                continue
            first = first_block(seq_len - q_len, window, block_size)
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[i, first:num_blocks].long()
            k_pos = torch.arange(first * block_size, num_blocks * block_size, device=device)
            state.prefills.append((start, end, blocks, visible(q_pos, k_pos.unsqueeze(0), window)))
        return state

    @staticmethod
    def _short_metadata(meta: AttentionMetadata, state: TorchAttentionState, q_lens: list[int], block_size: int,
                        window: int | None) -> None:  # fmt: skip
        """The padded gather of the short requests' blocks (each from its window's first block), their query rows
        and mask (for one SDPA)."""
        device = meta.slot_mapping.device
        num_short = len(q_lens)
        max_q = max(q_lens)
        seq_lens = meta.seq_lens_cpu[:num_short]
        firsts = [first_block(n - q, window, block_size) for n, q in zip(seq_lens, q_lens)]
        num_blocks = max(-(-n // block_size) - f for n, f in zip(seq_lens, firsts))
        first_t = torch.tensor(firsts, device=device).unsqueeze(1)
        cols = (first_t + torch.arange(num_blocks, device=device)).clamp(max=meta.block_tables.shape[1] - 1)
        state.short_blocks = meta.block_tables[:num_short].gather(1, cols).flatten().long()
        state.short_len = num_blocks * block_size
        # Query j of request i sits at position seq_len - q_len + j. Padding rows (j >= q_len) repeat the request's
        # last query and are dropped afterwards.
        j = torch.arange(max_q, device=device)
        q_len_t = torch.tensor(q_lens, device=device)
        starts = meta.query_start_loc[:num_short].long()
        state.short_rows = starts.unsqueeze(1) + torch.minimum(j, q_len_t.unsqueeze(1) - 1)
        state.short_valid = (j < q_len_t.unsqueeze(1)).flatten()
        q_pos = meta.seq_lens[:num_short].long().unsqueeze(1) - q_len_t.unsqueeze(1) + j  # [n, max_q]
        k_pos = first_t * block_size + torch.arange(state.short_len, device=device)  # [n, L]
        state.short_mask = visible(q_pos.unsqueeze(2), k_pos.unsqueeze(1), window).unsqueeze(1)  # [n, 1, max_q, L]

    def _decode_kernel(self, q, k_cache, v_cache, meta: AttentionMetadata, out, params: AttentionParams) -> None:
        """out[:n] <- attention of the first n requests' single query tokens (takes_decode_kernel held)."""
        raise NotImplementedError

    def forward(self, q, k, v, kv_cache, meta, params: AttentionParams = FULL_ATTENTION):
        kv = self.kv
        kv.write(k, v, kv_cache, meta.slot_mapping, params.k_scale, params.v_scale)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
        out = torch.empty_like(q)
        state = self._state(meta, params.sliding_window)
        n = state.num_short
        if n and state.decode_kernel:
            self._decode_kernel(q[:n], k_cache, v_cache, meta, out, params)
        elif n:
            blocks, length = state.short_blocks, state.short_len
            ks = kv.read(k_cache.index_select(0, blocks), params.k_scale, q.dtype)
            vs = kv.read(v_cache.index_select(0, blocks), params.v_scale, q.dtype)
            ks = ks.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
            vs = vs.view(n, length, num_kv_heads, head_dim).transpose(1, 2)
            rows = state.short_rows
            if state.short_max_q == 1:  # decodes only: the rows are the first n tokens
                qs = q[:n].unsqueeze(2)
            else:
                qs = q[rows.flatten()].view(n, -1, q.shape[1], head_dim).transpose(1, 2)  # [n, H, max_q, D]
            o = attention(qs, ks, vs, state.short_mask, params)
            o = o.transpose(1, 2).reshape(-1, q.shape[1], head_dim)
            if state.short_max_q == 1:
                out[:n] = o
            else:
                valid = state.short_valid
                out[rows.flatten()[valid]] = o[valid]
        for start, end, blocks, mask in state.prefills:
            qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if blocks is None:
                kp = kv.round_trip(k[start:end], params.k_scale).transpose(0, 1).unsqueeze(0)
                vp = kv.round_trip(v[start:end], params.v_scale).transpose(0, 1).unsqueeze(0)
            else:
                kp = kv.read(k_cache.index_select(0, blocks), params.k_scale, q.dtype)
                vp = kv.read(v_cache.index_select(0, blocks), params.v_scale, q.dtype)
                kp = kp.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
                vp = vp.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
            out[start:end] = attention(qp, kp, vp, mask, params)[0].transpose(0, 1)
        return out


class CPUAttentionBackend(TorchAttentionBackend):
    """The torch backend with the decodes on the C kernel (see the module docstring)."""

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in (torch.float32, torch.bfloat16) and head_dim <= cpu.MAX_ATTENTION_HEAD_DIM and cpu.available()

    def takes_decode_kernel(self, short_max_q: int) -> bool:
        return short_max_q == 1  # decodes only (speculative verification's short queries stay on SDPA)

    def _decode_kernel(self, q, k_cache, v_cache, meta: AttentionMetadata, out, params: AttentionParams) -> None:
        # q rows are contiguous: every split_rotate_qkv implementation returns a fresh [T, H, D]
        k_scale, v_scale = self.kv.scales(params)
        cpu.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, out, params.scale,
                                   sliding_window=params.sliding_window, softcap=params.softcap, k_scale=k_scale,
                                   v_scale=v_scale)  # fmt: skip
