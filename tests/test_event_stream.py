"""A stream's running chunks written from per-choice byte templates (EventStream.templates) are byte for byte the
chunks built whole (EventStream.chunk), for completions and chats, several choices, and texts that JSON escapes;
streams whose chunks carry per-chunk fields, or whose class builds its own chunks, build every chunk whole."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from aserve.entrypoints.openai.event_stream import EventStream, FlowControl
from aserve.entrypoints.openai.responses import ChoiceState
from aserve.outputs import CompletionOutput, RequestOutput

TEXTS = ["Hello", ' "quoted"\n', "\\ back", "\x00marker\x00", "é ☃ 𝄞", "</script>", ""]


def make_stream(chat: bool, n: int, include_usage: bool, templates: bool = True, continuous_usage: bool = False,
                num_top: int | None = None, cls: type[EventStream] = EventStream) -> EventStream:  # fmt: skip
    req = SimpleNamespace(n=n, include_usage=include_usage, continuous_usage=continuous_usage, return_token_ids=False,
                          prompt_logprobs=None)  # fmt: skip
    choices = [ChoiceState(i, num_top) for i in range(n)]
    stream = cls(None, "tiny", req, "cmpl-1", 1700000000, choices, 3, chat, FlowControl(1 << 20, 5.0))
    if not templates:
        stream.templates = None
    return stream


def output(step: int, n: int, last: bool) -> RequestOutput:
    outs = [
        CompletionOutput(i, TEXTS[(step + i) % len(TEXTS)], [step], finish_reason="length" if last else None)
        for i in range(n)
    ]
    return RequestOutput("r", None, [1, 2, 3], None, outs, last)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
async def test_templated_chunks_are_the_chunks_built_whole(chat, include_usage):
    n, steps = 2, len(TEXTS) + 1
    fast, whole = (make_stream(chat, n, include_usage, templates) for templates in (True, False))
    for step in range(steps):
        item = (0, output(step, n, step == steps - 1))
        data, ended = fast.events([item])
        assert (data, ended) == whole.events([item])
        choices = [json.loads(event[6:])["choices"][0] for event in data.split(b"\n\n") if event]
        texts = [c["delta"]["content"] if chat else c["text"] for c in choices]
        assert texts == [TEXTS[(step + i) % len(TEXTS)] for i in range(n)]
    assert sorted(fast.templates) == [0, 1] and all(t is not None for t in fast.templates.values())


async def test_streams_with_per_chunk_fields_build_every_chunk():
    assert make_stream(False, 1, True).templates == {}
    usage_so_far = make_stream(False, 1, True, continuous_usage=True)
    with_logprobs = make_stream(False, 1, True, num_top=2)
    assert usage_so_far.templates is None and with_logprobs.templates is None

    class Numbered(EventStream):  # a subclass's chunks may keep state (the Responses API numbers its events)
        def chunk(self, choice, **kw):
            return super().chunk(choice, **kw)

    assert make_stream(False, 1, True, cls=Numbered).templates is None
