"""Reading a JSON object that may still be being written (a tool call as the model streams it): where its top-level
members' values begin and, once written, end."""

from __future__ import annotations

import json

_WHITESPACE = " \t\r\n"


def _skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
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


def _value_end(text: str, i: int) -> int | None:
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
    while j < len(text) and text[j] not in ",}]" + _WHITESPACE:
        j += 1
    return j if j < len(text) else None


def object_members(text: str) -> list[tuple[str, int, int | None]]:
    """The top-level members of the JSON object `text` begins with (after whitespace), as far as written: (key,
    where its value begins, where it ends or None while unfinished). Stops at the first unfinished or malformed
    part."""
    members: list[tuple[str, int, int | None]] = []
    i = _skip_whitespace(text, 0)
    if i >= len(text) or text[i] != "{":
        return members
    i += 1
    while True:
        i = _skip_whitespace(text, i)
        if i < len(text) and text[i] == "," and members:
            i = _skip_whitespace(text, i + 1)
        if i >= len(text) or text[i] != '"':
            return members
        key_end = _string_end(text, i)
        if key_end is None:
            return members
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return members
        i = _skip_whitespace(text, key_end)
        if i >= len(text) or text[i] != ":":
            return members
        i = _skip_whitespace(text, i + 1)
        if i >= len(text):
            return members
        end = _value_end(text, i)
        members.append((key, i, end))
        if end is None:
            return members
        i = end
