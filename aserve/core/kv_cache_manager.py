"""Maps requests to KV cache blocks: prefix-cache lookups, slot allocation, freeing.

A request's blocks cover its tokens in order (block i holds tokens [i*bs, (i+1)*bs)). Its first blocks may be
shared with other requests through the prefix cache; blocks are registered in the cache as soon as they are fully
scheduled, so a request scheduled later in the same step can already share them: each layer writes the step's new
K/V into the cache before any attention reads it.

With `sliding_window` W (every attention layer slides by W: Mistral, Phi-3), a query at position p reads keys after
p - W only; before each allocation a request gives back the blocks wholly before its next query's window (their K/V
stay findable by the prefix cache until evicted), and its block table points those entries at the pool's null block.
So a long sequence holds about W / bs + 2 blocks. A prefix hit then needs only the blocks the window of its next
query reads (earlier ones may be evicted): the request's table points at the null block before them.

A manager serves one group of layers (aserve/core/kv_cache_groups.py): every layer of most models; with a hybrid
layout (sliding and full-attention layers interleaved: Gemma 2/3) one group, beside the others on a shared pool
(aserve/core/hybrid_kv_cache_manager.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from aserve.core.block_pool import BlockPool, KVCacheBlock
from aserve.core.request import Request, RequestStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    """One group of layers' blocks (aserve/core/kv_cache_groups.py): the whole cache of most models, or one group
    of a hybrid layout, where the groups share `pool` and `group` keeps their prefix-cache entries apart."""

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int | None = None,
                 pool: BlockPool | None = None, group: int = 0) -> None:  # fmt: skip
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.pool = pool if pool is not None else BlockPool(num_blocks, null_block=sliding_window is not None)
        self.key_suffix = bytes([group]) if group else b""  # appended to block hashes in the pool's map
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}  # the same, as ids, kept in step (read every step)
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are registered by hash
        self.num_released: dict[str, int] = {}  # how many of a request's first blocks went back (sliding window)
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`, as (blocks, number of tokens). The last token of the request is
        never served from the cache: its logits are needed."""
        if request.hasher is None:
            return [], 0
        num_blocks = self.longest_hit(request.block_hashes, (request.num_tokens - 1) // self.block_size)
        num_hit_tokens = num_blocks * self.block_size
        if request.num_preemptions == 0:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens
        return self.hit_blocks(request.block_hashes, num_blocks), num_hit_tokens

    def longest_hit(self, block_hashes: list[bytes], max_blocks: int) -> int:
        """The most blocks n <= max_blocks such that a request's first n blocks can come from the cache: all of
        them, or with a sliding window only those the window of the query after them reads (the last ones)."""
        cached = self.pool.cached_blocks
        if self.sliding_window is None:
            n = 0
            while n < max_blocks and block_hashes[n] + self.key_suffix in cached:
                n += 1
            return n
        end = max_blocks  # blocks [i, end) are all cached
        for i in range(max_blocks - 1, -1, -1):
            if block_hashes[i] + self.key_suffix not in cached:
                end = i
            elif i <= self._first_needed(end * self.block_size):
                return end
        return 0

    def hit_blocks(self, block_hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock]:
        """The cached blocks of a hit of `num_blocks` (longest_hit), the null block for those a window skips."""
        first = 0 if self.sliding_window is None else self._first_needed(num_blocks * self.block_size)
        cached, suffix = self.pool.cached_blocks, self.key_suffix
        return [self.pool.null_block] * first + [cached[h + suffix] for h in block_hashes[first:num_blocks]]

    def _first_needed(self, position: int) -> int:
        """The first block the query at `position` reads under the sliding window (keys after position - W)."""
        return max(0, (position - self.sliding_window + 1) // self.block_size)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones (plus the prefix hits in
        `new_computed_blocks`, which the request takes references on). Returns the newly allocated blocks, or None
        when the pool cannot supply them — then nothing has changed but blocks behind a window given back."""
        if not new_computed_blocks and self.sliding_window is None:
            # A running request whose blocks already hold the new tokens (most decode steps): nothing to take.
            blocks = self.req_to_blocks.get(request.request_id)
            if blocks and self._num_required(request, num_new_tokens, 0, num_lookahead_tokens) <= len(blocks):
                if request.hasher is not None:
                    self._cache_full_blocks(request, blocks, 0, num_new_tokens)
                return []
        new_computed_blocks = new_computed_blocks or []
        if self.blocks_needed(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens) > (
            self.pool.num_free_blocks
        ):
            return None
        self.add_hits(request, new_computed_blocks)
        return self.take(request, num_new_tokens, len(new_computed_blocks), num_lookahead_tokens)

    def blocks_needed(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock],
                      num_lookahead_tokens: int) -> int:  # fmt: skip
        """Free blocks that allocate_slots with these arguments takes (new ones, and cached prefix hits revived from
        the free list), after giving back the request's blocks behind its window."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        if self.sliding_window is not None and blocks:
            self._release_outside_window(request, blocks)
        null = self.pool.null_block
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not null)
        num_held = len(blocks) + len(new_computed_blocks)
        num_required = self._num_required(request, num_new_tokens, len(new_computed_blocks), num_lookahead_tokens)
        return max(num_required - num_held, 0) + revived

    def _num_required(self, request: Request, num_new_tokens: int, num_hit_blocks: int,
                      num_lookahead_tokens: int) -> int:  # fmt: skip
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        return cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)

    def add_hits(self, request: Request, new_computed_blocks: list[KVCacheBlock]) -> None:
        """A new request takes its prefix hit (get_computed_blocks): references on the cached blocks, the null
        block's entries first where a window skips blocks. Before take(): a hit may revive a block from the free
        list, which take() must not hand out as a new one."""
        if not new_computed_blocks:
            return
        request_id = request.request_id
        null = self.pool.null_block
        skipped = sum(1 for b in new_computed_blocks if b is null)
        if skipped:
            self.num_released[request_id] = skipped
        self.pool.touch(new_computed_blocks[skipped:])
        self.req_to_blocks.setdefault(request_id, []).extend(new_computed_blocks)
        self.req_to_block_ids.setdefault(request_id, []).extend(b.block_id for b in new_computed_blocks)
        self.num_cached_blocks[request_id] = len(new_computed_blocks)

    def take(self, request: Request, num_new_tokens: int, num_hit_blocks: int,
             num_lookahead_tokens: int) -> list[KVCacheBlock]:  # fmt: skip
        """allocate_slots' new blocks, once blocks_needed fit in the pool and add_hits took the hit (of
        `num_hit_blocks`) -> the new blocks."""
        request_id = request.request_id
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_required = self._num_required(request, num_new_tokens, num_hit_blocks, num_lookahead_tokens)
        new_blocks = self.pool.get_new_blocks(max(num_required - len(blocks), 0))
        blocks.extend(new_blocks)
        self.req_to_block_ids.setdefault(request_id, []).extend(b.block_id for b in new_blocks)

        if request.hasher is not None:
            self._cache_full_blocks(request, blocks, num_hit_blocks, num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_hit_blocks: int,
                           num_new_tokens: int) -> None:  # fmt: skip
        """Registers the request's blocks that become full of known tokens once this step is computed."""
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full > num_cached:
            suffix = self.key_suffix
            hashes = request.block_hashes[num_cached:num_full]
            self.pool.cache_blocks(blocks[num_cached:num_full], [h + suffix for h in hashes] if suffix else hashes)
            self.num_cached_blocks[request.request_id] = num_full

    def _release_outside_window(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """Gives back the request's blocks wholly before the window of its next query (position
        num_computed_tokens, which reads keys from num_computed_tokens - W + 1 on)."""
        first_needed = (request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        start = self.num_released.get(request.request_id, 0)
        if first_needed <= start:
            return
        null, block_ids = self.pool.null_block, self.req_to_block_ids[request.request_id]
        released = blocks[start:first_needed]
        blocks[start:first_needed] = [null] * len(released)
        block_ids[start:first_needed] = [null.block_id] * len(released)
        self.num_released[request.request_id] = first_needed
        self.pool.free_blocks(reversed(released))

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first: its last blocks are the first to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        start = self.num_released.pop(request.request_id, 0)  # the null block's entries
        self.pool.free_blocks(reversed(blocks[start:]))

    def forget_uncomputed(self, request: Request, num_valid_tokens: int) -> None:
        """A step that was to compute `request` failed: only its first `num_valid_tokens` tokens have KV. Drop the
        cache entries of the blocks after them."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        first_uncomputed = max(num_valid_tokens // self.block_size, self.num_released.get(request.request_id, 0))
        self.pool.uncache_blocks(blocks[first_uncomputed:])
        self.num_cached_blocks[request.request_id] = min(
            self.num_cached_blocks.get(request.request_id, 0), first_uncomputed
        )

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in order. The live list (appended to as the request grows): read it before the
        next allocation."""
        return self.req_to_block_ids.get(request_id, [])

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """block_ids for each group of layers (here one: HybridKVCacheManager has more)."""
        return (self.req_to_block_ids.get(request_id, []),)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_invariants(self, live_requests: list[Request]) -> None:
        """For `debug_invariants`: raises InvariantError unless every block's ref count equals the number of live
        requests holding it, a block is in the free list exactly when nobody holds it, waiting requests hold
        nothing, running ones hold blocks for every computed token, and the prefix-cache map and the blocks' hashes
        agree. Explicit checks rather than asserts, so that they also run under `python -O`."""
        expected = [0] * len(self.pool.blocks)
        self.count_references({r.request_id: r for r in live_requests}, expected)
        check_pool(self.pool, expected)

    def count_references(self, live: dict[str, Request], expected: list[int]) -> None:
        """check_invariants' checks of this group's requests; adds the references they hold to `expected`."""
        if dead := set(self.req_to_blocks) - set(live):
            raise InvariantError(f"KV blocks held by requests that are no longer live: {sorted(dead)}")
        for request_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            if self.req_to_block_ids.get(request_id) != ids:
                raise InvariantError(f"request {request_id!r}: block ids {self.req_to_block_ids.get(request_id)} "
                                     f"!= its blocks {ids}")  # fmt: skip
            released = self.num_released.get(request_id, 0)
            if any(b is not self.pool.null_block for b in blocks[:released]):
                raise InvariantError(f"request {request_id!r}: its first {released} blocks went back, yet {ids}")
            blocks = blocks[released:]
            ids = ids[released:]
            if len(set(ids)) != len(ids) or (self.pool.null_block is not None and 0 in ids):
                raise InvariantError(f"request {request_id!r} holds a block twice (or the null block): {ids}")
            request = live[request_id]
            if request.status != RequestStatus.RUNNING and blocks:
                raise InvariantError(f"{request} is not running but holds blocks {ids}")
            if (len(blocks) + released) * self.block_size < request.num_computed_tokens:
                raise InvariantError(f"{request} holds {len(blocks)} blocks, too few for its computed tokens")
            for b in blocks:
                expected[b.block_id] += 1


def check_pool(pool: BlockPool, expected: list[int]) -> None:
    """check_invariants' checks of the pool, given the references live requests hold on each block."""
    in_free = {b.block_id for b in pool.free_block_queue}
    if len(in_free) != pool.num_free_blocks:
        raise InvariantError(f"the free list holds {len(in_free)} blocks but counts {pool.num_free_blocks}")
    cached = pool.cached_blocks
    for block in pool.blocks:
        if block is pool.null_block:
            if block.ref_cnt or block.block_id in in_free or block.block_hash is not None:
                raise InvariantError(f"the null block is in use: {block}")
            continue
        refs = expected[block.block_id]
        if block.ref_cnt != refs:
            raise InvariantError(f"{block}: ref_cnt is {block.ref_cnt} but {refs} live request(s) hold it "
                                 "(a leaked or lost reference)")  # fmt: skip
        if (refs == 0) != (block.block_id in in_free):
            where = "in" if block.block_id in in_free else "not in"
            raise InvariantError(f"{block} is {where} the free list while {refs} live request(s) hold it")
        if block.block_hash is not None and cached.get(block.block_hash) is not block:
            raise InvariantError(f"{block} has a hash under which the prefix-cache map holds another block")
    for h, block in cached.items():
        if block.block_hash != h:
            raise InvariantError(f"the prefix-cache map holds {block} under a hash it does not have")


class InvariantError(AssertionError):
    """The engine's bookkeeping is inconsistent (a bug in aserve, not a bad request); raised by `debug_invariants`."""
