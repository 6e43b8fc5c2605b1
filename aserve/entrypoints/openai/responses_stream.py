"""A Responses request's stream: the chat path's stream deltas (EventStream's chunks, the tool calls and reasoning
already split from the text) as the Responses API's server-sent events, each `event: <type>` with its JSON and a
sequence_number counting from 0:

    response.created, response.in_progress                       the response, in_progress, no output yet
    for each output item, in the order the reply writes them:
      reasoning      output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
                     content_part.done, output_item.done
      message        output_item.added, content_part.added, output_text.delta..., output_text.done,
                     content_part.done, output_item.done
      function_call  output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                     output_item.done
    response.completed                                           the whole response (completed or incomplete)

An item ends when the next begins (or the reply ends). A reply that writes nothing is one empty message, as a whole
response is. A stream that cannot finish ends with an `error` event and response.failed. Flow control, and a client
that goes away (its request aborted), are EventStream's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from aserve.entrypoints.openai.event_stream import EventStream
from aserve.entrypoints.openai.responses import ChoiceState, error_type
from aserve.entrypoints.openai.responses_items import (
    COMPLETED,
    FAILED,
    IN_PROGRESS,
    function_call_item,
    message_item,
    new_item_id,
    output_text,
    reasoning_item,
    response_status,
)

if TYPE_CHECKING:
    from aserve.entrypoints.openai.responses_output import ResponseReply

_encode = msgspec.json.encode
_ID_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


@dataclass(slots=True)
class _Item:
    """An output item as far as streamed: its text (a function call's: its arguments)."""

    kind: str  # reasoning | message | function_call
    index: int  # its output_index
    id: str
    call_id: str = ""
    name: str = ""
    text: str = ""
    logprobs: list = field(default_factory=list)
    done: dict | None = None  # the item as output_item.done sent it

    def as_dict(self, status: str, added: bool = False) -> dict:
        """The item's object; `added`: as output_item.added shows it (no content yet)."""
        text = None if added else self.text
        if self.kind == "message":
            return message_item(self.id, text, self.logprobs, status)
        if self.kind == "reasoning":
            return reasoning_item(self.id, text, status)
        return function_call_item(self.id, self.call_id, self.name, self.text, status)


class ResponseEventStream(EventStream):
    """The sink of one streaming Responses request: EventStream's writes and flow control, this module's events."""

    def __init__(self, *args, reply: ResponseReply) -> None:
        super().__init__(*args)
        self.reply = reply
        self.sequence_number = 0
        self.items: list[_Item] = []
        self.calls: dict[int, _Item] = {}  # a chat delta's tool-call index -> its item
        self.open: _Item | None = None
        self.logprobs: list = []  # those of tokens whose text has not come yet (a character's first bytes)

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: %b\ndata: %b\n\n" % (kind.encode(), _encode(data))

    def head(self) -> bytes:
        response = self.reply.response(self.request_id, self.created, IN_PROGRESS, [])
        return self.event("response.created", response=response) + self.event("response.in_progress",
                                                                               response=response)  # fmt: skip

    def chunk(self, choice: ChoiceState, **kw) -> bytes:
        body = self.chunk_body(choice, **kw)
        if body is None:
            return b""
        chat = body["choices"][0]
        delta = chat.get("delta") or {}
        out = []
        if chat.get("logprobs"):
            self.logprobs += chat["logprobs"]["content"]
        if delta.get("reasoning"):
            out.append(self._text("reasoning", delta["reasoning"]))
        if delta.get("content"):
            out.append(self._text("message", delta["content"]))
        for call in delta.get("tool_calls") or ():
            out.append(self._call(call))
        return b"".join(out)

    def tail(self) -> bytes:
        choice = self.choices[0]
        status = response_status(choice.finish_reason)
        out = self._close(status)
        if not self.items:
            out += self._add("message") + self._close(status)
        details = self.tools.completion_tokens_details([choice]) if self.tools is not None else None
        response = self.reply.finish(self.request_id, self.created, status, [i.done for i in self.items], choice,
                                     details)  # fmt: skip
        return out + self.event("response.completed", response=response)

    def error_events(self, message: str, status: int) -> bytes:
        """OpenAI's `error` event, then the response as failed (with the items finished so far)."""
        code = error_type(status)
        output = [item.done for item in self.items if item.done is not None]
        response = self.reply.response(self.request_id, self.created, FAILED, output,
                                       error={"code": code, "message": message})  # fmt: skip
        return self.event("error", code=code, message=message, param=None) + self.event("response.failed",
                                                                                         response=response)  # fmt: skip

    def _text(self, kind: str, piece: str) -> bytes:
        """A piece of reasoning or of the message's text (the item begun if it is not the open one)."""
        out = b""
        if self.open is None or self.open.kind != kind:
            out = self._close() + self._add(kind)
        item = self.open
        item.text += piece
        where = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        if kind == "reasoning":
            return out + self.event("response.reasoning_text.delta", **where, delta=piece)
        logprobs, self.logprobs = self.logprobs, []
        item.logprobs += logprobs
        return out + self.event("response.output_text.delta", **where, delta=piece, logprobs=logprobs)

    def _call(self, call: dict) -> bytes:
        """A chat tool-call delta: a call's first (with its id and name) begins its item; pieces of its arguments."""
        function = call.get("function") or {}
        out = b""
        if call.get("id") is not None:
            out = self._close() + self._add("function_call", call["id"], function.get("name") or "")
            self.calls[call["index"]] = self.open
        item = self.calls[call["index"]]
        piece = function.get("arguments") or ""
        if not piece:
            return out
        item.text += piece
        return out + self.event("response.function_call_arguments.delta", item_id=item.id, output_index=item.index,
                                delta=piece)  # fmt: skip

    def _add(self, kind: str, call_id: str = "", name: str = "") -> bytes:
        item = _Item(kind, len(self.items), new_item_id(_ID_PREFIXES[kind]), call_id, name)
        self.items.append(item)
        self.open = item
        out = self.event("response.output_item.added", output_index=item.index,
                         item=item.as_dict(IN_PROGRESS, added=True))  # fmt: skip
        if kind != "function_call":
            out += self.event("response.content_part.added", item_id=item.id, output_index=item.index,
                              content_index=0, part=self._part(item))  # fmt: skip
        return out

    def _close(self, status: str = COMPLETED) -> bytes:
        """Ends the open item (a message with the reply's `status`; the others are complete when the next begins)."""
        item, self.open = self.open, None
        if item is None:
            return b""
        if item.kind == "message":  # logprobs of tokens that wrote no text (the reply's last)
            item.logprobs += self.logprobs
            self.logprobs = []
        item.done = item.as_dict(status if item.kind == "message" else COMPLETED)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            out = self.event("response.function_call_arguments.done", **where, name=item.name, arguments=item.text)
        else:
            if item.kind == "message":
                out = self.event("response.output_text.done", **where, content_index=0, text=item.text,
                                 logprobs=item.logprobs)  # fmt: skip
            else:
                out = self.event("response.reasoning_text.done", **where, content_index=0, text=item.text)
            out += self.event("response.content_part.done", **where, content_index=0, part=self._part(item))
        return out + self.event("response.output_item.done", output_index=item.index, item=item.done)

    @staticmethod
    def _part(item: _Item) -> dict:
        if item.kind == "message":
            return output_text(item.text, item.logprobs)
        return {"type": "reasoning_text", "text": item.text}
