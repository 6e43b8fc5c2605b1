"""Hermes / Qwen 2.5 / Qwen 3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Streamed,
a call is reported once its name is written, then its arguments' JSON text as it grows."""

from __future__ import annotations

import json
import re

from aserve.entrypoints.openai.tool_parsers.base import PartialCall, ToolCall, ToolParser, content_around
from aserve.entrypoints.openai.tool_parsers.partial_json import partial_call

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _call(body: str) -> ToolCall | None:
    try:
        return ToolCall.from_json(json.loads(body))
    except (ValueError, RecursionError):
        return None


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (_OPEN,)
    # some checkpoints make <tool_call> a special token: decoded as usual (skip_special_tokens) the call's markers
    # would be gone, so the output keeps special tokens (as vLLM's hermes parser asks)
    needs_special_tokens = True

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        calls, outside, pos = [], [], 0
        for match in _BLOCK.finditer(text):
            call = _call(match.group(1))
            if call is None:  # not a call after all: it stays text
                continue
            calls.append(call)
            outside.append(text[pos : match.start()])
            pos = match.end()
        if not calls:
            return text, []
        outside.append(text[pos:])
        return content_around(outside[0], "".join(outside[1:])), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """Each block so far (partial_json.partial_call)."""
        out, pos = [], 0
        while (start := text.find(_OPEN, pos)) >= 0:
            body_start = start + len(_OPEN)
            end = text.find(_CLOSE, body_start)
            if end < 0:
                out.append(partial_call(text[body_start:], complete=False))
                break
            pos = end + len(_CLOSE)
            if (call := partial_call(text[body_start:end], complete=True)) is not None:
                out.append(call)
        return out
