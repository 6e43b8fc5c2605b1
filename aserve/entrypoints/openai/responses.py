"""What the server sends back: the OpenAI API's response bodies (completions and chat completions, whole or as stream
chunks, with logprobs and usage; error bodies), and the server-sent events of a streaming request.

A stream: the step coroutine leaves each step's outputs for a client request in one sink (OutputSink, shared by its
prompts); the handler wakes once for all of them and sends them in one socket write: a chunk per choice that changed
(one choice per chunk, as OpenAI and vLLM send them), coalescing several steps' tokens of a choice into one chunk when
the client or the loop fell behind. Once the headers are out, the step coroutine writes each step's events itself
(EventStream.put): one socket write per client per step, no task switch. A client that stops reading (its TCP window
full) gets at most ASERVE_STREAM_BUFFER (envs.py) bytes buffered, and its connection's kernel send buffer is bounded
by the same; then its requests are ended (their KV blocks freed) and its connection closed, and the loop never waits
on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import msgspec
from aiohttp import web

from aserve.engine.async_engine import OutputSink, StreamGroup
from aserve.entrypoints.openai.prompt_scoring import Echo, add_prompt_logprobs
from aserve.outputs import CompletionOutput, Logprob, RequestOutput

logger = logging.getLogger("aserve")

_encode = msgspec.json.encode

SLOW_CLIENT = "the client stopped reading its stream"
DONE = b"data: [DONE]\n\n"


class ChoiceState:
    """One choice of a response: everything generated so far, and the part not yet sent (for streams)."""

    def __init__(self, index: int, num_top: int | None) -> None:
        self.index = index
        self.want_logprobs = num_top is not None
        self.num_top = num_top or 0  # top alternatives per token, when logprobs are asked for
        self.text = ""
        self.num_tokens = 0
        self.logprobs: list[dict[int, Logprob]] = []
        self.token_ids: list[int] = []
        self.delta_text = ""
        self.delta_token_ids: list[int] = []
        self.delta_logprobs: list[dict[int, Logprob]] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.error_status = 500  # 500: an internal fault; 503: the server ended the request (shutting down)
        self.echo: Echo | None = None  # completions' echo: the prompt goes first (prompt_scoring.Echo)
        self.prompt_logprobs: list | None = None  # vLLM's prompt_logprobs, once known (reported once)
        self.prompt_logprobs_sent = False
        self.prompt_token_ids: list[int] = []  # the prompt as it ran (return_token_ids; its length: usage)
        self.prompt_token_ids_sent = False
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache
        self.output_token_ids: list[int] = []  # generated tokens only (token_ids may start with an echoed prompt)
        self.delta_output_token_ids: list[int] = []

    def add(self, comp: CompletionOutput, error: str | None) -> None:
        """Adds an output's delta; deltas gather until `clear_delta` (a stream sent them)."""
        if self.echo is not None:
            comp = self.echo.apply(self, comp)
        self.output_token_ids += comp.token_ids
        self.delta_output_token_ids += comp.token_ids
        self.delta_text += comp.text
        self.delta_token_ids += comp.token_ids
        if comp.logprobs:
            self.delta_logprobs += comp.logprobs
        self.text += comp.text
        self.token_ids += comp.token_ids
        self.num_tokens += len(comp.token_ids)
        self.logprobs += comp.logprobs or []
        if comp.finish_reason is not None:
            self.finish_reason, self.stop_reason = comp.finish_reason, comp.stop_reason
            if comp.finish_reason == "error":
                self.error = error or "the request failed"
            elif comp.finish_reason == "abort":  # clients never see their own aborts: the server ended it
                self.error, self.error_status = error or "the request was aborted", 503

    def clear_delta(self) -> None:
        self.delta_text, self.delta_token_ids, self.delta_logprobs = "", [], []
        self.delta_output_token_ids = []


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    """OpenAI's error object, for error responses and for the last event of a stream that failed."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; with `cached_tokens` (--enable-prompt-tokens-details), prompt_tokens_details too."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def cached_tokens(choices: list[ChoiceState], n: int) -> int:
    """Prompt tokens served from the prefix cache, over a response's prompts (choice index = prompt index * n + j)."""
    return sum(c.num_cached_tokens for c in choices[::n])


def add_token_ids(body: dict, choices: list[ChoiceState], chat: bool, final: bool, role_only: bool = False) -> None:
    """vLLM's return_token_ids: the prompt's token ids (at the top of a chat response, in each completions choice;
    a stream sends them once, first) and each choice's generated token ids (a stream chunk: its new ones).
    `choices`: those `body["choices"]` was built from, in order."""
    for choice, out in zip(choices, body["choices"]):
        if final or not choice.prompt_token_ids_sent:
            choice.prompt_token_ids_sent = True
            if chat:
                body["prompt_token_ids"] = choice.prompt_token_ids
            else:
                out["prompt_token_ids"] = choice.prompt_token_ids
        if not role_only:
            out["token_ids"] = choice.output_token_ids if final else choice.delta_output_token_ids


# A logprob of -inf (a token the request's mask excludes) has no JSON number: reported as vLLM does.
_MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _top_entries(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The top-n alternatives of one position, most likely first."""
    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num_top), key=lambda x: x[1].rank)
    return top[:num_top]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int, offset: int) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset. An echoed prompt's first
    token has no logprob: its entry is a placeholder (prompt_scoring.first_token_entry), reported as nulls."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        sampled = entry[token_id]
        if sampled.rank == 0:
            tokens.append(sampled.decoded_token or "")
            token_logprobs.append(None)
            top_logprobs.append(None)
            text_offset.append(offset)
            offset += len(tokens[-1])
            continue
        text = sampled.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(_clamp(sampled.logprob))
        # the top `num_top` and the sampled token, wherever it ranks (up to num_top + 1 entries, as OpenAI's)
        top = {(lp.decoded_token or ""): _clamp(lp.logprob) for _, lp in _top_entries(entry, num_top)}
        top.setdefault(text, _clamp(sampled.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int) -> dict:
    """OpenAI's chat shape: per token, the sampled token and its logprob, and top_logprobs: the `num_top` most likely
    (the sampled token among them only where it ranks)."""

    def item(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": _clamp(lp.logprob), "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(token_ids, entries):
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for _, lp in _top_entries(entry, num_top)]})
    return {"content": content}


def completion_chunk(request_id, created, model, choices: list[ChoiceState], final: bool, role_only=False) -> dict:
    out = []
    for c in choices:
        text, ids, entries = (
            (c.text, c.token_ids, c.logprobs) if final else (c.delta_text, c.delta_token_ids, c.delta_logprobs)
        )
        logprobs = None
        if c.want_logprobs:
            offset = 0 if final else len(c.text) - len(c.delta_text)
            logprobs = completion_logprobs(ids, entries, c.num_top, offset)
        out.append(
            {
                "index": c.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": out}


def chat_chunk(request_id, created, model, choices: list[ChoiceState], final: bool = False, role_only=False) -> dict:
    out = []
    for c in choices:
        if role_only:
            out.append(
                {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            continue
        text, ids, entries = (
            (c.text, c.token_ids, c.logprobs) if final else (c.delta_text, c.delta_token_ids, c.delta_logprobs)
        )
        logprobs = chat_logprobs(ids, entries, c.num_top) if c.want_logprobs else None
        if final:
            out.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        else:
            out.append(
                {
                    "index": c.index,
                    "delta": {"content": text},
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    obj = "chat.completion" if final else "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": out}


def chat_echo_chunk(request_id, created, model, choice: ChoiceState, text: str) -> dict:
    """A chat stream's chunk of echoed text (the chat request's echo), before anything generated."""
    delta = {"index": choice.index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [delta]}


def sse(obj) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def absorb(choices: list[ChoiceState], prompt_index: int, n: int, out: RequestOutput) -> list[ChoiceState]:
    """Adds a request's output to its choices (choice index = prompt index * n + sample index) -> those touched."""
    touched = []
    if out.prompt_logprobs is not None:  # reported once per prompt, for all its choices
        for j in range(n):
            choices[prompt_index * n + j].prompt_logprobs = out.prompt_logprobs
    for j in range(n):
        choices[prompt_index * n + j].num_cached_tokens = out.num_cached_tokens
    for comp in out.outputs:
        choice = choices[prompt_index * n + comp.index]
        choice.add(comp, out.error)
        touched.append(choice)
    return touched


def error_events(message: str, status: int) -> bytes:
    """The last events of a stream that cannot finish: the error (vLLM's shape: the HTTP status as the code), then
    [DONE]."""
    error = error_body(message, "server_error" if status == 500 else "service_unavailable", code=status)
    return sse(error) + DONE


def http_chunk(data: bytes) -> bytes:
    """`data` in HTTP/1.1 chunked framing (what aiohttp writes for a streamed response)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class EventStream(OutputSink):
    """The sink of one streaming response. Until `go_direct()` it is a plain OutputSink (the handler takes what
    waits); after, each put() turns the outputs into events and writes them to the socket at once, on the step
    coroutine's turn: one write per client per step, no task switch, no await. `done` resolves when the stream has
    ended (True: finished, the last events written; False: cut off or failed)."""

    def __init__(self, request: web.Request, model: str, req, request_id: str, created: int,
                 choices: list[ChoiceState], prompt_tokens: int, chat: bool, on_slow_client, buffer_limit: int,
                 tools=None, echo: str = "", prompt_tokens_details: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.request, self.model, self.request_id, self.created = request, model, request_id, created
        self.choices, self.prompt_tokens, self.chat, self.n = choices, prompt_tokens, chat, req.n
        self.builder = chat_chunk if chat else completion_chunk
        self.include_usage = req.include_usage
        self.continuous_usage = req.continuous_usage  # usage so far on every chunk
        self.prompt_tokens_details = prompt_tokens_details  # the usage chunk reports cached prompt tokens
        self.return_token_ids = bool(req.return_token_ids)
        self.echo = echo  # a chat's echoed text, sent after the role chunks
        self.report_prompt_logprobs = req.prompt_logprobs is not None
        self.on_slow_client = on_slow_client
        self.tools = tools  # a chat's tool-call handling (tool_output.ToolCallOutput): rewrites each delta
        self.group: StreamGroup | None = None
        self.transport = None
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.buffer_limit = buffer_limit  # bytes waiting for the client before it is cut off

    def chunk(self, choice: ChoiceState, **kw) -> bytes:
        role_only = kw.get("role_only", False)
        body = self.builder(self.request_id, self.created, self.model, [choice], **kw)
        if self.return_token_ids:
            add_token_ids(body, [choice], self.chat, final=False, role_only=role_only)
        if self.tools is not None and not role_only and not self.tools.delta(body["choices"][0], choice):
            if not (self.return_token_ids and choice.delta_output_token_ids):
                return b""  # text held back while a tool call may be forming
        if self.report_prompt_logprobs and not role_only:
            add_prompt_logprobs(body, [choice], self.chat)
        return sse(self.with_usage(body, choice, role_only))

    def with_usage(self, body: dict, choice: ChoiceState, role_only: bool = False) -> dict:
        """A chunk's usage: null, or with continuous_usage_stats, the choice's so far (as vLLM reports it)."""
        if self.include_usage:
            completion_tokens = 0 if role_only else choice.num_tokens
            body["usage"] = usage(len(choice.prompt_token_ids), completion_tokens) if self.continuous_usage else None
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
                return error_events(f"the engine failed: {out}", 500), True
            for choice in absorb(self.choices, i, self.n, out):
                touched[choice.index] = choice
        failed = next((c for c in touched.values() if c.error), None)
        if failed is not None:
            self.include_usage = False
            return error_events(failed.error, failed.error_status), True
        parts = []
        for choice in touched.values():
            parts.append(self.chunk(choice, final=False))
            choice.clear_delta()
        if self.group is not None and all(s.finished for s in self.group.streams):
            parts.append(self.tail())
            return b"".join(parts), True
        return b"".join(parts), False

    def tail(self) -> bytes:
        tail = DONE
        if self.include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            cached = cached_tokens(self.choices, self.n) if self.prompt_tokens_details else None
            totals = usage(self.prompt_tokens, sum(c.num_tokens for c in self.choices), cached)
            body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                    "choices": [], "usage": totals}  # fmt: skip
            tail = sse(body) + tail
        return tail

    def go_direct(self) -> None:
        """From now on put() writes (HTTP/1.1 chunked framing, straight to the transport: aiohttp has sent the
        headers). The connection's kernel send buffer is bounded by the same buffer_limit: left to autotuning it
        takes megabytes from a client that stopped reading (~2 MB on loopback against a 2 KiB receive window) before
        anything waits in the transport."""
        self.transport = self.request.transport
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.buffer_limit)

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
            if data:
                transport.write(http_chunk(data))
            if ended:
                self._end(True)
            elif transport.get_write_buffer_size() > self.buffer_limit:
                self._cut_off()
        except Exception:  # a fault here ends this stream only (with an error event), never the step coroutine
            logger.exception("stream %s failed", self.request_id)
            with contextlib.suppress(Exception):
                self.transport.write(http_chunk(error_events("internal server error", 500)))
            self._end(True)

    def _end(self, finished: bool) -> None:
        if not self.done.done():
            self.done.set_result(finished)

    def _cut_off(self) -> None:
        logger.warning("stream %s: %s; ending it", self.request_id, SLOW_CLIENT)
        self._end(False)
        self.transport.close()
        if self.on_slow_client is not None:
            self.on_slow_client()


async def stream_response(request: web.Request, stream: EventStream, group: StreamGroup) -> web.StreamResponse:
    """Streams `group`'s outputs (added with `stream` as their sink) as SSE chunks, then the usage chunk (if asked
    for) and [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    stream.group = group
    try:
        await response.prepare(request)  # raises ConnectionError if the client has already hung up
        # The first events go through aiohttp (they carry the headers); direct writes follow where the framing is
        # HTTP/1.1 chunks.
        await response.write(stream.head())
        direct = request.version >= (1, 1) and request.transport is not None
        ended = False
        while not ended:
            if direct and not stream.items:
                stream.go_direct()
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
            await response.write(error_events("internal server error", 500))
            await response.write_eof()
    finally:
        await group.aclose()  # a client that went away aborts its requests here
    return response
