"""A model drafter's tokens on their way to the host (aserve/worker/drafter.py).

One propose() drafts [k_max, requests] token ids on the device; PendingDrafts copies them to the host without
waiting, and each request's DraftTokens knows its length at once. The verification step's inputs take the values on
the device (`device_source`, ModelRunner); anything on the host that reads a value waits for the copy, once per
propose().
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aserve.worker.sampler import copy_to_host


class PendingDrafts:
    """One propose()'s draft tokens [k_max, n] on their way to the host: on a GPU a copy into pinned memory that
    does not wait for the device, and an event the first reader waits on."""

    def __init__(self, chosen: torch.Tensor, exits: torch.Tensor | None = None) -> None:
        self.tokens = chosen  # on the device
        self.exits = exits  # layer_skip: the drafting's hidden states [passes, n, hidden] (drafter.py)
        (self._host,), self._event = copy_to_host(chosen)
        self._rows: list[list[int]] | None = None

    def row(self, row: int) -> list[int]:
        if self._rows is None:
            if self._event is not None:
                self._event.synchronize()
            self._rows = self._host.T.tolist()
        return self._rows[row]


class DraftTokens(Sequence):
    """A request's drafts from one propose(): len() and leading slices without waiting for the device; their values
    (indexing, iteration, comparison) wait for the copy, once per propose()."""

    __slots__ = ("_pending", "_row", "_count")

    def __init__(self, pending: PendingDrafts, row: int, count: int) -> None:
        self._pending, self._row, self._count = pending, row, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice) and index.step is None and not index.start and (index.stop or 0) >= 0:
            stop = self._count if index.stop is None else min(self._count, index.stop)
            return DraftTokens(self._pending, self._row, stop)
        return self.tolist()[index]

    def tolist(self) -> list[int]:
        return self._pending.row(self._row)[: self._count]

    def device_source(self) -> tuple[torch.Tensor, int, int]:
        """(the propose()'s drafts on the device [k_max, requests], this request's column, its count)."""
        return self._pending.tokens, self._row, self._count

    def exit_source(self) -> tuple[torch.Tensor | None, int]:
        """(the propose()'s hidden states after the draft layers [passes, requests, hidden] or None, this request's
        column): pass j holds its last token's (j = 0) or its j-th draft's."""
        return self._pending.exits, self._row

    def __iter__(self):
        return iter(self.tolist())

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and self.tolist() == list(other)

    def __repr__(self) -> str:
        return f"DraftTokens({self.tolist()})"
