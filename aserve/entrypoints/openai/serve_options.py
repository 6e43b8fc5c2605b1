"""vLLM's server flags for the listener and the app around build_app's: TLS (tls.py), --root-path,
--chat-template-content-format, --enable-server-load-tracking (GET /load), --middleware, the HTTP parser's limits
(--h11-max-header-count, --h11-max-incomplete-event-size), --log-error-stack, --enable-log-outputs with
--max-log-len, --exclude-tools-when-tool-choice-none, the profiler routes of --profiler-config (POST /start_profile,
/stop_profile), vLLM's development routes with $VLLM_SERVER_DEV_MODE (dev_routes.py), and the vLLM flags aserve
answers without an effect or refuses: --show-hidden-metrics-for-version (accepted: no metric is hidden),
--otlp-traces-endpoint (refused: no OpenTelemetry tracing), --api-server-count other than 1 and --headless (refused:
one process serves the API and drives the engine).

--middleware takes aiohttp middlewares (async functions (request, handler) -> response, by import path
"package.module.name" or "package.module:name"), which run in the order given, inside the API key check and the
error handling (an exception they raise is answered as the server's other errors are); vLLM's ASGI middleware
classes do not apply to an aiohttp server and are refused.

--root-path P is where a path-routing proxy mounts the server. vLLM hands it to uvicorn as the ASGI root path, which
serves the routes at their own paths, for a proxy that strips P; aserve serves them both there and under P
(P/v1/models as /v1/models), for a proxy that forwards the path as it came too. The path is rewritten before the
request is routed, so the API key guards P/v1 as it guards /v1."""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import ssl
from dataclasses import dataclass, field

from aiohttp import web

from aserve.entrypoints.openai import dev_routes
from aserve.entrypoints.openai.protocol import APIError
from aserve.entrypoints.openai.server_state import STATE_KEY, json_response
from aserve.entrypoints.openai.tls import add_tls_args, ssl_context

CONTENT_FORMATS = ("auto", "string", "openai")

logger = logging.getLogger("aserve")


def add_serve_option_args(serve: argparse.ArgumentParser) -> None:
    add_tls_args(serve)
    serve.add_argument("--root-path", default=None,
                       help="the path a proxy serves aserve under: requests are answered both with and without it "
                            "(e.g. /api/v1/models and /v1/models)")  # fmt: skip
    serve.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                       help="how a message's content reaches the chat template: string (text parts joined with "
                            "newlines), openai (content parts as a list), auto (openai where the template loops over "
                            "a message's content, else string, as vLLM detects it)")  # fmt: skip
    serve.add_argument("--enable-server-load-tracking", action="store_true",
                       help='serve GET /load: {"server_load": requests the server is handling} (default: off, '
                            "404)")  # fmt: skip
    serve.add_argument("--show-hidden-metrics-for-version", default=None,
                       help="accepted: aserve hides no metrics, every series is always on /metrics")  # fmt: skip
    serve.add_argument("--otlp-traces-endpoint", default=None,
                       help="refused: aserve exports no OpenTelemetry traces (see /metrics and "
                            "--enable-log-requests)")  # fmt: skip
    serve.add_argument("--middleware", action="append", default=[],
                       help="an aiohttp middleware to run on every request, by import path (package.module.name); "
                            "repeat the flag for more, run in the order given")  # fmt: skip
    serve.add_argument("--h11-max-header-count", type=int, default=128,
                       help="the most headers a request may have (more: 400)")  # fmt: skip
    serve.add_argument("--h11-max-incomplete-event-size", type=int, default=8190,
                       help="the most bytes of a request line and of each header (more: 400; aiohttp bounds each "
                            "line, h11 their sum)")  # fmt: skip
    serve.add_argument("--log-error-stack", action="store_true",
                       help="log the traceback of every exception that a request's error response stands "
                            "for")  # fmt: skip
    serve.add_argument("--enable-log-outputs", action="store_true",
                       help="log each finished choice: its id, output tokens, finish reason and text (at most "
                            "--max-log-len characters)")  # fmt: skip
    serve.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help="a chat request with tool_choice 'none' renders its prompt without its "
                            "tools")  # fmt: skip
    serve.add_argument("--api-server-count", type=int, default=1,
                       help="accepted as 1: one process serves the API and drives the engine")  # fmt: skip
    serve.add_argument("--headless", action="store_true",
                       help="refused: aserve runs no engine without its API server")  # fmt: skip


@dataclass
class ServeOptions:
    ssl_context: ssl.SSLContext | None = None
    root_path: str = ""  # "" or "/a/b": no trailing slash
    content_format: str = "auto"
    server_load_tracking: bool = False
    middlewares: list = field(default_factory=list)  # --middleware, imported
    parser_limits: dict = field(default_factory=dict)  # aiohttp's max_headers, max_line_size, max_field_size
    log_error_stack: bool = False
    log_outputs: bool = False
    max_log_len: int | None = None
    exclude_tools_when_none: bool = False

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> ServeOptions:
        """ValueError for a flag aserve refuses; certificates are read and middlewares imported here, before the
        model loads."""
        if ns.otlp_traces_endpoint is not None:
            raise ValueError(f"--otlp-traces-endpoint {ns.otlp_traces_endpoint}: aserve exports no OpenTelemetry "
                             "traces (its Prometheus metrics are on /metrics; --enable-log-requests logs each "
                             "request)")  # fmt: skip
        if ns.api_server_count != 1:
            raise ValueError(f"--api-server-count {ns.api_server_count}: aserve runs one API server process, whose "
                             "event loop drives the engine (--api-server-count 1)")  # fmt: skip
        if ns.headless:
            raise ValueError("--headless: aserve runs no engine without its API server (no multi-node data "
                             "parallelism)")  # fmt: skip
        for flag, value in (("--h11-max-header-count", ns.h11_max_header_count),
                            ("--h11-max-incomplete-event-size", ns.h11_max_incomplete_event_size)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if ns.max_log_len is not None and ns.max_log_len < 0:
            raise ValueError(f"--max-log-len must be at least 0, got {ns.max_log_len}")
        root = (ns.root_path or "").rstrip("/")
        if root and not root.startswith("/"):
            raise ValueError(f"--root-path must start with '/', got {ns.root_path!r}")
        size = ns.h11_max_incomplete_event_size
        limits = {"max_headers": ns.h11_max_header_count, "max_line_size": size, "max_field_size": size}
        return cls(ssl_context(ns), root, ns.chat_template_content_format, ns.enable_server_load_tracking,
                   [import_middleware(path) for path in ns.middleware], limits, ns.log_error_stack,
                   ns.enable_log_outputs, ns.max_log_len, ns.exclude_tools_when_tool_choice_none)  # fmt: skip

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    def setup_app(self, app: web.Application) -> None:
        """Before the app is frozen: the content format its chats render with, GET /load, the middlewares, what
        is logged."""
        state = app[STATE_KEY]
        state.content_format = self.content_format
        state.log_outputs, state.max_log_len = self.log_outputs, self.max_log_len
        state.exclude_tools_when_none = self.exclude_tools_when_none
        if self.server_load_tracking:
            app.router.add_get("/load", server_load)
        if state.engine.config.profiler is not None:  # --profiler-config: vLLM's profiler routes
            app.router.add_post("/start_profile", start_profile)
            app.router.add_post("/stop_profile", stop_profile)
        dev_routes.install(app)  # with $VLLM_SERVER_DEV_MODE only
        if self.log_error_stack:
            app.middlewares.append(log_error_stack)
        if self.middlewares:
            app.middlewares.extend(self.middlewares)

    def setup_server(self, server: web.Server) -> None:
        """Requests under the root path are made, before routing, into the same requests without it."""
        if not self.root_path:
            return
        make_request, root = server.request_factory, self.root_path

        def request_factory(message, payload, protocol, writer, task):
            raw_path = message.url.raw_path  # message.path: the request target as sent, query included
            if message.path.startswith(raw_path) and (raw_path == root or raw_path.startswith(root + "/")):
                path = raw_path[len(root) :] or "/"
                message = message._replace(path=path + message.path[len(raw_path) :],
                                           url=message.url.with_path(path, encoded=True, keep_query=True))  # fmt: skip
            return make_request(message, payload, protocol, writer, task)

        server.request_factory = request_factory


async def server_load(request: web.Request) -> web.Response:
    """vLLM's GET /load: the requests the server is handling (this one aside), for least-loaded routing."""
    return json_response({"server_load": request.app[STATE_KEY].inflight - 1})


async def start_profile(request: web.Request) -> web.Response:
    """vLLM's POST /start_profile: the profiler of --profiler-config runs over the engine's steps until
    /stop_profile (aserve/worker/profiler_hooks.py); 400 while it runs already."""
    try:
        await request.app[STATE_KEY].engine.start_profile()
    except RuntimeError as e:
        raise APIError(400, str(e)) from None
    return web.Response()


async def stop_profile(request: web.Request) -> web.Response:
    """vLLM's POST /stop_profile: ends the run; its trace is written when the response comes. 400 when none runs."""
    try:
        await request.app[STATE_KEY].engine.stop_profile()
    except RuntimeError as e:
        raise APIError(400, str(e)) from None
    return web.Response()


def import_middleware(path: str):
    """--middleware's "package.module.name" or "package.module:name" -> the middleware; ValueError naming the path
    when it cannot be imported or is not an async function of (request, handler)."""
    module_name, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not name:
        raise ValueError(f"--middleware {path}: expected an import path, package.module.name")
    try:
        obj = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--middleware {path}: cannot import it ({e})") from e
    if inspect.isclass(obj) or not inspect.iscoroutinefunction(obj):
        raise ValueError(f"--middleware {path}: aserve's server is aiohttp; a middleware is an async function "
                         "(request, handler) -> response (ASGI middleware classes do not apply)")  # fmt: skip
    if len(inspect.signature(obj).parameters) != 2:
        raise ValueError(f"--middleware {path}: a middleware takes (request, handler)")
    return web.middleware(obj)


@web.middleware
async def log_error_stack(request: web.Request, handler):
    """--log-error-stack: the traceback of an exception on its way to becoming an error response."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status >= 500:
            logger.error("%s %s: %d", request.method, request.path, e.status, exc_info=True)
        raise
    except Exception as e:
        logger.error("%s %s: %s", request.method, request.path, type(e).__name__, exc_info=True)
        raise
