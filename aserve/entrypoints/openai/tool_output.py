"""Tool calling on the response side: a chat choice's output text turned into OpenAI's `tool_calls`, whole (the
message) or as stream deltas.

auto: the server's parser (--tool-call-parser) finds the calls; streaming sends text on until a call marker may be
forming, then holds it and sends each call as the parser reads it (ToolParser.partial_calls): a first delta with the
call's index, id, type and name once the name is written, then its arguments piece by piece; a parser that reads
only complete calls sends each whole.
named: the output is the named function's arguments (forced by its schema); streamed as argument pieces after a first
delta with the call's id and name. required: the output is a JSON list of {"name", "parameters"} (forced); streamed
as auto's calls are, each call's name first, then its arguments piece by piece (partial_json.listed_calls). A
choice with calls finishing on "stop" finishes on "tool_calls", but for a named function, which the request forced
(OpenAI's and vLLM's "stop"). Call ids take the server parser's form in every mode (Mistral's templates take back
only their own). `parallel_tool_calls: false` keeps the first call only (auto; the others' schemas allow one), and a
stream sends only the first call's deltas, as vLLM does."""

from __future__ import annotations

import json

from aserve.entrypoints.openai.responses import ChoiceState
from aserve.entrypoints.openai.tool_parsers import ToolCall, ToolParser
from aserve.entrypoints.openai.tool_parsers.base import PartialCall, call_id, openai_call
from aserve.entrypoints.openai.tool_parsers.partial_json import listed_calls
from aserve.entrypoints.openai.tool_request import AUTO, NAMED, REQUIRED, named_function, tool_mode
from aserve.sampling_params import ParamError, SamplingParams

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
# The key of each call's arguments in tool_choice "required"'s forced list (tool_request.forced_output)
_REQUIRED_ARGUMENTS = ("parameters",)


def tool_call_output(req, parser: ToolParser | None, enable_auto: bool) -> ToolCallOutput | None:
    """A chat request's tool-call handling (None: its output is plain text); "auto" needs the server's parser, the
    other modes take its call ids' form where there is one."""
    mode = tool_mode(req.tools, req.tool_choice)
    if mode is None:
        return None
    if mode == AUTO and (not enable_auto or parser is None):
        raise ParamError("tool_choice", AUTO_NEEDS_FLAGS)
    parser = parser.for_request(req.tools) if parser is not None else None
    return ToolCallOutput(mode, parser, named_function(req.tool_choice), parallel=req.parallel_tool_calls)


class _StreamState:
    __slots__ = ("sent", "in_calls", "calls_sent", "args_sent", "content_sent", "named_id")

    def __init__(self) -> None:
        self.sent = 0  # characters of the text sent as content or known to be calls
        self.in_calls = False  # a call marker has begun: the rest is held
        self.calls_sent = 0
        self.args_sent: list[int] = []  # per call begun, characters of its arguments sent
        self.content_sent = ""
        self.named_id: str | None = None


class ToolCallOutput:
    """One chat request's tool-call handling: mode AUTO (its calls found by `parser`), NAMED (of function `name`) or
    REQUIRED; `parser` (the server's, if any) also makes the call ids and says whether special tokens stay in the
    text; `parallel` False keeps only the first call."""

    def __init__(self, mode: str, parser: ToolParser | None = None, name: str | None = None,
                 parallel: bool = True) -> None:  # fmt: skip
        assert mode in (AUTO, NAMED, REQUIRED) and (mode != AUTO or parser is not None)
        self.mode, self.parser, self.name, self.parallel = mode, parser, name, parallel
        self.states: dict[int, _StreamState] = {}

    def new_id(self) -> str:
        return self.parser.new_call_id() if self.parser is not None else call_id()

    def completion_tokens_details(self, choices: list[ChoiceState]) -> dict | None:
        """usage.completion_tokens_details: none without a reasoning parser (reasoning.ReasoningOutput's)."""
        return None

    def adjust(self, params: SamplingParams) -> None:
        """A parser whose markers are special tokens needs them in the decoded text (in every mode, as vLLM's parsers
        ask whenever the request has tools and tool_choice is not "none")."""
        if self.parser is not None and self.parser.needs_special_tokens:
            params.skip_special_tokens = False

    def calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output -> (its text outside the calls, the calls); no calls: (text, [])."""
        if self.mode == AUTO:
            return self.parser.extract(text)
        if self.mode == NAMED:
            return ("", [ToolCall(self.name, text)]) if text.strip() else (text, [])
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):  # cut short (max_tokens): no complete list
            return text, []
        calls = [ToolCall.from_json(item, "parameters") for item in items] if isinstance(items, list) else [None]
        return ("", calls) if calls and None not in calls else (text, [])

    def message(self, body_choice: dict, choice: ChoiceState) -> None:
        """Rewrites a final body's choice: content outside the calls (or null), tool_calls, finish_reason."""
        content, calls = self.calls(choice.text)
        if not calls:
            return
        message = body_choice["message"]
        message["content"] = content or None
        message["tool_calls"] = [openai_call(call, self.new_id()) for call in calls[: None if self.parallel else 1]]
        if body_choice["finish_reason"] == "stop" and self.mode != NAMED:
            body_choice["finish_reason"] = "tool_calls"

    def delta(self, body_choice: dict, choice: ChoiceState) -> bool:
        """Rewrites a stream chunk's choice -> whether it still has anything to send."""
        state = self.states.get(choice.index)
        if state is None:
            state = self.states[choice.index] = _StreamState()
        finished = choice.finish_reason is not None
        if self.mode == NAMED:
            content, calls = "", self._named_pieces(state, choice.delta_text)
        elif self.mode == REQUIRED:
            content, calls = self._required(state, choice.text, finished)
        else:
            content, calls = self._auto(state, choice.text, finished)
        if not self.parallel:
            calls = [call for call in calls if call["index"] == 0]
        delta: dict = {}
        if content:
            delta["content"] = content
            state.content_sent += content
        if calls:
            delta["tool_calls"] = calls
        body_choice["delta"] = delta
        if finished and state.calls_sent and body_choice["finish_reason"] == "stop" and self.mode != NAMED:
            body_choice["finish_reason"] = "tool_calls"
        return bool(delta) or finished or body_choice.get("logprobs") is not None

    def _named_pieces(self, state: _StreamState, piece: str) -> list[dict]:
        if not piece:
            return []
        if state.named_id is None:
            state.named_id = self.new_id()
            state.calls_sent = 1
            return [{"index": 0, "id": state.named_id, "type": "function",
                     "function": {"name": self.name, "arguments": piece}}]  # fmt: skip
        return [{"index": 0, "function": {"arguments": piece}}]

    def _required(self, state: _StreamState, text: str, finished: bool) -> tuple[str, list[dict]]:
        """The forced list's calls as they are written; nothing is content (but an output with no call at all)."""
        if finished:
            return self._at_end(state, text)
        return "", self._call_deltas(state, self._partial_calls(text), finished=False)

    def _auto(self, state: _StreamState, text: str, finished: bool) -> tuple[str, list[dict]]:
        parser, content = self.parser, ""
        if not state.in_calls:
            rest = text[state.sent :]
            if parser.only_at_start:
                start = parser.marker_start(text) if state.sent == 0 else -1
            else:
                start = parser.marker_start(rest)
                start = start + state.sent if start >= 0 else -1
            if start >= 0:
                content, state.sent, state.in_calls = text[state.sent : start], start, True
            else:
                safe = len(rest) if finished else parser.safe_prefix(rest)
                content, state.sent = rest[:safe], state.sent + safe
                return content, []
        if finished:
            more, calls = self._at_end(state, text, content)
            return content + more, calls
        return content, self._call_deltas(state, parser.partial_calls(text), finished=False)

    def _partial_calls(self, text: str) -> list[PartialCall]:
        if self.mode == AUTO:
            return self.parser.partial_calls(text)
        return listed_calls(text, _REQUIRED_ARGUMENTS)

    def _at_end(self, state: _StreamState, text: str, sending: str = "") -> tuple[str, list[dict]]:
        """The output is complete: the calls (or their parts) not sent yet, and the text outside the calls not sent
        yet (all the held text when it held no call after all); `sending`: content this delta sends before it."""
        outside, calls = self.calls(text)
        if not calls:
            if state.args_sent:  # calls begun in the stream that never completed
                return "", self._call_deltas(state, self._partial_calls(text), finished=True)
            return text[state.sent :], []
        sent = state.content_sent + sending
        more = outside[len(sent) :] if outside.startswith(sent) else ""
        return more, self._call_deltas(state, self._partial_calls(text), finished=True)

    def _call_deltas(self, state: _StreamState, partials: list[PartialCall], finished: bool) -> list[dict]:
        """OpenAI's tool-call deltas for the calls as far as written: a call's first (index, id, type, name and its
        arguments so far) once its name is known, then each new piece of its arguments. At the end, a call not begun
        yet counts only if complete."""
        deltas = []
        for i, call in enumerate(partials):
            if i < len(state.args_sent):
                piece = call.arguments[state.args_sent[i] :]
                if piece:
                    deltas.append({"index": i, "function": {"arguments": piece}})
                    state.args_sent[i] = len(call.arguments)
            elif call.name is not None and (call.complete or not finished):
                deltas.append({"index": i, "id": self.new_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})  # fmt: skip
                state.args_sent.append(len(call.arguments))
            else:
                break
        state.calls_sent = len(state.args_sent)
        return deltas
