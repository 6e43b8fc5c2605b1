"""Hermes / Qwen 2.5 / Qwen 3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
import re

from aserve.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = ("<tool_call>",)

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        calls, outside, pos = [], [], 0
        for match in _BLOCK.finditer(text):
            try:
                call = ToolCall.from_json(json.loads(match.group(1)))
            except ValueError:
                call = None
            if call is None:  # not a call after all: it stays text
                continue
            calls.append(call)
            outside.append(text[pos : match.start()])
            pos = match.end()
        if not calls:
            return text, []
        outside.append(text[pos:])
        return "".join(outside).strip(), calls
