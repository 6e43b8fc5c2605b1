"""The errors the serving engine raises about itself rather than about a request's content (which is a ParamError):
the server maps them to HTTP 503 (dead, closed) and 429 (overloaded)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    pass


class EngineClosedError(EngineDeadError):
    """The server is shutting down and takes no more requests (HTTP 503)."""


class EngineOverloadedError(RuntimeError):
    """More work would wait than a limit allows (HTTP 429 with Retry-After): sequences beyond `max_queue_len`, or
    prompt text beyond what may be tokenised at once. Shedding load at the door keeps the latency of admitted
    requests bounded instead of letting the queue (and every client's wait) grow."""

    def __init__(self, message: str, retry_after: int, code: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.code = code
