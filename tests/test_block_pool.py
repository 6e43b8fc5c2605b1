"""Exact expectations for the block pool: allocation order, ref counts, hash hits, LRU eviction."""

import pytest

from aserve.core.block_pool import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(pool):
    return [b.block_id for b in pool.free_block_queue]


def test_allocation_pops_from_head_in_order():
    pool = BlockPool(6)
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]
    assert pool.num_free_blocks == 1
    assert free_ids(pool) == [5]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1  # a failed allocation changes nothing


def test_freed_blocks_go_to_tail_in_given_order():
    pool = BlockPool(5)
    a = pool.get_new_blocks(3)  # 0 1 2
    pool.free_blocks(reversed(a))  # tail first: 2 1 0
    assert free_ids(pool) == [3, 4, 2, 1, 0]
    assert ids(pool.get_new_blocks(3)) == [3, 4, 2]


def test_ref_counts_and_double_free():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    assert b.ref_cnt == 1
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2  # still held by one request
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 3
    with pytest.raises(AssertionError):
        pool.free_blocks([b])


def test_cached_block_is_revived_from_the_middle_of_the_free_list():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)  # 0 1 2
    pool.cache_blocks(blocks[:2], [b"h0", b"h1"])
    pool.free_blocks(reversed(blocks))  # free list: 3 2 1 0
    assert free_ids(pool) == [3, 2, 1, 0]
    hit = pool.get_cached_block(b"h1")
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [3, 2, 0]
    assert pool.get_cached_block(b"h1") is hit  # still cached while in use


def test_lru_eviction_drops_the_hash():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a, b], [b"ha", b"hb"])
    pool.free_blocks([b, a])  # b is least recently freed: evicted first
    (new,) = pool.get_new_blocks(1)
    assert new is b and new.block_hash is None
    assert pool.get_cached_block(b"hb") is None
    assert pool.get_cached_block(b"ha") is a


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a], [b"h"])
    pool.cache_blocks([b], [b"h"])
    assert pool.get_cached_block(b"h") is a and b.block_hash is None


def test_usage_and_reset_prefix_cache():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert pool.usage == 0.5
    pool.cache_blocks(blocks, [b"x", b"y"])
    pool.free_blocks(blocks)
    assert pool.usage == 0.0
    pool.reset_prefix_cache()
    assert pool.get_cached_block(b"x") is None and all(b.block_hash is None for b in pool.blocks)
