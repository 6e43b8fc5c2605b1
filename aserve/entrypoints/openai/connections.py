"""What a connection may cost the server before it has sent a request: read timeouts and a connection limit.

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
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import msgspec

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
