"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder`, and `qwen3_xml`, its other parser of the same format):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Text before the first `<tool_call>` is content. A parameter's value is its text (a newline after `>` and before
`</parameter>` dropped), typed by the request's tool schema as vLLM types it: strings stay text; integers, numbers,
booleans and null are read as such, objects and arrays as JSON (or Python literals); a value that does not read as
its type, or a parameter the schema does not name, stays text. A `</parameter>` closes the value only where the
next tag (`<parameter=`, `</function>`, `</tool_call>`) or the end follows it, so a value may hold the tag's text.

Streamed, a call is reported once `<function=NAME>` is written, its arguments' JSON opening at once and growing by
whole parameters, each as soon as the tag after its `</parameter>` shows it closed."""

from __future__ import annotations

import ast
import json
import math

from aserve.entrypoints.openai.tool_parsers.base import PartialCall, ToolCall, ToolParser, content_around

_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_NULLS = ("null", "none")


def _schema_type(schema) -> tuple[str, bool]:
    """A parameter's schema -> (its type's name, whether it allows null), as vLLM reads them: `type` (the first
    non-null of a list), or the first non-null type of an `anyOf`; a schema without either is a string."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    elif isinstance(schema.get("anyOf"), list):
        types = [option["type"] for option in schema["anyOf"] if isinstance(option, dict) and "type" in option]
    else:
        return "string", False
    names = [str(t).strip().lower() for t in types]
    return next((n for n in names if n != "null"), "string"), "null" in names


def _typed(value: str, schema) -> object:
    kind, nullable = _schema_type(schema)
    if nullable and value.lower() in _NULLS:
        return None
    if kind in _STRING_TYPES:
        return value
    if value.lower() in _NULLS:
        return None
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            if not math.isfinite(number):
                return value
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            pass
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return value
    try:
        json.dumps(parsed, allow_nan=False)
    except (ValueError, TypeError):  # a set, bytes, infinity: not JSON
        return value
    return parsed


_NEXT_TAGS = (_PARAMETER, _FUNCTION_END, _CALL_CLOSE)


def _closes(text: str, end: int, final: bool) -> bool:
    """Whether the `</parameter>` at `end` closes its value: the next tag follows it; the end of the output, or a
    tag still being written, tells only once the output is complete."""
    after = text[end + len(_PARAMETER_END) :].lstrip()
    if after.startswith(_NEXT_TAGS):
        return True
    return final if not after or any(tag.startswith(after) for tag in _NEXT_TAGS) else False


def _parameters(body: str, final: bool) -> tuple[list[tuple[str, str]], int | None]:
    """A function's body after `<function=NAME>` -> (its closed parameters (name, raw value) in order, where the
    function ends: after its `</function>` (at a `</tool_call>` or the output's end where that is missing), None
    while it is open)."""
    params, i = [], 0
    while True:
        i = len(body) - len(body[i:].lstrip())
        if body.startswith(_FUNCTION_END, i):
            return params, i + len(_FUNCTION_END)
        if body.startswith(_CALL_CLOSE, i) or (final and i == len(body)):
            return params, i
        if not body.startswith(_PARAMETER, i):
            return params, None
        name_end = body.find(">", i + len(_PARAMETER))
        if name_end < 0:
            return params, None
        end = body.find(_PARAMETER_END, name_end + 1)
        while end >= 0 and not _closes(body, end, final):
            end = body.find(_PARAMETER_END, end + 1)
        if end < 0:
            return params, None
        value = body[name_end + 1 : end]
        value = value[1:] if value.startswith("\n") else value
        params.append((body[i + len(_PARAMETER) : name_end], value[:-1] if value.endswith("\n") else value))
        i = end + len(_PARAMETER_END)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    aliases = ("qwen3_xml",)
    start_markers = (_CALL_OPEN,)

    def __init__(self, properties: dict[str, dict] | None = None) -> None:
        self.properties = properties or {}  # function name -> its parameters' schemas (the request's tools)

    def for_request(self, tools: list) -> Qwen3CoderToolParser:
        properties = {}
        for tool in tools or []:
            params = tool["function"].get("parameters") or {}
            found = params.get("properties") if isinstance(params, dict) else None
            properties[tool["function"]["name"]] = found if isinstance(found, dict) else {}
        return Qwen3CoderToolParser(properties)

    def _arguments(self, name: str, params: list[tuple[str, str]], complete: bool) -> str:
        """The arguments' JSON text (each later report extends it: a repeated parameter keeps its first value)."""
        schemas, pieces, seen = self.properties.get(name, {}), [], set()
        for key, raw in params:
            if key not in seen:
                seen.add(key)
                value = _typed(raw, schemas[key]) if key in schemas else raw
                pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        return "{" + ", ".join(pieces) + ("}" if complete else "")

    def _calls(self, text: str, final: bool) -> tuple[list[PartialCall], int, int]:
        """The calls as far as written -> (them, where the first `<tool_call>` is, where the text after the last
        closed call begins)."""
        calls, first, pos = [], text.find(_CALL_OPEN), 0
        after = -1
        while (start := text.find(_CALL_OPEN, pos)) >= 0:
            head_at = len(text) - len(text[start + len(_CALL_OPEN) :].lstrip())
            name_end = text.find(">", head_at)
            if not text.startswith(_FUNCTION, head_at) or name_end < 0:
                break
            name = text[head_at + len(_FUNCTION) : name_end]
            if not name or any(c in name for c in "{}<\"' \t\r\n"):
                break
            params, stop = _parameters(text[name_end + 1 :], final)
            calls.append(PartialCall(name, self._arguments(name, params, stop is not None), stop is not None))
            if stop is None:
                break
            pos = after = name_end + 1 + stop
            rest = text[pos:].lstrip()
            if rest.startswith(_CALL_CLOSE):
                pos = after = len(text) - len(rest) + len(_CALL_CLOSE)
        return calls, first, after

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        partials, first, after = self._calls(text, final=True)
        calls = [ToolCall(c.name, c.arguments) for c in partials if c.complete]
        if not calls:
            return text, []
        return content_around(text[:first], text[after:] if after >= 0 else ""), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        return self._calls(text, final=False)[0]
