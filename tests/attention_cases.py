"""Random ragged paged-attention batches, shared by the torch-backend tests and the kernel tests."""

import torch

from aserve.layers.attention.backend import AttentionMetadata


def random_batch(
    q_lens,
    ctx_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    num_blocks,
    dtype=torch.float32,
    seed=0,
    device="cpu",
):
    """Requests with q_lens[i] new tokens after ctx_lens[i] cached ones; decodes (q_len 1) must come first.
    Block tables are random permutations of the pool. Returns (q, k, v, kv_cache, meta)."""
    gen = torch.Generator().manual_seed(seed)
    assert all(a == 1 for a in q_lens[: sum(1 for x in q_lens if x == 1)]), "decodes first"
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    assert sum(blocks_per_req) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_req)
    tables = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    slot_mapping = []
    used = 0
    for i, (nb, ctx, ql) in enumerate(zip(blocks_per_req, ctx_lens, q_lens)):
        ids = perm[used : used + nb]
        used += nb
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(ctx, ctx + ql):
            slot_mapping.append(ids[pos // block_size] * block_size + pos % block_size)
    T = sum(q_lens)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(T, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        num_tokens=T,
        num_decodes=sum(1 for x in q_lens if x == 1),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
    )
    return q.to(device), k.to(device), v.to(device), kv_cache.to(device), meta


def poison_outside_window(kv_cache, meta, block_size, window):
    """A copy of kv_cache with NaN in every block that lies wholly before the window of each request's first query
    token: a kernel that reads such a block (even masked, NaN * 0 is NaN) gives NaN."""
    poisoned = kv_cache.clone()
    for i in range(meta.num_reqs):
        first_pos = meta.seq_lens_cpu[i] - (meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i])
        for b in range(max(first_pos - window + 1, 0) // block_size):
            poisoned[:, int(meta.block_tables[i, b])] = float("nan")
    return poisoned
