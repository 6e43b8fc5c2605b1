"""Llama 3.x JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (several separated by `;`),
possibly after `<|python_tag|>`; recognised only at the start of the output."""

from __future__ import annotations

from aserve.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser, json_values

_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (_PYTHON_TAG, "{")
    only_at_start = True
    needs_special_tokens = True  # <|python_tag|> is a special token

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.lstrip().removeprefix(_PYTHON_TAG).lstrip()
        parsed = json_values(body)
        if parsed is None:
            return text, []
        values, rest = parsed
        calls = [ToolCall.from_json(v, "parameters" if "parameters" in v else "arguments") for v in values
                 if isinstance(v, dict)]  # fmt: skip
        if not calls or None in calls or len(calls) != len(values):
            return text, []
        return rest.strip(), calls
