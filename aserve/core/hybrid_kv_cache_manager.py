"""The KV cache of a hybrid layout (aserve/core/kv_cache_groups.py): one KVCacheManager per group of layers, all
handing out ids of one BlockPool, behind the interface the scheduler uses for one.

A request's step needs blocks in every group at once: allocate_slots counts what all groups take before any of them
takes a block, so an allocation either succeeds in every group or changes nothing (but the blocks behind a window
that each sliding group gives back first).

Prefix-cache hits must hold in every group for the same number of tokens. A full-attention group serves any prefix
of its cached blocks; a sliding group serves n blocks when those its window reads for the query after them are
cached (earlier ones may have been evicted). The hit is the largest n all groups serve: the full groups bound it,
then each sliding group lowers it to what it serves until none does.
"""

from __future__ import annotations

from aserve.core.block_pool import BlockPool, KVCacheBlock
from aserve.core.kv_cache_manager import InvariantError, KVCacheManager, PrefixCacheStats, check_pool
from aserve.core.request import Request


class HybridKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, group_windows: tuple[int | None, ...]) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, null_block=any(w is not None for w in group_windows))
        self.groups = [KVCacheManager(num_blocks, block_size, window, self.pool, group)
                       for group, window in enumerate(group_windows)]  # fmt: skip
        self.full_groups = [g for g in self.groups if g.sliding_window is None]
        self.sliding_groups = [g for g in self.groups if g.sliding_window is not None]
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Each request's blocks in all groups (a new dict: for checks and statistics)."""
        held: dict[str, list[KVCacheBlock]] = {}
        for group in self.groups:
            for request_id, blocks in group.req_to_blocks.items():
                held.setdefault(request_id, []).extend(blocks)
        return held

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """-> (each group's blocks of the longest prefix every group serves from the cache, its tokens)."""
        if request.hasher is None:
            return (), 0
        hashes = request.block_hashes
        n = (request.num_tokens - 1) // self.block_size  # the last token is never served: its logits are needed
        for group in self.full_groups:
            n = group.longest_hit(hashes, n)
        lowered = True
        while lowered and n:
            lowered = False
            for group in self.sliding_groups:
                m = group.longest_hit(hashes, n)
                lowered, n = lowered or m < n, m
        if request.num_preemptions == 0:
            self.stats.queries += request.num_tokens
            self.stats.hits += n * self.block_size
        if n == 0:
            return (), 0
        return tuple(group.hit_blocks(hashes, n) for group in self.groups), n * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: tuple[list[KVCacheBlock], ...] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[list[KVCacheBlock]] | None:
        """KVCacheManager.allocate_slots in every group (`new_computed_blocks`: get_computed_blocks' per group, or
        empty) -> each group's new blocks, or None where the pool cannot supply all of them."""
        hits = new_computed_blocks or ([],) * len(self.groups)
        args = (num_new_tokens,)
        needed = sum(g.blocks_needed(request, *args, h, num_lookahead_tokens) for g, h in zip(self.groups, hits))
        if needed > self.pool.num_free_blocks:
            return None
        for group, h in zip(self.groups, hits):  # every hit first: take() hands out free blocks, a hit revives some
            group.add_hits(request, h)
        return [g.take(request, *args, len(h), num_lookahead_tokens) for g, h in zip(self.groups, hits)]

    def free(self, request: Request) -> None:
        for group in self.groups:
            group.free(request)

    def forget_uncomputed(self, request: Request, num_valid_tokens: int) -> None:
        for group in self.groups:
            group.forget_uncomputed(request, num_valid_tokens)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids in each group (live lists: read them before the next allocation)."""
        return tuple(group.block_ids(request_id) for group in self.groups)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_invariants(self, live_requests: list[Request]) -> None:
        """KVCacheManager.check_invariants over every group (a block is held in one group at a time)."""
        expected = [0] * len(self.pool.blocks)
        live = {r.request_id: r for r in live_requests}
        for group in self.groups:
            before = list(expected)
            group.count_references(live, expected)
            shared = [i for i, (b, e) in enumerate(zip(before, expected)) if b and e > b]
            if shared:
                raise InvariantError(f"blocks {shared} are held in two groups of layers at once")
        check_pool(self.pool, expected)
