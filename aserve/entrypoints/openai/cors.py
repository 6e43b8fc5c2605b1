"""Cross-origin requests (CORS) for browser clients, as vLLM's server allows them (Starlette's CORSMiddleware with
`--allowed-origins`, `--allowed-methods`, `--allowed-headers`, `--allow-credentials`; by default any origin, method
and header, without credentials).

A preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered here, before authentication (a
browser sends no API key with it): 200 with what is allowed, or 400 for an origin, method or header that is not. Every
other response to a request with an Origin gets Access-Control-Allow-Origin as its headers go out (app.on_response_
prepare: streamed responses too)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
PREFLIGHT_MAX_AGE = 600  # seconds a browser may cache a preflight's answer


@dataclass(frozen=True)
class CorsOptions:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def allow_origin_header(self, origin: str) -> str:
        """Any origin without credentials: "*"; otherwise the request's own (a browser refuses "*" with credentials)."""
        return "*" if "*" in self.allowed_origins and not self.allow_credentials else origin


ALLOW_ALL = CorsOptions()  # vLLM's defaults


def install(app: web.Application, options: CorsOptions) -> None:
    """Answers preflights (a middleware that runs before every other) and adds the CORS headers to responses."""
    methods = ALL_METHODS if "*" in options.allowed_methods else tuple(m.upper() for m in options.allowed_methods)
    allowed_headers = {h.lower() for h in options.allowed_headers}

    @web.middleware
    async def preflight(request: web.Request, handler):
        origin = request.headers.get("Origin")
        wanted = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or wanted is None:
            return await handler(request)
        problems = []
        if not options.origin_allowed(origin):
            problems.append("origin")
        if wanted.upper() not in methods:
            problems.append("method")
        asked = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        if "*" not in allowed_headers and any(h.lower() not in allowed_headers for h in asked):
            problems.append("headers")
        headers = {"Access-Control-Allow-Methods": ", ".join(methods), "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE),
                   "Vary": "Origin"}  # fmt: skip
        if asked:
            headers["Access-Control-Allow-Headers"] = ", ".join(asked)
        if problems:
            return web.Response(status=400, text=f"Disallowed CORS {', '.join(problems)}", headers=headers)
        headers["Access-Control-Allow-Origin"] = options.allow_origin_header(origin)
        if options.allow_credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return web.Response(status=200, text="OK", headers=headers)

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or not options.origin_allowed(origin) or "Access-Control-Allow-Origin" in response.headers:
            return
        response.headers["Access-Control-Allow-Origin"] = options.allow_origin_header(origin)
        if options.allow_credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
        if options.allow_origin_header(origin) != "*":
            response.headers["Vary"] = "Origin"

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(on_prepare)
