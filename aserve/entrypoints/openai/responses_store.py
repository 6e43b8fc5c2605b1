"""Stored responses (a request's `store`, true unless it says false, as OpenAI's default): each response object with
its conversation (the input items through its output items), for a later request's previous_response_id and for
GET /v1/responses/{id}. In memory, bounded: past MAX_STORED_RESPONSES responses or MAX_STORED_BYTES of their JSON,
the least recently used go first; a server restart forgets them all."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

MAX_STORED_RESPONSES = 4096
MAX_STORED_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict  # the response object
    items: list  # its conversation: input items (earlier turns' too), then its output items
    size: int  # bytes of JSON, what the store's bound counts


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.size = 0

    def put(self, body: dict, items: list) -> None:
        """Keeps a response (one larger than the whole bound is not kept)."""
        size = len(msgspec.json.encode(body)) + len(msgspec.json.encode(items))
        if size > self.max_bytes:
            return
        self.pop(body["id"])
        self.entries[body["id"]] = StoredResponse(body, items, size)
        self.size += size
        while len(self.entries) > self.max_responses or self.size > self.max_bytes:
            self.size -= self.entries.popitem(last=False)[1].size

    def get(self, response_id: str) -> StoredResponse | None:
        """A stored response (now the most recently used), or None."""
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> None:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.size -= entry.size
