"""vLLM's server flags for the listener and the app around build_app's: TLS (tls.py), --root-path,
--chat-template-content-format, --enable-server-load-tracking (GET /load), and the two vLLM flags aserve answers
without an effect or refuses: --show-hidden-metrics-for-version (accepted: no metric is hidden),
--otlp-traces-endpoint (refused: no OpenTelemetry tracing).

--root-path P is where a path-routing proxy mounts the server. vLLM hands it to uvicorn as the ASGI root path, which
serves the routes at their own paths, for a proxy that strips P; aserve serves them both there and under P
(P/v1/models as /v1/models), for a proxy that forwards the path as it came too. The path is rewritten before the
request is routed, so the API key guards P/v1 as it guards /v1."""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass

from aiohttp import web

from aserve.entrypoints.openai.server_state import STATE_KEY, json_response
from aserve.entrypoints.openai.tls import add_tls_args, ssl_context

CONTENT_FORMATS = ("auto", "string", "openai")


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


@dataclass
class ServeOptions:
    ssl_context: ssl.SSLContext | None = None
    root_path: str = ""  # "" or "/a/b": no trailing slash
    content_format: str = "auto"
    server_load_tracking: bool = False

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> ServeOptions:
        """ValueError for a flag aserve refuses; certificates are read here, before the model loads."""
        if ns.otlp_traces_endpoint is not None:
            raise ValueError(f"--otlp-traces-endpoint {ns.otlp_traces_endpoint}: aserve exports no OpenTelemetry "
                             "traces (its Prometheus metrics are on /metrics; --enable-log-requests logs each "
                             "request)")  # fmt: skip
        root = (ns.root_path or "").rstrip("/")
        if root and not root.startswith("/"):
            raise ValueError(f"--root-path must start with '/', got {ns.root_path!r}")
        return cls(ssl_context(ns), root, ns.chat_template_content_format, ns.enable_server_load_tracking)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    def setup_app(self, app: web.Application) -> None:
        """Before the app is frozen: the content format its chats render with, and GET /load."""
        app[STATE_KEY].content_format = self.content_format
        if self.server_load_tracking:
            app.router.add_get("/load", server_load)

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
