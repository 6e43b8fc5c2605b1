"""The reference attention backend in plain torch (CPU, or any device)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aserve.kernels.reference import write_kv_cache
from aserve.layers.attention.backend import AttentionBackend
from aserve.layers.attention.metadata import AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    """Reference backend in plain torch (CPU, or any device). Requests with short queries (decodes, speculative
    verification: up to SHORT_QUERY tokens) come first in the batch and go through one padded SDPA call; every
    other request gets its own SDPA call over its gathered context. K/V are gathered whole blocks at a time with
    index_select (several times faster than per-slot indexing on CPU), and SDPA gets 4-D inputs (its fused CPU
    kernel). On CPU, a batch's decodes (one query token each) skip the gather: aserve/kernels/cpu_attention.py reads
    their blocks in place (DECODE_KERNEL; ASERVE_CPU_KERNELS=0 turns it off)."""

    SHORT_QUERY = 8
    DECODE_KERNEL = (
        True  # CPU: decode-only short batches through aserve/kernels/cpu_attention.py (reads blocks in place)
    )

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        device = meta.slot_mapping.device
        data = meta.backend_data
        qsl = meta.query_start_loc_cpu
        num_short = 0
        while num_short < meta.num_reqs and qsl[num_short + 1] - qsl[num_short] <= self.SHORT_QUERY:
            num_short += 1
        data["num_short"] = num_short
        data["block_size"] = block_size
        data["decode_kernel"] = False
        if num_short:
            q_lens = [qsl[i + 1] - qsl[i] for i in range(num_short)]
            data["short_max_q"] = max(q_lens)
            if data["short_max_q"] == 1 and self.DECODE_KERNEL and device.type == "cpu":
                from aserve.kernels import cpu_attention

                data["decode_kernel"] = cpu_attention.available()
            if not data["decode_kernel"]:
                self._short_metadata(meta, q_lens)
        prefills = []
        for i in range(num_short, meta.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            seq_len = meta.seq_lens_cpu[i]
            q_len = end - start
            if seq_len == q_len:  # no context in the cache: attend to the fresh k/v
                prefills.append((start, end, None, None))
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[i, :num_blocks].long()
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            k_pos = torch.arange(num_blocks * block_size, device=device)
            mask = q_pos.unsqueeze(1) >= k_pos.unsqueeze(0)  # [q_len, padded seq_len]
            prefills.append((start, end, blocks, mask))
        data["prefills"] = prefills

    @staticmethod
    def _short_metadata(meta: AttentionMetadata, q_lens: list[int]) -> None:
        """The padded gather of the short requests' blocks, their query rows and causal mask (for one SDPA)."""
        data, device, block_size = meta.backend_data, meta.slot_mapping.device, meta.backend_data["block_size"]
        num_short = len(q_lens)
        max_q = max(q_lens)
        max_len = max(meta.seq_lens_cpu[:num_short])
        num_blocks = -(-max_len // block_size)
        data["short_blocks"] = meta.block_tables[:num_short, :num_blocks].flatten().long()
        data["short_len"] = num_blocks * block_size
        # Query j of request i sits at position seq_len - q_len + j and sees keys up to there. Padding rows
        # (j >= q_len) repeat the request's last query and are dropped afterwards.
        j = torch.arange(max_q, device=device)
        q_len_t = torch.tensor(q_lens, device=device)
        starts = meta.query_start_loc[:num_short].long()
        data["short_rows"] = starts.unsqueeze(1) + torch.minimum(j, q_len_t.unsqueeze(1) - 1)
        data["short_valid"] = (j < q_len_t.unsqueeze(1)).flatten()
        q_pos = meta.seq_lens[:num_short].long().unsqueeze(1) - q_len_t.unsqueeze(1) + j  # [n, max_q]
        k_pos = torch.arange(num_blocks * block_size, device=device)
        data["short_mask"] = (k_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)).unsqueeze(1)  # [n, 1, max_q, L]

    def forward(self, q, k, v, kv_cache, meta):
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
        out = torch.empty_like(q)
        data = meta.backend_data
        n = data["num_short"]
        if n and data["decode_kernel"]:
            from aserve.kernels import cpu_attention

            if cpu_attention.supports(q, k_cache):
                cpu_attention.paged_decode_attention(q[:n], k_cache, v_cache, meta.block_tables, meta.seq_lens, out)
            else:  # (a dtype the kernel does not take: the SDPA path, prepared now)
                data["decode_kernel"] = False
                self._short_metadata(meta, [1] * n)
        if n and not data["decode_kernel"]:
            blocks, length = data["short_blocks"], data["short_len"]
            ks = k_cache.index_select(0, blocks).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
            vs = v_cache.index_select(0, blocks).view(n, length, num_kv_heads, head_dim).transpose(1, 2)
            rows = data["short_rows"]
            if data["short_max_q"] == 1:  # decodes only: the rows are the first n tokens
                qs = q[:n].unsqueeze(2)
            else:
                qs = q[rows.flatten()].view(n, -1, q.shape[1], head_dim).transpose(1, 2)  # [n, H, max_q, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=data["short_mask"], enable_gqa=True)
            o = o.transpose(1, 2).reshape(-1, q.shape[1], head_dim)
            if data["short_max_q"] == 1:
                out[:n] = o
            else:
                valid = data["short_valid"]
                out[rows.flatten()[valid]] = o[valid]
        for start, end, blocks, mask in data["prefills"]:
            qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if blocks is None:
                kp = k[start:end].transpose(0, 1).unsqueeze(0)
                vp = v[start:end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                kp = k_cache.index_select(0, blocks).view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
                vp = v_cache.index_select(0, blocks).view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out
