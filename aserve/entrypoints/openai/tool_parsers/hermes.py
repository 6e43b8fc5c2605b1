"""Hermes / Qwen 2.5 / Qwen 3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Streamed,
a call is reported once its name is written, then its arguments' JSON text as it grows."""

from __future__ import annotations

import json
import re

from aserve.entrypoints.openai.tool_parsers.base import PartialCall, ToolCall, ToolParser
from aserve.entrypoints.openai.tool_parsers.partial_json import object_members

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _call(body: str) -> ToolCall | None:
    try:
        return ToolCall.from_json(json.loads(body))
    except ValueError:
        return None


def _forming(body: str, complete: bool) -> PartialCall:
    """A call's body as far as written: its name once its string is complete, and its arguments' text so far when
    they are written as an object (arguments given as a JSON string come whole, once the call is complete)."""
    name, arguments = None, ""
    for key, start, end in object_members(body):
        if key == "name" and end is not None and body[start] == '"':
            value = json.loads(body[start:end])
            name = value if isinstance(value, str) else None
        elif key == "arguments" and body[start] == "{":
            arguments = body[start:end] if end is not None else body[start:]
    return PartialCall(name, arguments, complete)


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (_OPEN,)

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
        return "".join(outside).strip(), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """Each block so far; a complete one that is no call (bad JSON) is still reported if its name was, so that
        what a stream sent keeps its place."""
        out, pos = [], 0
        while (start := text.find(_OPEN, pos)) >= 0:
            body_start = start + len(_OPEN)
            end = text.find(_CLOSE, body_start)
            if end < 0:
                out.append(_forming(text[body_start:], complete=False))
                break
            body = text[body_start:end]
            pos = end + len(_CLOSE)
            call, seen = _call(body), _forming(body, complete=True)
            if call is not None:
                out.append(PartialCall(call.name, seen.arguments or call.arguments, True))
            elif seen.name is not None:
                out.append(seen)
        return out
