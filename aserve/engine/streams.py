"""The outputs of requests on their way from AsyncEngine's step coroutine to their consumers: a sink per consumer
(OutputSink), a request's outputs as an async iterator (RequestStream), and the requests of one client request read
together (StreamGroup)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aserve.outputs import RequestOutput

if TYPE_CHECKING:
    from aserve.engine.async_engine import AsyncEngine


class OutputSink:
    """Where the step coroutine leaves outputs for one consumer: a list and at most one waiter, so a step hands each
    consumer everything it produced at once, and a consumer that falls behind takes several steps' outputs in one
    go. Several requests may share a sink (a completion with several prompts); items are (tag, output or error).
    A consumer may override put() to act on each item at once (the server's streams write their events there)."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: list = []
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get_all(self) -> list:
        """Every item waiting (at least one; waits for it)."""
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self.items = self.items, []
        return items


class RequestStream:
    """The outputs of one request, as an async iterator. aclose() before the end aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, sink: OutputSink | None = None, tag: int = 0) -> None:
        self.engine = engine
        self.request_id = request_id
        self.sink = sink if sink is not None else OutputSink()
        self.tag = tag
        self.finished = False  # the engine is done with it (its final output is in the sink, or it was closed)
        self._ready: list = []

    def deliver(self, item) -> None:
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        self.sink.put((self.tag, item))

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._ready:
            if self.finished and not self.sink.items:
                raise StopAsyncIteration
            try:
                self._ready = [item for _, item in await self.sink.get_all()]
            except BaseException:  # cancelled while waiting: the consumer is gone
                await self.aclose()
                raise
            self._ready.reverse()
        out = self._ready.pop()
        if isinstance(out, BaseException):
            self._ready.clear()
            self.sink.items.clear()
            await self.aclose()
            raise out
        if out.finished:
            self._ready.clear()
            self.sink.items.clear()
        return out

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._release(self.request_id)


class StreamGroup:
    """The requests of one client request (a completion may carry several prompts), read through one shared sink:
    `batches()` yields every (tag, output) that arrived since the last batch; an error delivered to any of them is
    raised. aclose() aborts the requests not finished."""

    def __init__(self, streams: list[RequestStream]) -> None:
        assert all(s.sink is streams[0].sink for s in streams), "the streams of a group share one sink"
        self.streams = streams
        self.sink = streams[0].sink if streams else OutputSink()

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        sink = self.sink
        while not all(s.finished for s in self.streams) or sink.items:
            batch = await sink.get_all()
            for _, item in batch:
                if isinstance(item, BaseException):
                    await self.aclose()
                    raise item
            yield batch

    async def aclose(self) -> None:
        for stream in self.streams:
            await stream.aclose()

    def set_paused(self, paused: bool) -> None:
        """Pauses (or resumes) the requests not finished (AsyncEngine.set_paused)."""
        for stream in self.streams:
            if not stream.finished:
                stream.engine.set_paused(stream.request_id, paused)
