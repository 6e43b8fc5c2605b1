"""Chained block hashes for prefix caching.

    hash(block i) = H(hash(block i-1), token ids of block i, extra keys)

so equal hashes mean equal *prefixes*, not just equal blocks. The root of every chain is a random per-process seed:
hashes cannot be predicted (or collided on purpose) from outside the process. Extra keys (e.g. a tenant's cache
salt) go into the root, so different salts never share a block.
"""

from __future__ import annotations

import hashlib
import os
from array import array

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
