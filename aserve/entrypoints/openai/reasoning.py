"""Reasoning models' thinking apart from their answer (`aserve serve --reasoning-parser deepseek_r1 | qwen3 | mistral`,
vLLM's flag): a chat reply's text up to `</think>` becomes `reasoning` (streamed as `delta.reasoning`; also under
vLLM's earlier name `reasoning_content`, which clients still read), the rest `content`; a request's
`include_reasoning: false` drops the reasoning. `usage.completion_tokens_details.reasoning_tokens` counts the output
tokens spent reasoning (as vLLM reports them whenever a reasoning parser is set): those between the markers where
they are tokens of the vocabulary, else as many as the reasoning's text takes.

deepseek_r1 and qwen3 read a reply as starting in its reasoning (the chat template may have written `<think>` into
the prompt, as Qwen3-Thinking-2507's and DeepSeek-R1's do; a leading `<think>` in the reply is dropped) until
`</think>`; a reply cut off before `</think>` is all reasoning. qwen3 also follows the request's thinking switch: with
`chat_template_kwargs: {"enable_thinking": false}` (or `reasoning_effort: "none"`) the reply is all content. mistral
(Magistral) reads `[THINK]...[/THINK]`, reasoning only where the reply starts with `[THINK]` (vLLM's rule: a reply
without it is all content); those markers are special tokens of Mistral's tokenizers, kept in the text for it.

With tool calling the tool parser reads the content only. Structured output (and a forced tool call) constrains
the answer: where `</think>` is one token of the vocabulary (Qwen3's, DeepSeek-R1's) the grammar waits for that token
and applies to what follows it (vLLM's rule), so the reasoning is free; with thinking off (qwen3's switch) it applies
from the start. Where `</think>` is not one token the grammar constrains the whole reply: a constrained reply has
reasoning only where it starts with `<think>` (its grammar writes the block), else it is all content. Under mistral
the grammar applies from the start.
"""

from __future__ import annotations

from dataclasses import dataclass

from aserve.entrypoints.openai.responses import ChoiceState


@dataclass(frozen=True, slots=True)
class Markers:
    """A reasoning format's opening and closing markers; `special`: special tokens of the family's tokenizers (the
    text keeps special tokens, else they would be gone from it)."""

    start: str
    end: str
    special: bool = False


THINK = Markers("<think>", "</think>")
MARKERS = {"deepseek_r1": THINK, "qwen3": THINK, "mistral": Markers("[THINK]", "[/THINK]", special=True)}
REASONING_PARSERS = tuple(MARKERS)


# How a reply is read: FIRST (it starts in its reasoning), MARKED (reasoning only after a leading <think>), NONE
FIRST, MARKED, NONE = "first", "marked", "none"


def reading(parser: str, constrained: bool = False, thinking: bool = True, deferred: bool = False) -> str:
    """The parser, a grammar over the reply, the request's thinking switch, whether the grammar waits for the end of
    the reasoning -> how its reply is read."""
    if parser == "qwen3" and not thinking:
        return NONE
    if parser == "mistral":
        return MARKED
    return MARKED if constrained and not deferred else FIRST


def _token(tokenizer, marker: str) -> int | None:
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def think_end_token(tokenizer, parser: str = "deepseek_r1") -> int | None:
    """The id of the parser's closing marker (`</think>`) where it is one token of the vocabulary, else None."""
    return _token(tokenizer, MARKERS[parser].end)


def reasoning_output(parser: str, params, req, tools, end_token: int | None, tokenizer=None):
    """A chat request's ReasoningOutput (wrapping its tool-call handling `tools`, already applied to `params`) ->
    (it, the token its grammar waits for or None). `tokenizer`: counts the reasoning's tokens where its markers are
    not tokens of the vocabulary."""
    markers = MARKERS[parser]
    if markers.special:
        params.skip_special_tokens = False
    constrained = params.structured_outputs is not None
    # the switch as the template gets it: chat_template_kwargs', else reasoning_effort's ("none": off)
    thinking = (req.template_kwargs() or {}).get("enable_thinking", True) is not False
    # as vLLM: without include_reasoning the grammar applies from the start
    mode = reading(parser, constrained, thinking, deferred=end_token is not None and req.include_reasoning)
    after = end_token if constrained and mode == FIRST else None
    counter = ReasoningTokens(markers, tokenizer) if tokenizer is not None else None
    return ReasoningOutput(mode, tools, req.include_reasoning, markers, counter), after


def split_reasoning(mode: str, text: str, markers: Markers = THINK) -> tuple[str | None, str]:
    """A whole reply -> (its reasoning or None, its content)."""
    stripped = text.lstrip()
    if stripped.startswith(markers.start) and mode != NONE:
        text = stripped[len(markers.start) :]
    elif mode != FIRST:
        return None, text
    reasoning, end, content = text.partition(markers.end)
    return reasoning, content if end else ""


class ReasoningTokens:
    """Counts a reply's reasoning tokens as vLLM does: the output tokens after the opening marker (or from the first,
    a reply that starts in its reasoning) up to the closing one, where the markers are tokens of the vocabulary;
    else as many tokens as the reasoning's text takes."""

    def __init__(self, markers: Markers, tokenizer) -> None:
        self.markers, self.tokenizer = markers, tokenizer
        self.start_id, self.end_id = _token(tokenizer, markers.start), _token(tokenizer, markers.end)

    def count(self, mode: str, text: str, token_ids: list[int]) -> int:
        reasoning, _ = split_reasoning(mode, text, self.markers)
        if not reasoning:
            return 0
        end = token_ids.index(self.end_id) if self.end_id in token_ids else None
        if end is None and self.markers.end not in text:  # cut off in its reasoning: it runs to the last token
            end = len(token_ids)
        if end is None:
            return min(len(token_ids), len(self.tokenizer.encode(reasoning, add_special_tokens=False)))
        opened = self.start_id is not None and self.start_id in token_ids[:end]
        return end - (token_ids.index(self.start_id) + 1 if opened else 0)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: the marker may be forming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class _Stream:
    phase: str = "start"  # start (before the reply shows whether it reasons) | reasoning | content
    sent: int = 0  # characters of the reply consumed
    content_start: int = -1  # where the content begins in the reply (-1: not yet)


class _ContentView:
    """A choice as the tool parser sees it under a reasoning parser: its content only."""

    __slots__ = ("index", "text", "delta_text", "finish_reason")

    def __init__(self, choice: ChoiceState, text: str, delta_text: str) -> None:
        self.index, self.finish_reason = choice.index, choice.finish_reason
        self.text, self.delta_text = text, delta_text


class ReasoningOutput:
    """One chat request's reasoning split, wrapping its tool-call handling if it has one (the same interface as
    tool_output.ToolCallOutput: message, delta)."""

    def __init__(self, mode: str, tools=None, include_reasoning: bool = True, markers: Markers = THINK,
                 counter: ReasoningTokens | None = None) -> None:  # fmt: skip
        """mode: how replies are read (`reading`); counter: counts the reasoning tokens for usage (None: not
        reported)."""
        self.mode, self.tools, self.include_reasoning = mode, tools, include_reasoning
        self.markers, self.counter = markers, counter
        self.streams: dict[int, _Stream] = {}

    def completion_tokens_details(self, choices: list[ChoiceState]) -> dict | None:
        """usage.completion_tokens_details for `choices`: their reasoning tokens."""
        if self.counter is None:
            return None
        count = sum(self.counter.count(self.mode, c.text, c.output_token_ids) for c in choices)
        return {"reasoning_tokens": count}

    def message(self, body_choice: dict, choice: ChoiceState) -> None:
        reasoning, content = split_reasoning(self.mode, choice.text, self.markers)
        message = body_choice["message"]
        message["content"] = content or None
        if reasoning is not None and self.include_reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.tools is not None:
            self.tools.message(body_choice, _ContentView(choice, content, ""))

    def delta(self, body_choice: dict, choice: ChoiceState) -> bool:
        """Rewrites a stream chunk's choice -> whether it still has anything to send."""
        state = self.streams.setdefault(choice.index, _Stream())
        reasoning, content = self._advance(state, choice.text, choice.finish_reason is not None)
        if self.tools is not None:
            whole = choice.text[state.content_start :] if state.content_start >= 0 else ""
            has_more = self.tools.delta(body_choice, _ContentView(choice, whole, content))
        else:
            body_choice["delta"] = {"content": content} if content else {}
            has_more = bool(content) or choice.finish_reason is not None or body_choice.get("logprobs") is not None
        if reasoning and self.include_reasoning:
            body_choice["delta"] = {"reasoning": reasoning, "reasoning_content": reasoning, **body_choice["delta"]}
            has_more = True
        return has_more

    def _advance(self, state: _Stream, text: str, finished: bool) -> tuple[str, str]:
        """The reply so far -> (reasoning, content) not sent yet, holding back a marker that may be forming."""
        reasoning, start, end_marker = "", self.markers.start, self.markers.end
        if state.phase == "start":
            head = text.lstrip()
            if self.mode == NONE:
                state.phase, state.content_start = "content", 0
            elif head.startswith(start):
                state.phase, state.sent = "reasoning", len(text) - len(head) + len(start)
            elif start.startswith(head) and not finished:
                return "", ""  # too short to tell
            elif self.mode == MARKED:
                state.phase, state.content_start = "content", 0
            else:
                state.phase = "reasoning"
        if state.phase == "reasoning":
            end = text.find(end_marker, max(0, state.sent - len(end_marker) + 1))
            if end < 0:
                stop = len(text) if finished else len(text) - _partial_suffix(text[state.sent :], end_marker)
                reasoning, state.sent = text[state.sent : stop], max(state.sent, stop)
                return reasoning, ""
            reasoning = text[state.sent : end]
            state.phase, state.sent = "content", end + len(end_marker)
            state.content_start = state.sent
        content, state.sent = text[state.sent :], len(text)
        return reasoning, content
