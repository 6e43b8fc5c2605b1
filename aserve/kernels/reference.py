"""Pure-torch references of the Triton kernels: the slowest, most obvious implementations. Kernel tests compare
against these. (The cache write's reference is the torch backends' own: aserve/layers/attention/backend.py
write_kv_cache.)"""

from __future__ import annotations

import torch


def paged_attention(q, kv_cache, meta, block_size: int, scale: float | None = None, sliding_window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """The slowest, most obvious implementation (after the cache write): a loop over requests with an explicit
    softmax in float32. Kernels are tested against this. `scale`: of q . k (None: head_dim ** -0.5); `sliding_window`:
    a query at position p sees keys p - sliding_window < k <= p (None: all k <= p); `softcap`: scaled scores become
    softcap * tanh(score / softcap)."""
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
        scores = torch.einsum("qhd,khd->hqk", qi, k) * (head_dim**-0.5 if scale is None else scale)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        hidden = q_pos[None, :, None] < pos[None, None, :]
        if sliding_window is not None:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-experts routing as transformers' Mixtral / Qwen3-MoE routers: softmax over all experts in
    float32, the top_k, renormalised to sum to 1 where asked. -> (float32 weights [T, top_k], expert ids [T, top_k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(x, w13, w2, topk_weights, topk_ids, round_activations=None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; each token's experts and weights [T, k]
    -> sum over its experts of weight * w2[e] (silu(gate) * up), in float32 one token and expert at a time.
    round_activations: each projection's input row (x[t], then silu(gate) * up in x's dtype) through it first
    (FP8 experts' per-row e4m3 rounding of their activations)."""
    rnd = round_activations or (lambda row: row)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for weight, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate, up = (w13[e].float() @ rnd(x[t : t + 1])[0].float()).chunk(2)
            act = (torch.nn.functional.silu(gate) * up)[None]
            act = rnd(act.to(x.dtype)) if round_activations else act
            out[t] += weight * (w2[e].float() @ act[0].float())
    return out.to(x.dtype)
