"""Mistral: `[TOOL_CALLS]` followed by a JSON list of `{"name": ..., "arguments": {...}}` (text before it is
content)."""

from __future__ import annotations

from aserve.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, json_values

_MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (_MARKER,)
    needs_special_tokens = True  # [TOOL_CALLS] is a special token in Mistral's v3 tokenizers

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
