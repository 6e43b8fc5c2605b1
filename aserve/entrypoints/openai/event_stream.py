"""A streaming response's events on the wire, written by the step coroutine, and its flow control.

A stream: the step coroutine leaves each step's outputs for a client request in one sink (OutputSink, shared by its
prompts); the handler wakes once for all of them and sends them in one socket write: a chunk per choice that changed
(one choice per chunk, as OpenAI and vLLM send them), coalescing several steps' tokens of a choice into one chunk when
the client or the loop fell behind. Once the headers are out, the step coroutine writes each step's events itself
(EventStream.put): one socket write per client per step, no task switch (HTTP/1.1 chunks, or an HTTP/1.0 body as
it is).

Flow control: a client that has not taken a step's events by the next step (they still wait in the transport, the
connection's kernel send buffer being full: SEND_BUFFER) has its requests paused (AsyncEngine.set_paused): they leave
the batch, costing the others nothing, and keep their KV blocks until another request needs them. They resume once
the client has read what waits. A stream paused for longer than FlowControl.stall_timeout, or with more than
FlowControl.buffer bytes waiting, is cut off: its requests end (their blocks freed) and its connection is closed. The
loop never waits on a client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from aserve.engine.streams import OutputSink, StreamGroup
from aserve.entrypoints.openai.prompt_scoring import add_prompt_logprobs
from aserve.entrypoints.openai.responses import (
    DONE,
    ChoiceState,
    absorb,
    add_token_ids,
    cached_tokens,
    chat_chunk,
    chat_echo_chunk,
    completion_chunk,
    error_events,
    sse,
    usage,
)

logger = logging.getLogger("aserve")

SLOW_CLIENT = "the client stopped reading its stream"
# A stream's kernel send buffer (SO_SNDBUF; Linux doubles it): with the client's receive buffer, what a client that
# stopped reading takes before its requests pause (~19 tokens of 20 logprobs each against a 2 KiB receive window,
# measured on loopback; 30 with 16 KiB, 15 with 4 KiB). It also bounds the bytes in flight to a client far away:
# 16 KiB per round trip, 160 KB/s at 100 ms, paced by pausing beyond that. Left to autotuning, the kernel takes
# megabytes (~2 MB on loopback against a 2 KiB receive window).
SEND_BUFFER = 8 << 10
POLL_FIRST_S, POLL_MAX_S = 0.005, 0.1  # a paused stream checks whether its client read: first after, at most every


@dataclass(frozen=True, slots=True)
class FlowControl:
    """What a streaming client that stopped reading may hold: `buffer` bytes of events waiting for it, and
    `stall_timeout` seconds with its requests paused (envs.py: ASERVE_STREAM_BUFFER, ASERVE_STREAM_STALL_TIMEOUT);
    and whom a stream tells when it pauses its requests and when it cuts its client off (the server's metrics)."""

    buffer: int
    stall_timeout: float
    on_pause: Callable[[], None] | None = None
    on_cut_off: Callable[[], None] | None = None


_CHUNK_METHODS = ("chunk", "chunk_body", "with_usage")  # what builds a running choice's chunk


def http_chunk(data: bytes) -> bytes:
    """`data` in HTTP/1.1 chunked framing (what aiohttp writes for a streamed response)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def raw(data: bytes) -> bytes:
    """`data` as it is: an HTTP/1.0 response's body, which ends when the connection closes."""
    return data


class EventStream(OutputSink):
    """The sink of one streaming response. Until `go_direct()` it is a plain OutputSink (the handler takes what
    waits); after, each put() turns the outputs into events and writes them to the socket at once, on the step
    coroutine's turn: one write per client per step, no task switch, no await; and pauses the requests while the
    client does not read (the module's docstring). `done` resolves when the stream has ended (True: finished, the
    last events written; False: cut off or failed)."""

    def __init__(self, request: web.Request, model: str, req, request_id: str, created: int,
                 choices: list[ChoiceState], prompt_tokens: int, chat: bool, flow: FlowControl,
                 tools=None, echo: str = "", prompt_tokens_details: bool = False,
                 role: str = "assistant") -> None:  # fmt: skip
        super().__init__()
        self.request, self.model, self.request_id, self.created = request, model, request_id, created
        self.choices, self.prompt_tokens, self.chat, self.n = choices, prompt_tokens, chat, req.n
        self.builder = functools.partial(chat_chunk, role=role) if chat else completion_chunk
        self.include_usage = req.include_usage
        self.continuous_usage = req.continuous_usage  # usage so far on every chunk
        self.prompt_tokens_details = prompt_tokens_details  # the usage chunk reports cached prompt tokens
        self.return_token_ids = bool(req.return_token_ids)
        self.echo = echo  # a chat's echoed text, sent after the role chunks
        self.interval = 1  # stream_interval: a choice's tokens go out in chunks of at least this many
        self.report_prompt_logprobs = req.prompt_logprobs is not None
        self.tools = tools  # a chat's tool-call handling (tool_output.ToolCallOutput): rewrites each delta
        self.group: StreamGroup | None = None
        self.transport = None
        self.frame = http_chunk  # how a direct write frames its bytes (go_direct)
        self.unsent = b""  # the response's headers, where they go out with the first direct write (go_direct)
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future = self.loop.create_future()
        self.flow = flow
        self.stalled_since: float | None = None  # when its requests were paused (the client not reading)
        self._poll: asyncio.TimerHandle | None = None
        # A running choice's chunk as the bytes around its delta text, per choice index, where nothing else in the
        # chunk changes between steps (no logprobs, token ids, tool or reasoning handling, prompt logprobs or usage
        # so far, and this class's own chunks: a subclass's may keep state, as the Responses API's sequence
        # numbers); None: every chunk goes through chunk().
        own_chunks = all(getattr(type(self), name) is getattr(EventStream, name) for name in _CHUNK_METHODS)
        self.templates: dict[int, tuple[bytes, bytes] | None] | None = None if (
            not own_chunks or self.return_token_ids or self.report_prompt_logprobs or self.tools is not None
            or self.continuous_usage or any(c.want_logprobs for c in choices)) else {}  # fmt: skip

    def template(self, index: int) -> tuple[bytes, bytes] | None:
        """The bytes of choice `index`'s running chunk before and after its delta text, cut once from chunk()'s own
        bytes for a marker text (None where the marker's encoding is not found exactly once)."""
        if index in self.templates:
            return self.templates[index]
        marker = "\x00marker\x00"
        probe = ChoiceState(index, None)
        probe.delta_text = marker
        parts = self.chunk(probe, final=False).split(msgspec.json.encode(marker))
        self.templates[index] = template = (parts[0], parts[1]) if len(parts) == 2 else None
        return template

    def chunk(self, choice: ChoiceState, **kw) -> bytes:
        body = self.chunk_body(choice, **kw)
        return b"" if body is None else sse(self.with_usage(body, choice, kw.get("role_only", False)))

    def chunk_body(self, choice: ChoiceState, **kw) -> dict | None:
        """One choice's chunk as a dict, its delta rewritten by the tool-call (and reasoning) handling; None while
        its text is held back (a tool call may be forming)."""
        role_only = kw.get("role_only", False)
        body = self.builder(self.request_id, self.created, self.model, [choice], **kw)
        if self.return_token_ids:
            add_token_ids(body, [choice], self.chat, final=False, role_only=role_only)
        if self.tools is not None and not role_only and not self.tools.delta(body["choices"][0], choice):
            if not (self.return_token_ids and choice.delta_output_token_ids):
                return None
        if self.report_prompt_logprobs and not role_only:
            add_prompt_logprobs(body, [choice], self.chat)
        return body

    def with_usage(self, body: dict, choice: ChoiceState, role_only: bool = False) -> dict:
        """A chunk's usage: null, or with continuous_usage_stats, the choice's so far (as vLLM reports it)."""
        if self.include_usage:
            completion_tokens = 0 if role_only else choice.num_tokens
            details = self.tools.completion_tokens_details([choice]) if self.tools is not None else None
            body["usage"] = usage(len(choice.prompt_token_ids), completion_tokens, None, details) if (
                self.continuous_usage) else None  # fmt: skip
        return body

    def head(self) -> bytes:
        """A chat stream's first events: each choice's role chunk, then its echoed text if any."""
        if not self.chat:
            return b""
        parts = [self.chunk(c, role_only=True) for c in self.choices]
        if self.echo:
            for c in self.choices:
                body = chat_echo_chunk(self.request_id, self.created, self.model, c, self.echo)
                parts.append(sse(self.with_usage(body, c, role_only=True)))
        return b"".join(parts)

    def events(self, batch: list) -> tuple[bytes, bool]:
        """(tag, output or error) items -> their events, and whether the stream ends with them (every choice
        finished, or an error: its event is the last before [DONE], with no usage chunk)."""
        touched: dict[int, ChoiceState] = {}
        for i, out in batch:
            if isinstance(out, BaseException):
                self.include_usage = False
                return self.error_events(f"the engine failed: {out}", 500), True
            for choice in absorb(self.choices, i, self.n, out):
                touched[choice.index] = choice
        failed = next((c for c in touched.values() if c.error), None)
        if failed is not None:
            self.include_usage = False
            return self.error_events(failed.error, failed.error_status), True
        parts = []
        for choice in touched.values():
            if self.interval > 1 and choice.chunks_sent and choice.finish_reason is None and (
                    len(choice.delta_output_token_ids) < self.interval):  # fmt: skip
                continue  # stream_interval: the tokens wait for the next ones (the first and last chunks do not)
            template = None
            if self.templates is not None and choice.finish_reason is None:
                template = self.template(choice.index)
            if template is not None:
                parts.append(template[0] + msgspec.json.encode(choice.delta_text) + template[1])
            else:
                parts.append(self.chunk(choice, final=False))
            choice.clear_delta()
            choice.chunks_sent += 1
        if self.group is not None and all(s.finished for s in self.group.streams):
            parts.append(self.tail())
            return b"".join(parts), True
        return b"".join(parts), False

    def error_events(self, message: str, status: int) -> bytes:
        """The last events of a stream that cannot finish (`status`: the HTTP status the error would have had)."""
        return error_events(message, status)

    def tail(self) -> bytes:
        tail = DONE
        if self.include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            cached = cached_tokens(self.choices, self.n) if self.prompt_tokens_details else None
            details = self.tools.completion_tokens_details(self.choices) if self.tools is not None else None
            totals = usage(self.prompt_tokens, sum(c.num_tokens for c in self.choices), cached, details)
            body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                    "choices": [], "usage": totals}  # fmt: skip
            tail = sse(body) + tail
        return tail

    def go_direct(self, unsent: bytes = b"") -> None:
        """From now on put() writes straight to the transport, in HTTP/1.1 chunked framing or, for an HTTP/1.0
        request, raw (as aiohttp frames each), with the connection's kernel send buffer bounded by SEND_BUFFER.
        unsent: the response's headers if aiohttp has not sent them; the first write carries them."""
        self.unsent = unsent
        self.frame = http_chunk if self.request.version >= (1, 1) else raw
        self.transport = self.request.transport
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, min(SEND_BUFFER, self.flow.buffer))

    def put(self, item) -> None:
        if self.transport is None:
            return super().put(item)
        if self.done.done():
            return
        try:
            data, ended = self.events([item])
            transport = self.transport
            if transport.is_closing():  # the client went away: its requests end now
                return self._end(False)
            unread = transport.get_write_buffer_size()  # what the client has not taken since the last step
            if data:
                transport.write(self.unsent + self.frame(data) if self.unsent else self.frame(data))
                self.unsent = b""
            elif ended and self.unsent:
                transport.write(self.unsent)
                self.unsent = b""
            if ended:
                self._end(True)
            elif transport.get_write_buffer_size() > self.flow.buffer:
                self._cut_off()
            elif unread and self.stalled_since is None:
                self._pause()
        except Exception:  # a fault here ends this stream only (with an error event), never the step coroutine
            logger.exception("stream %s failed", self.request_id)
            with contextlib.suppress(Exception):
                self.transport.write(self.unsent + self.frame(self.error_events("internal server error", 500)))
            self._end(True)

    def _pause(self) -> None:
        self.stalled_since = self.loop.time()
        self.group.set_paused(True)
        if self.flow.on_pause is not None:
            self.flow.on_pause()
        self._poll = self.loop.call_later(POLL_FIRST_S, self._check_reader, POLL_FIRST_S)

    def _check_reader(self, interval: float) -> None:
        """A paused stream's poll: resume once the client took what waits; cut off once paused too long."""
        self._poll = None
        if self.done.done():
            return
        if self.transport.is_closing():  # the client went away while paused
            return self._end(False)
        if not self.transport.get_write_buffer_size():
            self.stalled_since = None
            self.group.set_paused(False)
        elif self.loop.time() - self.stalled_since > self.flow.stall_timeout:
            self._cut_off()
        else:
            interval = min(2 * interval, POLL_MAX_S)
            self._poll = self.loop.call_later(interval, self._check_reader, interval)

    def _end(self, finished: bool) -> None:
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        if not self.done.done():
            self.done.set_result(finished)

    def _cut_off(self) -> None:
        logger.warning("stream %s: %s; ending it", self.request_id, SLOW_CLIENT)
        self._end(False)
        self.transport.close()
        if self.flow.on_cut_off is not None:
            self.flow.on_cut_off()


def _unsent_headers(response: web.StreamResponse) -> bytes:
    """The response's serialised headers if aiohttp still holds them (taken from it: the caller sends them), else
    b"" (aiohttp has sent them, or keeps them differently)."""
    writer = response._payload_writer
    headers = getattr(writer, "_headers_buf", None)
    if not headers or getattr(writer, "_headers_written", True):
        return b""
    writer._headers_buf, writer._headers_written = None, True
    return bytes(headers)


async def stream_response(request: web.Request, stream: EventStream, group: StreamGroup) -> web.StreamResponse:
    """Streams `group`'s outputs (added with `stream` as their sink) as SSE chunks, then the usage chunk (if asked
    for) and [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    # aiohttp keeps the headers until the first write, which then carries them: one send instead of two.
    response._send_headers_immediately = False
    stream.group = group
    try:
        await response.prepare(request)  # raises ConnectionError if the client has already hung up
        head = stream.head()  # the first events go through aiohttp; direct writes follow
        if head:
            await response.write(head)
        direct = request.transport is not None
        ended = False
        while not ended:
            if direct and not stream.items:
                stream.go_direct(_unsent_headers(response))
                break
            data, ended = stream.events(await stream.get_all())
            await response.write(data)
        if not ended and not await stream.done:
            return response  # cut off, or the client went away: its requests end below
        await response.write_eof()
    except asyncio.CancelledError:
        raise  # the client went away (aiohttp cancels the handler): nobody to tell
    except ConnectionError:  # the client went away while we wrote to it: nobody to tell, nothing to log
        pass
    except Exception:  # headers are sent: the error can only go in the stream
        logger.exception("stream %s failed", stream.request_id)
        with contextlib.suppress(Exception):  # the client may be gone as well
            await response.write(stream.error_events("internal server error", 500))
            await response.write_eof()
    finally:
        await group.aclose()  # a client that went away aborts its requests here
    return response
