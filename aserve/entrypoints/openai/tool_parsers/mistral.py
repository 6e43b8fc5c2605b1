"""Mistral: text (content), then `[TOOL_CALLS]` and the calls, in either of the formats Mistral's tokenizers trained:

    before v11 (Mistral 7B v0.3, Mistral-Nemo):  [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]
    v11 and later (Mistral-Small-3.1/3.2, Devstral, Magistral):  [TOOL_CALLS]f{...}[TOOL_CALLS]g{...}
                                                                   or [TOOL_CALLS]f[ARGS]{...} (v13: [CALL_ID]id too)

told apart by what follows the marker (a JSON list or object, or a name). Streamed, a call is reported once its name
is written, then its arguments' JSON text as it grows."""

from __future__ import annotations

import json
import re
import secrets
import string

from aserve.entrypoints.openai.tool_parsers.base import (
    PartialCall,
    ToolCall,
    ToolParser,
    content_around,
    json_values,
)
from aserve.entrypoints.openai.tool_parsers.partial_json import listed_calls, value_end

_MARKER = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits
# v11+: a call's name, then [CALL_ID] and its id (v13), then [ARGS] (special tokens, kept in the text) or the
# arguments' "{" at once: the name is known complete at [ARGS] or "{"
_NAMED_CALL = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\][^\[{]*)?(?:\[ARGS\]\s*|(?=\{))")


def _json_format(body: str) -> bool | None:
    """Whether the calls after the marker are a JSON list (before v11) or named (v11+); None while unknown."""
    stripped = body.lstrip()
    return None if not stripped else stripped[0] in "[{"


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (_MARKER,)
    needs_special_tokens = True  # [TOOL_CALLS] (and v11's [ARGS]) are special tokens of Mistral's tokenizers

    def new_call_id(self) -> str:
        """Mistral's templates refuse a tool_call_id that is not 9 letters or digits (as vLLM makes them)."""
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find(_MARKER)
        if start < 0:
            return text, []
        body = text[start + len(_MARKER) :]
        parsed = self._json_calls(body) if _json_format(body) else self._named_calls(body)
        if parsed is None:
            return text, []
        calls, rest = parsed
        return content_around(text[:start], rest), calls

    @staticmethod
    def _json_calls(body: str) -> tuple[list[ToolCall], str] | None:
        parsed = json_values(body)
        if parsed is None:
            return None
        values, rest = parsed
        calls = [ToolCall.from_json(item) for v in values for item in (v if isinstance(v, list) else [v])]
        return (calls, rest) if calls and None not in calls else None

    @staticmethod
    def _named_calls(body: str) -> tuple[list[ToolCall], str] | None:
        calls, rest = [], ""
        for i, segment in enumerate(body.split(_MARKER)):
            match = _NAMED_CALL.match(segment)
            if match is None:
                return None
            try:
                args, end = json.JSONDecoder().raw_decode(segment, match.end())
            except (ValueError, RecursionError):
                return None
            call = ToolCall.from_json({"name": match.group(1), "arguments": args})
            if call is None:
                return None
            calls.append(call)
            if segment[end:].strip():  # text after a call's arguments ends the calls
                rest = segment[end:] + _MARKER.join(body.split(_MARKER)[i + 1 :])
                break
        return calls, rest

    def partial_calls(self, text: str) -> list[PartialCall]:
        """Each call so far: its JSON object (partial_json.partial_call), or its name and its arguments' text."""
        start = text.find(_MARKER)
        if start < 0:
            return []
        body = text[start + len(_MARKER) :]
        form = _json_format(body)
        if form is None:
            return []
        if form:
            return listed_calls(body)
        out = []
        for segment in body.split(_MARKER):
            match = _NAMED_CALL.match(segment)
            if match is None:  # the name is not complete yet (or this is no call)
                break
            if match.end() == len(segment):  # [ARGS] written, the arguments not begun
                out.append(PartialCall(match.group(1), "", False))
                break
            if segment[match.end()] != "{":
                break
            end = value_end(segment, match.end())
            out.append(PartialCall(match.group(1), segment[match.end() : end], end is not None))
            if end is None or segment[end:].strip():
                break
        return out
