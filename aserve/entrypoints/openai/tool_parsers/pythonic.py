"""Pythonic tool calls (Llama 3.2 and Llama 4's pythonic templates, ToolACE): the whole output is a Python list of
calls with keyword arguments, `[get_weather(city="Paris", unit="celsius"), get_time(zone="UTC")]`, possibly between
Llama 4's `<|python_start|>` and `<|python_end|>`; recognised only at the start of the output. Argument values are
Python literals (strings, numbers, True / False / None, lists, dicts; JSON's null / true / false too), sent as
JSON. vLLM's `pythonic` and `llama4_pythonic`, one parser here.

Streamed, a call is reported once its name and `(` are written, then its arguments' JSON grows by whole arguments:
each one as soon as the `,` or `)` after it is written (a value being written may still change its JSON)."""

from __future__ import annotations

import ast
import json
import math
import re

from aserve.entrypoints.openai.tool_parsers.base import PartialCall, ToolCall, ToolParser
from aserve.entrypoints.openai.tool_parsers.partial_json import WHITESPACE, skip

_START, _END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_JSON_NAMES = {"null": None, "true": True, "false": False}
_OPEN, _CLOSE = "([{", ")]}"


class _NotACall(ValueError):
    pass


def _body(text: str) -> str:
    body = text.lstrip()
    if body.startswith(_START):
        body = body[len(_START) :].replace(_END, "")
    return body


def _value(node: ast.expr):
    """A literal argument's value; _NotACall for anything else (a name, an expression, a call)."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes | complex | type(Ellipsis)):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd) and isinstance(
            node.operand, ast.Constant) and type(node.operand.value) in (int, float):  # fmt: skip
        value = -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        value = _JSON_NAMES[node.id]
    elif isinstance(node, ast.List):
        value = [_value(v) for v in node.elts]
    elif isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                            for k in node.keys):  # fmt: skip
        value = {k.value: _value(v) for k, v in zip(node.keys, node.values)}
    else:
        raise _NotACall(ast.dump(node))
    if isinstance(value, float) and not math.isfinite(value):  # JSON has no infinity or NaN
        raise _NotACall(repr(value))
    return value


def _keywords(node: ast.Call) -> list[tuple[str, object]]:
    """A call's keyword arguments, in order (positional ones are not arguments of a tool: left out, as vLLM)."""
    if any(k.arg is None for k in node.keywords):  # **kwargs
        raise _NotACall("**")
    return [(k.arg, _value(k.value)) for k in node.keywords]


def _arguments(pairs: list[tuple[str, object]], complete: bool) -> str:
    """The arguments' JSON text: a whole object, or while the call is being written, its start (each later report
    extends it: the same text as the whole object's without its closing brace)."""
    text = json.dumps(dict(pairs), ensure_ascii=False)
    return text if complete else ("" if not pairs else text[:-1])


def _call_name(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise _NotACall("a call's name")
    return ".".join([node.id, *reversed(parts)])


def _arguments_end(text: str, i: int) -> tuple[list[tuple[int, int]], int | None]:
    """From just after a call's `(`: the top-level argument texts' spans that a `,` or the closing `)` has ended,
    and where that `)` is (None while the call is unfinished)."""
    spans, depth, start, quote = [], 0, i, None
    while i < len(text):
        c = text[i]
        if quote is not None:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            if depth == 0:
                if c != ")":
                    raise _NotACall(c)
                if text[start:i].strip():
                    spans.append((start, i))
                return spans, i
            depth -= 1
        elif c == "," and depth == 0:
            spans.append((start, i))
            start = i + 1
        i += 1
    return spans, None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    aliases = ("llama4_pythonic",)
    start_markers = ("[", _START)
    only_at_start = True

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        try:
            node = ast.parse(_body(text).strip(), mode="eval").body
            if not isinstance(node, ast.List) or not node.elts or not all(isinstance(e, ast.Call) for e in node.elts):
                return text, []
            calls = [ToolCall(_call_name(e.func), _arguments(_keywords(e), True)) for e in node.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):  # (_NotACall: a ValueError)
            return text, []
        return "", calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        body, out = _body(text), []
        i = skip(body, 0)
        if not body.startswith("[", i):
            return out
        i += 1
        try:
            while True:
                i = skip(body, i, WHITESPACE + ",")
                name = _NAME.match(body, i)
                if name is None or name.end() == len(body):
                    return out
                i = skip(body, name.end())
                if i == len(body) or body[i] != "(":
                    return out
                spans, end = _arguments_end(body, i + 1)
                pairs = []
                for start, stop in spans:
                    for key, value in _keywords(ast.parse(f"f({body[start:stop]})", mode="eval").body):
                        if key in dict(pairs):
                            raise _NotACall(key)  # repeated (Python refuses it): its JSON would move
                        pairs.append((key, value))
                out.append(PartialCall(name.group(), _arguments(pairs, end is not None), end is not None))
                if end is None:
                    return out
                i = end + 1
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return out
