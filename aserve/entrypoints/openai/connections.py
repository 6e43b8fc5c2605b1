"""What a client may cost the server before its request runs: read timeouts, a connection limit, and the request body
(read and decoded without holding the loop).

aiohttp reads a request's headers and body for as long as the client keeps the connection open, so a client that
sends its headers (or a body) a byte at a time holds a connection and a file descriptor for ever. Every connection
of `aserve serve` goes through a GuardedConnection, a thin protocol in front of aiohttp's own, which knows the
connection's phase and gives each phase a deadline:

    HEADERS  a new connection, or a kept-alive one whose next request has begun: the headers must be complete
             within `timeout_headers` of the connection opening / the request's first byte (else 408 and close);
    ACTIVE   the handler runs (the middleware marks it): no deadline, however long a stream lasts;
    BODY     the handler reads the body: some of it must arrive every `timeout_body` seconds (else 408 and close);
    IDLE     the response is done: a kept-alive connection may wait `timeout_keep_alive` for its next request.

One timer per connection, re-armed lazily (a body's data only moves a timestamp). Connections beyond
`limit_concurrency` are answered 503 as soon as their request's first bytes arrive, and closed.

Request bodies (BodyReader): small ones (up to LARGE_BODY_BYTES) are read and decoded at once. Large ones cost the
loop in three places, each bounded here:
- receiving: a few are read at a time (LARGE_BODY_SLOTS); the rest wait with their connections paused by aiohttp's
  flow control. Ten 30 MB bodies received at once put ~10 MB of copying and page faults into every pass of the loop.
  A body holding a slot must arrive in full within the body timeout, so trickling ones cannot keep it.
- assembling: chunks are copied into an anonymous memory map as they arrive, so its memory is faulted in a little
  at a time (one 30 MB allocation filled at once, as aiohttp's request.read() or bytes.join do, holds the loop for
  tens of milliseconds in page faults alone).
- decoding (~1 ms per MB, with the GIL held): large bodies take turns, with a pause between turns long enough for
  the loop to finish what is waiting (a /health probe takes three passes of the loop: accept, read, answer). A body
  with a prompt is first measured without decoding its strings (protocol.min_prompt_chars), and a prompt that cannot
  fit the context however it is tokenised is refused before it is made into a string.

The listening socket is bound before the model loads (listen_socket: a port in use fails at once), and a request
that does not parse as HTTP is logged in one line (bad_http_in_one_line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import socket
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from aserve.entrypoints.openai.protocol import APIError, min_prompt_chars
from aserve.entrypoints.openai.responses import error_body

try:
    import resource
except ImportError:  # not on Windows
    resource = None

_HEADERS, _ACTIVE, _BODY, _IDLE, _REFUSED = range(5)
_REFUSED_LINGER_S = 1.0  # how long a refused connection waits for its request's first bytes before being closed


@dataclass
class ConnectionLimits:
    """The serve flags --timeout-headers, --timeout-body, --timeout-keep-alive and --limit-concurrency."""

    timeout_headers: float = 30.0
    timeout_body: float = 60.0
    timeout_keep_alive: float = 5.0
    limit_concurrency: int | None = None  # None: default_limit_concurrency()

    def validate(self) -> None:
        for name in ("timeout_headers", "timeout_body", "timeout_keep_alive"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"--limit-concurrency must be >= 1, got {self.limit_concurrency}")


def default_limit_concurrency(reserve: int = 256) -> int:
    """Raises this process's soft limit on open files to its hard limit (at most 65,536, as vLLM's server does)
    and leaves `reserve` descriptors for everything but client connections (model files, the tokenizer, logs)."""
    if resource is None:
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return max(16, soft - reserve) if soft != resource.RLIM_INFINITY else 65536


def _raw_error(status: int, reason: str, message: str, code: str, type_: str = "invalid_request_error") -> bytes:
    body = msgspec.json.encode(error_body(message, type_, None, code))
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """The connections of one listening socket. `protocol_factory` is what loop.create_server() takes; `server` is
    aiohttp's web.Server (AppRunner.server), which makes the protocol that parses HTTP and runs the app."""

    def __init__(self, server, limits: ConnectionLimits) -> None:
        limits.validate()
        self.server = server
        self.limits = limits
        self.limit = limits.limit_concurrency or default_limit_concurrency()
        self.loop = asyncio.get_running_loop()
        self.connections: dict[object, GuardedConnection] = {}  # aiohttp's handler -> its guard
        # the connections it ended, and those the server cut off mid-stream (slow_client)
        self.closed = {"header_timeout": 0, "body_timeout": 0, "connection_limit": 0, "slow_client": 0}
        self.on_closed = None  # called with the reason whenever it ends one (the server's metrics)

    def count_closed(self, reason: str) -> None:
        self.closed[reason] += 1
        if self.on_closed is not None:
            self.on_closed(reason)

    def protocol_factory(self) -> GuardedConnection:
        return GuardedConnection(self)

    # The middleware and the body reader tell a connection what its handler is doing (request.protocol is aiohttp's
    # handler); requests on connections this guard does not own (aiohttp's test server) are not followed.

    def request_started(self, handler) -> None:
        conn = self.connections.get(handler)
        if conn is not None:
            conn.enter(_ACTIVE)

    def request_finished(self, handler) -> None:
        conn = self.connections.get(handler)
        if conn is not None:
            conn.enter(_IDLE, self.limits.timeout_keep_alive)

    def body_started(self, handler) -> None:
        conn = self.connections.get(handler)
        if conn is not None:
            conn.last_data = self.loop.time()
            conn.enter(_BODY, self.limits.timeout_body)

    def body_finished(self, handler) -> None:
        conn = self.connections.get(handler)
        if conn is not None and conn.phase == _BODY:
            conn.enter(_ACTIVE)


class GuardedConnection(asyncio.Protocol):
    __slots__ = ("guard", "inner", "transport", "phase", "last_data", "_timer")

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.inner = None  # aiohttp's protocol, once the connection is admitted
        self.transport = None
        self.phase = _HEADERS
        self.last_data = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        guard = self.guard
        self.transport = transport
        if len(guard.connections) >= guard.limit:
            guard.count_closed("connection_limit")
            self.enter(_REFUSED, _REFUSED_LINGER_S)
            return
        self.inner = guard.server()
        guard.connections[self.inner] = self
        self.inner.connection_made(transport)
        self.enter(_HEADERS, guard.limits.timeout_headers)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            if self.phase == _REFUSED:
                self._refuse()
            return
        if self.phase == _IDLE:  # the next request on a kept-alive connection begins
            self.enter(_HEADERS, self.guard.limits.timeout_headers)
        elif self.phase == _BODY:
            self.last_data = self.guard.loop.time()
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        inner, self.inner = self.inner, None
        if inner is not None:
            self.guard.connections.pop(inner, None)
            inner.connection_lost(exc)

    def enter(self, phase: int, timeout: float | None = None) -> None:
        self.phase = phase
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if timeout is None else self.guard.loop.call_later(timeout, self._expire)

    def _expire(self) -> None:
        self._timer = None
        guard, phase = self.guard, self.phase
        if phase == _BODY:
            idle = guard.loop.time() - self.last_data
            if idle < guard.limits.timeout_body:
                self._timer = guard.loop.call_later(guard.limits.timeout_body - idle, self._expire)
                return
            self._time_out("body_timeout", f"no part of the request body arrived for {guard.limits.timeout_body:g} s")
        elif phase == _HEADERS:
            message = f"the request headers did not arrive within {guard.limits.timeout_headers:g} s"
            self._time_out("header_timeout", message)
        elif phase in (_IDLE, _REFUSED):
            self.transport.close()

    def _time_out(self, reason: str, message: str) -> None:
        self.guard.count_closed(reason)
        self.transport.write(_raw_error(408, "Request Timeout", message, "request_timeout"))
        self.transport.close()

    def _refuse(self) -> None:
        message = f"the server has reached its limit of {self.guard.limit} connections (--limit-concurrency)"
        self.transport.write(_raw_error(503, "Service Unavailable", message, "too_many_connections",
                                        "service_unavailable"))  # fmt: skip
        self.phase = -1  # answered: what else arrives is dropped
        self.transport.close()


MAX_BODY_BYTES = 32 * 1024 * 1024  # larger request bodies get 413 before any of them is parsed
LARGE_BODY_BYTES = 1024 * 1024
LARGE_BODY_SLOTS = 2  # large bodies received at once
_PAUSE_S = 0.002  # between two large bodies' decoding turns
_BODY_KEY = web.RequestKey("body", object)  # a body read and sniffed (POST /invocations), parsed again from here


class BodyReader:
    def __init__(self, check_prompt_chars: Callable[..., None]) -> None:
        """check_prompt_chars(num_chars, param, at_least=True) raises if a prompt that long cannot fit."""
        self.check_prompt_chars = check_prompt_chars
        self.timeout_body = 60.0  # --timeout-body
        self.connections = None  # the ConnectionGuard of `aserve serve`, told when a body is being read
        self._slots = asyncio.Semaphore(LARGE_BODY_SLOTS)
        self._turn = asyncio.Lock()

    async def parse(self, request: web.Request, struct_type, has_prompt: bool = False):
        """The request body decoded into `struct_type` (APIError 400 if it does not). has_prompt: a large body's
        prompt text is measured before it is decoded."""
        body = request.pop(_BODY_KEY, None)
        if body is None:
            body = await self.read(request)
        if len(body) <= LARGE_BODY_BYTES:
            return _decode(body, struct_type)
        try:
            async with self._turn:
                await asyncio.sleep(_PAUSE_S)
                if has_prompt and (sniffed := min_prompt_chars(body)) is not None:
                    self.check_prompt_chars(sniffed[1], sniffed[0], at_least=True)
                    await asyncio.sleep(_PAUSE_S)
                return _decode(body, struct_type)
        finally:
            body.close()

    async def sniff(self, request: web.Request, struct_type):
        """The body decoded into `struct_type` (a few of its fields), the body kept for the parse() that follows."""
        body = await self.read(request)
        try:
            if len(body) <= LARGE_BODY_BYTES:
                sniffed = _decode(body, struct_type)
            else:
                async with self._turn:
                    await asyncio.sleep(_PAUSE_S)
                    sniffed = _decode(body, struct_type)
        except BaseException:
            if not isinstance(body, bytes):
                body.close()
            raise
        request[_BODY_KEY] = body
        return sniffed

    async def read(self, request: web.Request) -> bytes | mmap.mmap:
        """The body, up to MAX_BODY_BYTES (else 413): bytes, or for one over LARGE_BODY_BYTES an anonymous memory
        map that the caller closes. A compressed body is refused before it is read: its Content-Length says nothing
        of what it inflates to (a small body can inflate to gigabytes before any limit applies; aiohttp's parser
        answers one that does not inflate with its own 400). A body that is not declared JSON is refused as vLLM
        refuses it (a browser's cross-site form post cannot declare it JSON without a CORS preflight)."""
        media_type = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed",
                           code="unsupported_media_type")  # fmt: skip
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise APIError(400, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                           code="unsupported_content_encoding")  # fmt: skip
        length = request.content_length
        if length is not None and length > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(MAX_BODY_BYTES, length)
        guard = self.connections
        if guard is not None:
            guard.body_started(request.protocol)  # from now on the body must keep arriving (--timeout-body)
        try:
            if length is not None and length > LARGE_BODY_BYTES:
                return await self._read_large(request, length)
            chunks, size = [], 0
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise web.HTTPRequestEntityTooLarge(MAX_BODY_BYTES, size)
                chunks.append(chunk)
            if size <= LARGE_BODY_BYTES:
                return b"".join(chunks)
            body, size = mmap.mmap(-1, size), 0  # a large chunked body
            for chunk in chunks:
                body[size : size + len(chunk)] = chunk
                size += len(chunk)
                if size % (4 * LARGE_BODY_BYTES) < len(chunk):
                    await asyncio.sleep(0)
            return body
        finally:
            if guard is not None:
                guard.body_finished(request.protocol)

    async def _read_large(self, request: web.Request, length: int) -> mmap.mmap:
        body, size = mmap.mmap(-1, length), 0

        async def fill() -> None:
            nonlocal size
            while chunk := await request.content.readany():  # the parser stops at Content-Length
                body[size : size + len(chunk)] = chunk
                size += len(chunk)

        try:
            async with self._slots:
                await asyncio.wait_for(fill(), self.timeout_body)
        except asyncio.TimeoutError:
            body.close()
            message = f"a request body over {LARGE_BODY_BYTES} bytes must arrive within {self.timeout_body:g} s"
            raise APIError(408, message, code="request_timeout") from None
        except BaseException:
            body.close()
            raise
        if size < length:
            body.close()
            raise ConnectionResetError("the client disconnected before its whole body arrived")
        return body


def _decode(body: bytes | mmap.mmap, struct_type):
    try:
        return msgspec.json.decode(body, type=struct_type)
    except msgspec.ValidationError as e:
        msg = str(e)
        if msg.startswith("Object contains unknown field `") and "at `$." not in msg:  # OpenAI's answer to it
            field = msg.split("`")[1]
            raise APIError(400, f"Unrecognized request argument supplied: {field}", param=field) from e
        param = msg.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in msg else None
        raise APIError(400, f"invalid request: {msg}", param=param) from e
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:  # msgspec's guard against deep nesting (Python's recursion limit, ~1,000 levels)
        raise APIError(400, "the request body is nested too deeply", code="json_too_deep") from e


# The connections the kernel queues for accept(): a burst of hundreds of new clients is queued, not dropped (a client
# whose connection is dropped retries after a second). create_server() listens again with its own default (100)
# unless it is given this too.
LISTEN_BACKLOG = socket.SOMAXCONN


async def start_listening(protocol_factory, sock: socket.socket, ssl=None,
                          ssl_handshake_timeout: float | None = None) -> asyncio.Server:  # fmt: skip
    """The event loop's server on `sock` (from listen_socket), with LISTEN_BACKLOG kept."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(protocol_factory, sock=sock, backlog=LISTEN_BACKLOG, ssl=ssl,
                                    ssl_handshake_timeout=ssl_handshake_timeout)  # fmt: skip


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now (ValueError naming the address when it cannot be)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def bad_http_in_one_line(record: logging.LogRecord) -> bool:
    """A request that does not parse as HTTP is the client's fault: aiohttp logs it as an ERROR with a traceback,
    which any client could repeat to fill the log; it becomes one WARNING line without the traceback (as uvicorn
    logs it). The client got its 400 either way."""
    from aiohttp.http_exceptions import HttpProcessingError

    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, HttpProcessingError):
        reason = " ".join(str(error.message).split())[:200]
        record.msg, record.args, record.exc_info, record.exc_text = "Invalid HTTP request: %s", (reason,), None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True
