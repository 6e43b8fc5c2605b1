"""Reading and decoding request bodies without letting a large one hold the event loop.

Small bodies (up to LARGE_BODY_BYTES) are read and decoded at once. Large ones cost the loop in three places, each
bounded here:
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
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable

import msgspec
from aiohttp import web

from aserve.entrypoints.openai.protocol import APIError, min_prompt_chars

MAX_BODY_BYTES = 32 * 1024 * 1024  # larger request bodies get 413 before any of them is parsed
LARGE_BODY_BYTES = 1024 * 1024
LARGE_BODY_SLOTS = 2  # large bodies received at once
_PAUSE_S = 0.002  # between two large bodies' decoding turns


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

    async def read(self, request: web.Request) -> bytes | mmap.mmap:
        """The body, up to MAX_BODY_BYTES (else 413): bytes, or for one over LARGE_BODY_BYTES an anonymous memory
        map that the caller closes."""
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
        param = msg.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in msg else None
        raise APIError(400, f"invalid request: {msg}", param=param) from e
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:  # msgspec's guard against deep nesting (Python's recursion limit, ~1,000 levels)
        raise APIError(400, "the request body is nested too deeply", code="json_too_deep") from e
