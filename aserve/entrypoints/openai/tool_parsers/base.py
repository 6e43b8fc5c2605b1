"""What every tool-call parser shares: the call type, OpenAI's call ids, and the contract a format implements.

A parser reads a model's whole output text -> (the text outside the calls, the calls). Streaming reuses it: while
no call has begun, text is sent on except what may be the start of a call marker (held back until it is known);
once a marker has begun, the parser is asked for the calls so far (`partial_calls`): a parser that reads calls as
they form reports each one's name once complete and its arguments' JSON text as far as written (sent piece by
piece); the others report each call whole once it is complete."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's function.arguments)

    @classmethod
    def from_json(cls, obj, arguments_key: str = "arguments") -> ToolCall | None:
        """{"name": ..., arguments_key: {...}} -> a call; None when `obj` has not that shape."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(arguments_key, {})
        if isinstance(args, str):  # some models write the arguments as a JSON string already
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        if not isinstance(args, dict):
            return None
        return cls(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass(frozen=True, slots=True)
class PartialCall:
    """A call as far as the output has written it: `name` once complete (None before), `arguments` the arguments'
    JSON text so far (each later report extends it), `complete` once the call has ended."""

    name: str | None
    arguments: str
    complete: bool


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_call(call: ToolCall, id_: str | None = None) -> dict:
    """A call as the message's tool_calls entry."""
    return {"id": id_ or call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def content_around(before: str, after: str = "") -> str:
    """An output's content beside its calls: the text before the first call as written (a trailing space or newline
    kept, as vLLM keeps it), then the text after the calls, if any; "" where that is all whitespace."""
    content = before + after.strip()
    return content if content.strip() else ""


def json_values(text: str) -> tuple[list, str] | None:
    """The JSON values written one after another in `text` (whitespace, `,` or `;` between them) -> (values, what
    follows the last); None when `text` does not start with one (or it is incomplete)."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos == len(text) or text[pos] not in "{[":
            break
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            break
        values.append(value)
    return (values, text[pos:]) if values else None


class ToolParser:
    """One model family's tool-call format. `start_markers`: the texts a call (or the calls) begin with;
    `only_at_start`: calls are recognised only at the start of the output (after whitespace), as Llama 3's are;
    `needs_special_tokens`: a marker is a special token, so the output is decoded with special tokens kept."""

    name = ""
    aliases: tuple[str, ...] = ()  # vLLM's other names for the same format
    start_markers: tuple[str, ...] = ()
    only_at_start = False
    needs_special_tokens = False

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole output -> (text outside the calls, the calls); no calls: (text, [])."""
        raise NotImplementedError

    def for_request(self, tools: list) -> ToolParser:
        """The parser for one request's `tools` (a format whose arguments are typed by the tools' schemas reads
        them); here the server's one parser, which needs none."""
        return self

    def new_call_id(self) -> str:
        """A new call's id (the family's own form where its chat template checks the ids it renders back)."""
        return call_id()

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The output so far -> its calls so far, in order (see PartialCall). Here: the complete ones, whole."""
        return [PartialCall(call.name, call.arguments, True) for call in self.extract(text)[1]]

    def marker_start(self, text: str) -> int:
        """Where the first call marker begins in `text`, or -1."""
        if self.only_at_start:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.start_markers) else -1
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found, default=-1)

    def safe_prefix(self, text: str) -> int:
        """How much of `text` (with no whole marker in it) can be sent as content: all but a tail that may yet grow
        into a marker."""
        if self.only_at_start:
            stripped = text.lstrip()
            return 0 if any(m.startswith(stripped) for m in self.start_markers) else len(text)
        hold = 0
        for marker in self.start_markers:
            for k in range(min(len(marker) - 1, len(text)), hold, -1):
                if text.endswith(marker[:k]):
                    hold = k
                    break
        return len(text) - hold
