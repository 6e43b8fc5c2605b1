"""vLLM's development routes, served only with `VLLM_SERVER_DEV_MODE=1` in the server's environment (they let any
client change the server's state, so they are off otherwise, and the server logs a warning when they are on):

    POST /reset_prefix_cache   every cached prompt prefix forgotten (blocks that running requests hold stay theirs):
                               benchmarks measure cold prefills again without a restart
    POST /reset_mm_cache       nothing to reset: aserve serves text and keeps no multimodal cache
    GET  /server_info          the engine's arguments as the server resolved them, {"aserve_config": {...}}
                               (--hf-token's value withheld)
    GET  /is_sleeping          {"is_sleeping": false}: aserve has no sleep mode
    POST /sleep, /wake_up      refused (400): no sleep mode, weights and KV cache stay in memory

vLLM's /collective_rpc runs arbitrary methods on the workers and has no counterpart (404)."""

from __future__ import annotations

import dataclasses
import logging

from aiohttp import web

from aserve import envs
from aserve.entrypoints.openai.protocol import APIError
from aserve.entrypoints.openai.server_state import STATE_KEY, json_response

logger = logging.getLogger("aserve")


def install(app: web.Application) -> None:
    """The routes, when $VLLM_SERVER_DEV_MODE is set (before the app is frozen)."""
    if not envs.VLLM_SERVER_DEV_MODE:
        return
    logger.warning("VLLM_SERVER_DEV_MODE: the development routes are on (/reset_prefix_cache, /server_info, ...): "
                   "any client can reset the server's caches; do not expose it")  # fmt: skip
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/reset_mm_cache", reset_mm_cache)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_post("/sleep", no_sleep_mode)
    app.router.add_post("/wake_up", no_sleep_mode)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    await request.app[STATE_KEY].engine.reset_prefix_cache()
    return web.Response()


async def reset_mm_cache(request: web.Request) -> web.Response:
    return web.Response()


async def server_info(request: web.Request) -> web.Response:
    args = dataclasses.asdict(request.app[STATE_KEY].engine.config.args)
    if args.get("hf_token"):
        args["hf_token"] = "<withheld>"
    return json_response({"aserve_config": {k: _plain(v) for k, v in args.items()}})


async def is_sleeping(request: web.Request) -> web.Response:
    return json_response({"is_sleeping": False})


async def no_sleep_mode(request: web.Request) -> web.Response:
    raise APIError(400, f"{request.path}: aserve has no sleep mode (weights and KV cache stay in memory)")


def _plain(value):
    """A JSON value for an argument (a torch dtype or other object: its text)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)
