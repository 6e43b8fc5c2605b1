"""The pool of KV cache blocks: ref counts, an O(1) free list in LRU order, and the prefix-cache map.

A block is in exactly one of three states:

    in use      ref_cnt > 0, not in the free list (it may also be cached: shared by prefix hits)
    cached      ref_cnt == 0, in the free list, still findable by hash until evicted
    free        ref_cnt == 0, in the free list, no hash

Allocation pops from the head of the free list (least recently freed first); a cached block popped there loses its
hash (eviction). A prefix hit on a cached block takes it out of the middle of the list in O(1), which is why blocks
carry their own prev/next links.

Cached blocks are found by chained block hashes (BlockHasher):

    hash(block i) = H(hash(block i-1), token ids of block i, extra keys)

so equal hashes mean equal *prefixes*, not just equal blocks. The root of every chain is a random per-process seed:
hashes cannot be predicted (or collided on purpose) from outside the process. Extra keys (e.g. a tenant's cache
salt) go into the root, so different salts never share a block.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Iterable

_PROCESS_SEED = os.urandom(16)


class BlockHasher:
    def __init__(self, block_size: int, extra_key: str | None = None) -> None:
        self.block_size = block_size
        root = hashlib.blake2b(_PROCESS_SEED, digest_size=16)
        if extra_key is not None:
            root.update(b"salt:" + extra_key.encode())
        self.root = root.digest()

    def extend(self, block_hashes: list[bytes], token_ids: list[int]) -> None:
        """Appends hashes for every full block of `token_ids` not yet in `block_hashes`."""
        bs = self.block_size
        parent = block_hashes[-1] if block_hashes else self.root
        for start in range(len(block_hashes) * bs, len(token_ids) - bs + 1, bs):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(array("q", token_ids[start : start + bs]).tobytes())
            parent = h.digest()
            block_hashes.append(parent)


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; popleft, append and remove are O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not in the free list"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """`num_blocks` blocks in circulation. `null_block`: one more, block 0, kept out of circulation (never handed
    out, so no request writes it; the KV cache holds num_blocks + 1 blocks): a request's block table points
    there for the blocks it has given back (KVCacheManager's sliding-window freeing), so attention kernels may read
    it, always masked."""

    def __init__(self, num_blocks: int, null_block: bool = False) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks + int(null_block))]
        self.null_block = self.blocks[0] if null_block else None
        self.free_block_queue = FreeBlockQueue(self.blocks[int(null_block) :])
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached-evictable)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-evictable blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-hit blocks, reviving cached-evictable ones from the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes]) -> None:
        """Registers full blocks under their prefix hashes so later requests can share them."""
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None:
                assert block.block_hash == block_hash
                continue
            if block_hash in self.cached_blocks:
                continue  # an equal block was computed concurrently; keep the first one
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; unreferenced blocks go to the tail of the free list in the given
        order, so the first of them is the first evicted."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forgets the hashes of blocks whose contents cannot be trusted (e.g. a failed step)."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached_blocks.values()):
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
