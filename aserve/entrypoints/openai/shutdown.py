"""Graceful shutdown of `aserve serve` (SIGTERM / SIGINT): new requests get 503 and /health turns 503 while the
requests in flight get up to --shutdown-timeout seconds to finish; what still runs then is ended."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from aserve.entrypoints.openai.server_state import SHUTTING_DOWN, STATE_KEY, ServerState

logger = logging.getLogger("aserve")

_SHUTDOWN_FLUSH_S = 5.0  # after a forced shutdown ends the last requests, how long their handlers get to say so


def begin_drain(app: web.Application) -> None:
    """From now on new requests get 503 and /health turns 503 (called from the signal handler itself)."""
    app[STATE_KEY].draining = True


async def drain(app: web.Application, timeout: float, force: asyncio.Event | None = None) -> None:
    """Graceful shutdown, before the runner's cleanup: new requests get 503 (and /health turns 503, so balancers
    move on) while in-flight ones get up to `timeout` seconds to finish (`force` set: stop waiting). What is still
    running then is ended: streams get a final error event and [DONE], other requests a 503 error body."""
    begin_drain(app)
    state: ServerState = app[STATE_KEY]
    if state.inflight:
        logger.info("draining %d in-flight requests (up to %g s; signal again to stop now)", state.inflight, timeout)
        await _wait_idle(state, timeout, force)
    ended = state.engine.abort_all(SHUTTING_DOWN)
    if state.inflight:
        logger.warning("shutdown timeout: ending %d requests (%d sequences) still running", state.inflight, ended)
        await _wait_idle(state, _SHUTDOWN_FLUSH_S, None)


async def _wait_idle(state: ServerState, timeout: float, force: asyncio.Event | None) -> None:
    waits = [asyncio.ensure_future(state.idle.wait())]
    if force is not None:
        waits.append(asyncio.ensure_future(force.wait()))
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
