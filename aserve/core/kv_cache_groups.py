"""How the attention layers share the KV cache: layers in groups, one block table per group and request.

Most models have one group holding every layer: a block id stands for the same tokens in every layer, and the cache
tensor has one slot per layer. Where every layer slides by the same window W (Mistral, Phi-3), that group gives back
the blocks behind the window (KVCacheManager).

Models that interleave sliding-window and full-attention layers (Gemma 2: one to one; Gemma 3: five sliding to one
full) would, with one table, keep every block of every layer while a request lives, although the sliding layers read
only the last W keys. Here they get a hybrid layout (vLLM's hybrid allocator): the layers split into groups of equal
size G, each group all sliding by one window or all full; the cache tensor has G slots, and the i-th layer of every
group uses slot i. A block id then holds one block of tokens for the G layers of whichever group it was handed to:
the groups share one pool of ids, each request has one table per group, and a sliding group gives back its blocks
behind the window like the uniform case.

    Gemma 3, 48 layers (8 full, 40 sliding by 1024), blocks of 16 tokens, a request of 16,384 tokens:
      one group             48 layers x 1024 blocks                    = 49,152 layer-blocks
      groups of 8 layers    8 layers x (1024 full + 5 x ~66 sliding)   = 10,832 layer-blocks

G is the smallest number of layers of one kind; a kind whose count G does not divide gets a last group with unused
slots (their memory stays idle). The layout is chosen once, when the model is built (plan_kv_groups).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """group_windows[g]: group g's sliding window (None: full attention); layer_groups[i] / layer_slots[i]: the group
    of layer i and its slot in the cache tensor; num_slots: the cache tensor's slots (layers per block id)."""

    group_windows: tuple[int | None, ...]
    layer_groups: tuple[int, ...]
    layer_slots: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1

    @property
    def any_sliding(self) -> bool:
        """Does some group give back blocks (the pool then keeps a null block for their table entries)?"""
        return any(w is not None for w in self.group_windows)


def plan_kv_groups(windows: list[int | None], release_windows: bool = True, hybrid: bool = True) -> KVCacheLayout:
    """The layout for layers with sliding windows `windows` (None: full attention). release_windows=False (a
    draft model keeps its own cache over the same tables): one group that keeps every block. hybrid=False (the
    model's forward, or a drafter, reads one table for all layers): one group, which gives back blocks only when every
    layer slides by the same window."""
    num_layers = len(windows)
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # full attention first
    if not release_windows or (len(kinds) > 1 and not hybrid):
        return _one_group(None, num_layers)
    if len(kinds) == 1:
        return _one_group(kinds[0], num_layers)
    size = min(windows.count(w) for w in kinds)
    group_windows: list[int | None] = []
    layer_groups, layer_slots = [0] * num_layers, [0] * num_layers
    for window in kinds:
        layers = [i for i, w in enumerate(windows) if w == window]
        for start in range(0, len(layers), size):
            for slot, i in enumerate(layers[start : start + size]):
                layer_groups[i], layer_slots[i] = len(group_windows), slot
            group_windows.append(window)
    return KVCacheLayout(tuple(group_windows), tuple(layer_groups), tuple(layer_slots), size)


def _one_group(window: int | None, num_layers: int) -> KVCacheLayout:
    return KVCacheLayout((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)
