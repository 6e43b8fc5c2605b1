"""Llama 3.x JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (several separated by `;`),
possibly after `<|python_tag|>`; recognised only at the start of the output. Streamed, a call is reported once its
name is written, then its arguments' JSON text as it grows."""

from __future__ import annotations

from aserve.entrypoints.openai.tool_parsers.base import PartialCall, ToolCall, ToolParser, json_values
from aserve.entrypoints.openai.tool_parsers.partial_json import partial_call, sequence_values

_PYTHON_TAG = "<|python_tag|>"
_ARGUMENTS_KEYS = ("parameters", "arguments")


def _body(text: str) -> str:
    return text.lstrip().removeprefix(_PYTHON_TAG).lstrip()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (_PYTHON_TAG, "{")
    only_at_start = True
    # <|python_tag|> is a special token: decoded as usual (skip_special_tokens) the text has none, and a call starts it
    # with "{" (as vLLM reads it); no other special token reaches the content. Text that keeps it is read too.
    needs_special_tokens = False

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        parsed = json_values(_body(text))
        if parsed is None:
            return text, []
        values, rest = parsed
        calls = [ToolCall.from_json(v, "parameters" if "parameters" in v else "arguments") for v in values
                 if isinstance(v, dict)]  # fmt: skip
        if not calls or None in calls or len(calls) != len(values):
            return text, []
        return rest.strip(), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """Each call object so far (partial_json.partial_call); stops at the first that is no call."""
        body, out = _body(text), []
        for start, end in sequence_values(body):
            call = partial_call(body[start:end] if end is not None else body[start:], end is not None, _ARGUMENTS_KEYS)
            if call is None:
                break
            out.append(call)
        return out
