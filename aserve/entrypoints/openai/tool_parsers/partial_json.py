"""Reading JSON that may still be being written (tool calls as the model streams them): where the objects of a
sequence and an object's top-level members begin and, once written, end; a call's name and arguments so far."""

from __future__ import annotations

import json

from aserve.entrypoints.openai.tool_parsers.base import PartialCall, ToolCall

WHITESPACE = " \t\r\n"
_SEPARATORS = WHITESPACE + ",;"


def skip(text: str, i: int, chars: str = WHITESPACE) -> int:
    """The index of the first character from `text[i]` that is not one of `chars`."""
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """`text[i]` opens a string: the index after its closing quote, None while it is unfinished."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value that begins at `text[i]`, None while it is unfinished."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                j = _string_end(text, j)
                if j is None:
                    return None
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or a literal: it ends where a delimiter follows
    while j < len(text) and text[j] not in ",}]" + WHITESPACE:
        j += 1
    return j if j < len(text) else None


def object_members(text: str) -> list[tuple[str, int, int | None]]:
    """The top-level members of the JSON object `text` begins with (after whitespace), as far as written: (key,
    where its value begins, where it ends or None while unfinished). Stops at the first unfinished or malformed
    part."""
    members: list[tuple[str, int, int | None]] = []
    i = skip(text, 0)
    if i >= len(text) or text[i] != "{":
        return members
    i += 1
    while True:
        i = skip(text, i)
        if i < len(text) and text[i] == "," and members:
            i = skip(text, i + 1)
        if i >= len(text) or text[i] != '"':
            return members
        key_end = _string_end(text, i)
        if key_end is None:
            return members
        try:
            key = json.loads(text[i:key_end])
        except (ValueError, RecursionError):
            return members
        i = skip(text, key_end)
        if i >= len(text) or text[i] != ":":
            return members
        i = skip(text, i + 1)
        if i >= len(text):
            return members
        end = value_end(text, i)
        members.append((key, i, end))
        if end is None:
            return members
        i = end


def sequence_values(text: str, i: int = 0) -> list[tuple[int, int | None]]:
    """The JSON objects and arrays written one after another from `text[i]` (whitespace, `,` or `;` between them, as
    base.json_values reads them), as far as written: (where each begins, where it ends or None while unfinished).
    Stops at anything else (a closing `]`, text after the calls)."""
    spans: list[tuple[int, int | None]] = []
    while True:
        i = skip(text, i, _SEPARATORS)
        if i >= len(text) or text[i] not in "{[":
            return spans
        end = value_end(text, i)
        spans.append((i, end))
        if end is None:
            return spans
        i = end


def partial_call(body: str, complete: bool, arguments_keys: tuple[str, ...] = ("arguments",)) -> PartialCall | None:
    """A call's JSON object `body` as far as written ({"name": ..., KEY: {...}} with KEY the first of
    `arguments_keys` it writes): its name once that string is complete, and its arguments' text so far when they
    are written as an object (arguments given as a JSON string come whole, once the call is complete). A complete
    body that is no call is still reported if its name was, so that what a stream sent keeps its place; else None."""
    name, arguments, key_used = None, "", None
    for key, start, end in object_members(body):
        if key == "name" and end is not None and body[start] == '"':
            try:
                value = json.loads(body[start:end])
            except (ValueError, RecursionError):
                value = None
            name = value if isinstance(value, str) else None
        elif key in arguments_keys and key_used in (None, key) and body[start] == "{":
            arguments, key_used = (body[start:end] if end is not None else body[start:]), key
    if not complete:
        return PartialCall(name, arguments, False)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        key_used = key_used or next((k for k in arguments_keys if k in obj), arguments_keys[-1])
    call = ToolCall.from_json(obj, key_used)
    if call is not None:
        return PartialCall(call.name, arguments or call.arguments, True)
    return PartialCall(name, arguments, True) if name is not None else None


def listed_calls(body: str, arguments_keys: tuple[str, ...] = ("arguments",)) -> list[PartialCall]:
    """The calls written as JSON objects in `body` as far as written: each object of its lists (`[{...}, {...}]`,
    several lists one after another too) or each object written bare; stops at the first that is no call."""
    items: list[tuple[int, int | None]] = []
    for start, end in sequence_values(body):
        if body[start] == "{":
            items.append((start, end))
            continue
        items += sequence_values(body, start + 1)
        if end is None:
            break
    out = []
    for start, end in items:
        item = body[start:end] if end is not None else body[start:]
        if body[start] != "{" or (call := partial_call(item, end is not None, arguments_keys)) is None:
            break
        out.append(call)
    return out
