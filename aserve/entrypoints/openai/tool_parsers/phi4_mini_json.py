"""Phi-4-mini: `functools[{"name": ..., "arguments": {...}}, ...]` (`parameters` for the arguments too), vLLM's
`phi4_mini_json`. Text before `functools[` is content here (vLLM drops it). Streamed, a call is reported once its
name is written, then its arguments' JSON text as it grows (vLLM sends Phi-4-mini's calls only at the end)."""

from __future__ import annotations

import json

from aserve.entrypoints.openai.tool_parsers.base import PartialCall, ToolCall, ToolParser, content_around
from aserve.entrypoints.openai.tool_parsers.partial_json import listed_calls

_MARKER = "functools["
_ARGUMENTS_KEYS = ("arguments", "parameters")


def _list_start(text: str) -> int:
    """Where the calls' JSON list begins (the `[` of `functools[`), or -1."""
    start = text.find(_MARKER)
    return start + len(_MARKER) - 1 if start >= 0 else -1


class Phi4MiniJsonToolParser(ToolParser):
    name = "phi4_mini_json"
    start_markers = (_MARKER,)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        start = _list_start(text)
        if start < 0:
            return text, []
        try:
            items, end = json.JSONDecoder().raw_decode(text, start)
        except (ValueError, RecursionError):
            return text, []
        if not isinstance(items, list) or not items:
            return text, []
        calls = [ToolCall.from_json(item, next((k for k in _ARGUMENTS_KEYS if k in item), "arguments"))
                 if isinstance(item, dict) else None for item in items]  # fmt: skip
        if None in calls:
            return text, []
        return content_around(text[: start + 1 - len(_MARKER)], text[end:]), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        start = _list_start(text)
        return listed_calls(text[start:], _ARGUMENTS_KEYS) if start >= 0 else []
