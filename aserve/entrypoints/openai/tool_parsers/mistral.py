"""Mistral: `[TOOL_CALLS]` followed by a JSON list of `{"name": ..., "arguments": {...}}` (text before it is
content). Streamed, a call is reported once its name is written, then its arguments' JSON text as it grows."""

from __future__ import annotations

import secrets
import string

from aserve.entrypoints.openai.tool_parsers.base import PartialCall, ToolCall, ToolParser, json_values
from aserve.entrypoints.openai.tool_parsers.partial_json import partial_call, sequence_values

_MARKER = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


def _items(body: str) -> list[tuple[int, int | None]]:
    """Where the calls written after the marker begin and end (None while unfinished): the objects of its lists, or
    objects written bare, as extract reads them."""
    items: list[tuple[int, int | None]] = []
    for start, end in sequence_values(body):
        if body[start] == "{":
            items.append((start, end))
            continue
        items += sequence_values(body, start + 1)
        if end is None:
            break
    return items


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (_MARKER,)
    needs_special_tokens = True  # [TOOL_CALLS] is a special token in Mistral's v3 tokenizers

    def new_call_id(self) -> str:
        """Mistral's templates refuse a tool_call_id that is not 9 letters or digits (as vLLM makes them)."""
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(_MARKER)
        if start < 0:
            return text, []
        parsed = json_values(text[start + len(_MARKER) :])
        if parsed is None:
            return text, []
        values, rest = parsed
        items = [item for v in values for item in (v if isinstance(v, list) else [v])]
        calls = [ToolCall.from_json(item) for item in items]
        if not calls or None in calls:
            return text, []
        return (text[:start] + rest).strip(), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """Each call object so far (partial_json.partial_call); stops at the first that is no call."""
        start = text.find(_MARKER)
        if start < 0:
            return []
        body, out = text[start + len(_MARKER) :], []
        for item_start, end in _items(body):
            item = body[item_start:end] if end is not None else body[item_start:]
            if body[item_start] != "{" or (call := partial_call(item, end is not None)) is None:
                break
            out.append(call)
        return out
