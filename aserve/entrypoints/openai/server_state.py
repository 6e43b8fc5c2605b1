"""The server's state shared by its handlers (ServerState: the engine, the served names, the API keys, the options
of `aserve serve` that shape replies) and the JSON responses they answer with."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from aserve import envs
from aserve.core.metrics import PrometheusMetrics
from aserve.engine.async_engine import AsyncEngine
from aserve.entrypoints.chat_utils import parse_conversation, takes_content_parts
from aserve.entrypoints.openai.connections import BodyReader, ConnectionGuard
from aserve.entrypoints.openai.event_stream import FlowControl
from aserve.entrypoints.openai.protocol import APIError, _GenerationRequest
from aserve.entrypoints.openai.responses import error_body
from aserve.entrypoints.openai.structured_request import structured_outputs_field
from aserve.entrypoints.openai.tool_parsers import ToolParser
from aserve.entrypoints.openai.tool_request import forces_tool_call
from aserve.sampling_params import ParamError

ENGINE_KEY = web.AppKey("engine", AsyncEngine)
STATE_KEY = web.AppKey("server_state", object)

_encode = msgspec.json.encode
logger = logging.getLogger("aserve")

SHUTTING_DOWN = "the server is shutting down; retry on another replica or later"


def error_response(status: int, message: str, type_="invalid_request_error", param=None, code=None) -> web.Response:
    body = error_body(message, type_, param, code)
    return web.Response(status=status, body=_encode(body), content_type="application/json")


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encode(obj), content_type="application/json")


def cache_config_of(engine: AsyncEngine) -> dict:
    """The KV cache's settings, as vLLM's cache_config_info metric labels them."""
    return engine.config.cache_metrics_info(engine.engine.core.num_kv_blocks)


class ServerState:
    def __init__(self, engine: AsyncEngine, served_model_name: str | list[str], api_key: str | list[str] | None):
        self.engine = engine
        # --served-model-name A B: requests may name any; responses and metrics carry the first
        self.model_names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        self.model_name = self.model_names[0]
        # --api-key K [K ...]: the Authorization headers that open /v1 (None: no key needed)
        keys = [api_key] if isinstance(api_key, str) else api_key
        self.authorizations = [f"Bearer {k}".encode() for k in keys] if keys else None
        self.default_template_kwargs: dict | None = None  # --default-chat-template-kwargs
        self.force_include_usage = False  # --enable-force-include-usage: every stream ends with its usage
        self.tokens_as_token_ids = False  # --return-tokens-as-token-ids: the request field's default
        self.stream_interval = 1  # --stream-interval: streamed chunks of at least this many tokens
        self.created = int(time.time())
        self.metrics = PrometheusMetrics(self.model_name, cache_config=cache_config_of(engine),
                                         max_model_len=engine.config.max_model_len)  # fmt: skip
        engine.stats.add_listener(self.metrics)
        self.draining = False  # graceful shutdown began: new requests get 503, in-flight ones finish
        self.inflight = 0  # requests being handled, /health and /metrics aside
        self.idle = asyncio.Event()
        self.idle.set()
        self.bodies = BodyReader(engine.check_prompt_chars)
        self.connections: ConnectionGuard | None = None  # `aserve serve`'s read timeouts and connection limit
        self.tool_parser: ToolParser | None = None  # --tool-call-parser
        self.enable_auto_tool_choice = False  # --enable-auto-tool-choice: tool_choice "auto" is parsed
        self.enable_prompt_tokens_details = False  # --enable-prompt-tokens-details: usage reports cached tokens
        self.response_role = "assistant"  # --response-role: the role of chat replies
        self.reasoning_parser: str | None = None  # --reasoning-parser: the reasoning apart (reasoning.py)
        self.think_end_token: int | None = None  # its `</think>` token: a grammar waits for it
        self.log_requests = False  # --enable-log-requests: a log line per request with its parameters
        self.log_outputs = False  # --enable-log-outputs: a log line per finished choice, its text cut to max_log_len
        self.max_log_len: int | None = None
        self.exclude_tools_when_none = False  # --exclude-tools-when-tool-choice-none
        self.trust_request_chat_template = False  # --trust-request-chat-template: requests may bring a template
        # the chat template reads content parts as a list (chat_utils.takes_content_parts), or takes a string
        self.content_parts = takes_content_parts(getattr(engine.config.tokenizer, "chat_template", None))
        # --chat-template-content-format: auto (content_parts, or the request template's own), string or openai
        self.content_format = "auto"
        # what a streaming client that stopped reading may hold (event_stream.py's flow control)
        self.flow_control = FlowControl(envs.ASERVE_STREAM_BUFFER, envs.ASERVE_STREAM_STALL_TIMEOUT,
                                        self.metrics.on_stream_paused, self.on_slow_client)  # fmt: skip

    def attach_connections(self, guard: ConnectionGuard) -> None:
        """`aserve serve`'s connections go through `guard`: handlers mark their phases on it."""
        self.connections = self.bodies.connections = guard
        self.bodies.timeout_body = guard.limits.timeout_body
        guard.on_closed = self.metrics.on_connection_closed

    def on_slow_client(self) -> None:
        """A streaming client stopped reading and was cut off (aserve:http_connections_closed_total{reason})."""
        if self.connections is not None:
            self.connections.count_closed("slow_client")
        else:
            self.metrics.on_connection_closed("slow_client")

    def log_choices(self, request_id: str, choices) -> None:
        """--enable-log-outputs: each finished choice's tokens, finish reason and text."""
        for c in choices:
            text = c.text if self.max_log_len is None else c.text[: self.max_log_len]
            logger.info("output of %s (choice %d): %d tokens, finish_reason %s, text %r", request_id, c.index,
                        c.num_tokens, c.finish_reason, text)  # fmt: skip

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def add_template_defaults(self, req) -> None:
        """--default-chat-template-kwargs under a chat (or /tokenize) request's own chat_template_kwargs."""
        if self.default_template_kwargs:
            req.chat_template_kwargs = {**self.default_template_kwargs, **(req.chat_template_kwargs or {})}

    def chat_content_parts(self, req) -> bool:
        """Whether the request's chat template takes content parts as a list (--chat-template-content-format, else
        detected); a template of the request's own only with --trust-request-chat-template (vLLM's rule)."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise ParamError("chat_template", "Chat template is passed with request, but --trust-request-chat-template "
                             "is not set. Refused request with untrusted chat template.")  # fmt: skip
        if self.content_format != "auto":
            return self.content_format == "openai"
        return self.content_parts if req.chat_template is None else takes_content_parts(req.chat_template)

    def conversation(self, req) -> list[dict]:
        """A chat request's messages in the shape its template takes (chat_utils.parse_conversation): parts kept as
        chat_content_parts says; --chat-template-content-format openai: every content a list of parts, a string
        one text part (vLLM's)."""
        return parse_conversation(req.messages, self.chat_content_parts(req), all_parts=self.content_format == "openai")

    def sampling_params(self, req: _GenerationRequest):
        """The request's parameters; max_tokens None: up to the context length (the engine resolves it per prompt,
        and checks that prompt + max_tokens fits)."""
        return req.to_sampling_params(req.requested_max_tokens(), self.engine.config.default_sampling)

    async def compile_grammar(self, req: _GenerationRequest, params) -> None:
        """A structured-output grammar compiles (off the loop) before the request is queued; one that does not is a
        400 naming the request field it came in."""
        if params.structured_outputs is None:
            return
        try:
            await self.engine.compile_grammar(params)
        except ParamError as e:
            e.param = "tools" if forces_tool_call(req) else structured_outputs_field(req)
            raise


# -- handlers ---------------------------------------------------------------------------------------------------
