"""The step's inputs in host tensors and the device tensors they are copied to (stable addresses: CUDA graphs read
them)."""

from __future__ import annotations

import torch


class InputBuffers:
    """Host tensors for the largest step (max_num_batched_tokens tokens, max_num_seqs requests), filled by prefix each
    step and copied to device tensors of stable addresses. Slots and block tables have one row per group of layers
    (aserve/core/kv_cache_groups.py)."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device,
                 num_groups: int = 1) -> None:  # fmt: skip
        pin = device.type == "cuda"

        def host_set() -> dict[str, torch.Tensor]:
            def host(*shape, dtype):
                return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

            return {
                "input_ids": host(max_tokens, dtype=torch.int64),
                "positions": host(max_tokens, dtype=torch.int64),
                "slot_mapping": host(num_groups, max_tokens, dtype=torch.int64),
                "query_start_loc": host(max_reqs + 1, dtype=torch.int32),
                "seq_lens": host(max_reqs, dtype=torch.int32),
                "block_tables": host(num_groups, max_reqs, max_blocks, dtype=torch.int32),
                "logits_indices": host(max_tokens, dtype=torch.int64),
            }

        # Two host sets on a GPU (flip() between async steps); on the CPU the "device" tensors are the host ones.
        self._sets = [host_set(), host_set()] if pin else [host_set()]
        self._np = [{k: v.numpy() for k, v in hs.items()} for hs in self._sets]
        self._current = 0
        self.host, self.np = self._sets[0], self._np[0]
        self.device = {k: v.to(device) for k, v in self.host.items()} if device.type != "cpu" else self.host

    def flip(self) -> None:
        """Switches to the other host set: the copies of the step just launched may still read this one."""
        self._current = (self._current + 1) % len(self._sets)
        self.host, self.np = self._sets[self._current], self._np[self._current]

    def to_device(self, name: str, n: int, cols: int | None = None) -> torch.Tensor:
        src, dst = self.host[name], self.device[name]
        if cols is not None:
            src, dst = src[..., :n, :cols], dst[..., :n, :cols]
        else:
            src, dst = src[..., :n], dst[..., :n]
        if dst is not src:
            dst.copy_(src, non_blocking=True)
        return dst
