"""The OpenAI-compatible HTTP server (aiohttp): completions, chat completions (SSE streaming), models, tokenize,
health, metrics. Handlers only parse, tokenize and format; the AsyncEngine's step coroutine does the work on the
same event loop (model execution itself runs in the engine's worker thread)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid

import msgspec
from aiohttp import web

from aserve.engine.async_engine import AsyncEngine
from aserve.engine.errors import EngineDeadError, EngineOverloadedError
from aserve.engine.streams import OutputSink, StreamGroup
from aserve.entrypoints.openai import cors
from aserve.entrypoints.openai.beam_request import beam_response
from aserve.entrypoints.openai.connections import MAX_BODY_BYTES
from aserve.entrypoints.openai.cors import CorsOptions
from aserve.entrypoints.openai.event_stream import EventStream, stream_response
from aserve.entrypoints.openai.model_card import model_card
from aserve.entrypoints.openai.openapi import openapi_spec
from aserve.entrypoints.openai.prompt_scoring import add_prompt_logprobs, make_echoes
from aserve.entrypoints.openai.protocol import (
    MAX_SEQUENCES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from aserve.entrypoints.openai.reasoning import reasoning_output, think_end_token
from aserve.entrypoints.openai.responses import (
    ChoiceState,
    absorb,
    add_token_ids,
    cached_tokens,
    chat_chunk,
    completion_chunk,
    error_type,
    usage,
)
from aserve.entrypoints.openai.responses_api import ResponsesEndpoint
from aserve.entrypoints.openai.server_state import (
    ENGINE_KEY,
    SHUTTING_DOWN,
    STATE_KEY,
    ServerState,
    error_response,
    json_response,
)
from aserve.entrypoints.openai.tool_output import tool_call_output
from aserve.entrypoints.openai.tool_parsers import get_tool_parser
from aserve.sampling_params import ParamError
from aserve.version import __version__

logger = logging.getLogger("aserve")


async def health(request: web.Request) -> web.Response:
    """Never waits on the engine: load balancers poll it while the server is busiest."""
    engine = request.app[ENGINE_KEY]
    if request.app[STATE_KEY].draining:
        return error_response(503, SHUTTING_DOWN, type_="service_unavailable", code="shutting_down")
    if not engine.is_running and engine.has_started:
        return error_response(503, "the engine has stopped", type_="service_unavailable")
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    state.metrics.num_requests_open.set(state.engine.num_live_requests)
    if state.connections is not None:
        state.metrics.http_connections.set(len(state.connections.connections))
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


async def list_models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    return json_response({"object": "list", "data": [model_card(state, name) for name in state.model_names]})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the served model's card; 404 model_not_found for any other name."""
    state: ServerState = request.app[STATE_KEY]
    state.check_model(request.match_info["model"])
    return json_response(model_card(state, request.match_info["model"]))


async def tokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    req = await state.bodies.parse(request, TokenizeRequest, has_prompt=True)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if req.prompt is not None:
        add_special = req.add_special_tokens is not False
        ids = await state.engine.tokenize(req.prompt, add_special_tokens=add_special)
    else:
        state.add_template_defaults(req)
        chat = req.chat_request()
        conversation = state.conversation(chat)
        ids = await state.engine.render_chat(conversation, chat.add_generation_prompt, chat.template_kwargs(),
                                             bool(req.add_special_tokens))  # fmt: skip
    body = {"tokens": ids, "count": len(ids), "max_model_len": state.engine.config.max_model_len}
    if req.return_token_strs:
        body["token_strs"] = state.engine.config.tokenizer.convert_ids_to_tokens(ids)
    return json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    req = await state.bodies.parse(request, DetokenizeRequest)
    state.check_model(req.model)
    return json_response({"prompt": await state.engine.detokenize(req.tokens)})


def tokenizer_info(engine: AsyncEngine) -> dict:
    """GET /tokenizer_info's body (--enable-tokenizer-info-endpoint, as vLLM): what a client needs to tokenise as the
    server does through /tokenize and /detokenize (lm-evaluation-harness' tokenizer_backend=remote)."""
    tokenizer = engine.config.tokenizer
    info = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": engine.config.max_model_len,
            "chat_template": getattr(tokenizer, "chat_template", None)}  # fmt: skip
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = None if token is None else str(token)
    return info


async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    req = await state.bodies.parse(request, CompletionRequest, has_prompt=True)
    state.check_model(req.model)
    req.check_limits(state.engine.config.args.max_logprobs)
    raw_prompts = req.prompts()
    if len(raw_prompts) * req.n > MAX_SEQUENCES:
        raise APIError(400, f"prompts x n must be <= {MAX_SEQUENCES}, got {len(raw_prompts) * req.n}", param="n")
    state.engine.check_queue(len(raw_prompts) * req.n)  # overloaded: refuse before spending time on tokenising
    params = state.sampling_params(req)
    await state.compile_grammar(req, params)
    prompts = []
    max_model_len = state.engine.config.max_model_len
    texts = [p for p in raw_prompts if isinstance(p, str)]
    encoded = iter(await state.engine.tokenize_many(texts, req.add_special_tokens is not False) if texts else ())
    for p in raw_prompts:
        ids = next(encoded) if isinstance(p, str) else p
        kept = req.truncate(ids, params, max_model_len)
        text = p if isinstance(p, str) and len(kept) == len(ids) else None  # a truncated prompt's text: its tokens'
        prompts.append((text, kept, params))
    return await _generate(request, state, req, f"cmpl-{response_id(request, req)}", prompts, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    req = await state.bodies.parse(request, ChatCompletionRequest, has_prompt=True)
    state.add_template_defaults(req)
    try:
        return await _chat_completions(request, state, req)
    except ParamError as e:  # named as this request names the field (top_logprobs, max_completion_tokens)
        e.param = req.param_names().get(e.param, e.param)
        raise


class _InvocationKind(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw()  # left undecoded; empty when absent
    prompt: msgspec.Raw = msgspec.Raw()


async def invocations(request: web.Request) -> web.StreamResponse:
    """POST /invocations, vLLM's SageMaker route: a chat completion when the body has messages, else a completion
    when it has a prompt."""
    kind = await request.app[STATE_KEY].bodies.sniff(request, _InvocationKind)
    if bytes(kind.messages) not in (b"", b"null"):
        return await chat_completions(request)
    if bytes(kind.prompt) not in (b"", b"null"):
        return await completions(request)
    raise APIError(400, "Cannot find suitable handler for request. Expected one of: "
                   "['ChatCompletionRequest', 'CompletionRequest']")  # fmt: skip


async def _chat_completions(request: web.Request, state: ServerState, req: ChatCompletionRequest, reply=None):
    state.check_model(req.model)
    req.check_limits(state.engine.config.args.max_logprobs)
    state.engine.check_queue(req.n)
    tools = tool_call_output(req, state.tool_parser, state.enable_auto_tool_choice) if req.tools else None
    params = state.sampling_params(req)
    if tools is not None:
        tools.adjust(params)
    grammar_after = None  # the token a grammar waits for (a reasoning model's end of thinking)
    if state.reasoning_parser is not None:  # the tool parser, if any, reads the content only
        tools, grammar_after = reasoning_output(state.reasoning_parser, params, req, tools, state.think_end_token,
                                                state.engine.config.tokenizer)  # fmt: skip
    await state.compile_grammar(req, params)
    conversation = state.conversation(req)
    ids = await state.engine.render_chat(conversation, req.add_generation_prompt,
                                         req.template_kwargs(state.exclude_tools_when_none),
                                         bool(req.add_special_tokens))  # fmt: skip
    ids = req.truncate(ids, params, state.engine.config.max_model_len)
    request_id = f"{'chatcmpl-' if reply is None else reply.id_prefix}{response_id(request, req)}"
    return await _generate(request, state, req, request_id, [(None, ids, params)], chat=True, tools=tools,
                           echo=req.echo_text(conversation), grammar_after=grammar_after, reply=reply)  # fmt: skip


_REQUEST_ID = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"  # aiohttp >= 3.12


_ID_CHARS = re.compile(r"[!-~]{1,256}")  # printable ASCII without spaces: safe in a header, a log line, an SSE event


def response_id(request: web.Request, req) -> str:
    """A response's id after its prefix: the X-Request-Id header, else the request_id field, else a new one (vLLM's
    order); kept for --enable-request-id-headers. A client's id must be 1-256 printable ASCII characters."""
    header = request.headers.get("X-Request-Id")
    for given, name in ((header, "X-Request-Id"), (req.request_id, "request_id")):
        if given is not None and not _ID_CHARS.fullmatch(given):
            raise ParamError(name, f"{name} must be 1 to 256 printable ASCII characters without spaces")
    request[_REQUEST_ID] = header or req.request_id or uuid.uuid4().hex
    return request[_REQUEST_ID]


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """--enable-request-id-headers: X-Request-Id on every response (the client's, else the body's id)."""
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or request.get(_REQUEST_ID) or (
        uuid.uuid4().hex)  # fmt: skip


async def _generate(request, state: ServerState, req, request_id: str, prompts, chat: bool, tools=None, echo="",
                    grammar_after: int | None = None, reply=None):  # fmt: skip
    """Runs every (text, ids, params) prompt; choice index = prompt index * n + sample index. `echo`: a chat's
    echoed text (the reply's start); grammar_after: see LLMEngine.add_request; reply: a chat reply that goes back
    in another API's shape (responses_output.ResponseReply: its event_stream in place of EventStream, its body
    made from the chat body)."""
    n = req.n
    created = int(time.time())
    # the engine's ids: unique even where the client chose the response's id
    engine_id = request_id if req.request_id is None and "X-Request-Id" not in request.headers else (
        f"{request_id}-{uuid.uuid4().hex[:8]}")  # fmt: skip
    if req.use_beam_search:
        body, choices = await beam_response(state, req, request_id, engine_id, prompts, chat, created)
        for body_choice, choice in zip(body["choices"], choices if tools is not None else ()):
            tools.message(body_choice, choice)  # (a reasoning parser's split: tools are refused)
        return json_response(body)
    if state.log_requests:  # --enable-log-requests
        for i, (_, ids, params) in enumerate(prompts):
            logger.info("request %s (prompt %d): %d prompt tokens, %s", request_id, i, len(ids), params)
    num_top = req.num_logprobs()
    if num_top == -1:  # the whole vocabulary (--max-logprobs -1 allowed it)
        num_top = state.engine.config.vocab_size
    choices = [ChoiceState(i * n + j, num_top) for i in range(len(prompts)) for j in range(n)]
    for choice in choices:
        choice.prompt_token_ids = prompts[choice.index // n][1]
        choice.ids_as_tokens = state.tokens_as_token_ids if req.return_tokens_as_token_ids is None else (
            req.return_tokens_as_token_ids)  # fmt: skip
    if not chat and req.echo:
        await make_echoes(state.engine, choices, n, prompts, req.score_only)
    prompt_tokens = sum(len(ids) for _, ids, _ in prompts)
    # one sink for all the prompts: the handler (or, streaming, the sink itself) takes each step's outputs at once
    sink = OutputSink()
    if req.stream:
        stream_type = EventStream if reply is None else reply.event_stream
        sink = stream_type(request, state.model_name, req, request_id, created, choices, prompt_tokens, chat,
                           state.flow_control, tools, echo,
                           state.enable_prompt_tokens_details, state.response_role)  # fmt: skip
        sink.include_usage = sink.include_usage or state.force_include_usage
        sink.interval = max(state.stream_interval, req.stream_interval or 1)
    streams = []
    # Checked again now that tokenising is done; nothing below awaits before the requests are queued.
    state.engine.check_queue(len(prompts) * n)
    try:
        for i, (text, ids, params) in enumerate(prompts):
            stream = await state.engine.add_request(
                text, params, f"{engine_id}-{i}", ids, check_queue=False, max_tokens_must_fit=True, sink=sink,
                tag=i, grammar_after=grammar_after,
            )  # fmt: skip
            streams.append(stream)
    except BaseException as e:
        for stream in streams:
            await stream.aclose()
        if chat and isinstance(e, ParamError) and e.param == "prompt":  # a chat prompt is its rendered messages
            e.param = "messages"
        raise
    group = StreamGroup(streams)
    try:
        if req.stream:
            response = await stream_response(request, sink, group)
            if state.log_outputs:
                state.log_choices(request_id, choices)
            return response
        async for batch in group.batches():
            for i, out in batch:
                absorb(choices, i, n, out)
    finally:
        # However the handler ends (a client gone before its headers could be written, a cancellation), its
        # requests are released.
        await group.aclose()
    failed = next((c for c in choices if c.error), None)
    if failed is not None:
        raise APIError(failed.error_status, failed.error, type_=error_type(failed.error_status))
    if state.log_outputs:
        state.log_choices(request_id, choices)
    if chat:
        body = chat_chunk(request_id, created, state.model_name, choices, final=True, role=state.response_role)
    else:
        body = completion_chunk(request_id, created, state.model_name, choices, final=True)
    if tools is not None:
        for body_choice, choice in zip(body["choices"], choices):
            tools.message(body_choice, choice)
    if echo:
        for body_choice in body["choices"]:
            body_choice["message"]["content"] = echo + (body_choice["message"]["content"] or "")
    if req.prompt_logprobs is not None:
        add_prompt_logprobs(body, choices, chat)
    if req.return_token_ids:
        add_token_ids(body, choices, chat, final=True)
    cached = cached_tokens(choices, n) if state.enable_prompt_tokens_details else None
    details = tools.completion_tokens_details(choices) if tools is not None else None
    body["usage"] = usage(prompt_tokens, sum(c.num_tokens for c in choices), cached, details)
    return json_response(body if reply is None else reply.body(body, choices))


# -- app --------------------------------------------------------------------------------------------------------


_UNTRACKED = ("/health", "/ping", "/metrics")  # cheap, engine-free routes: always served, never waited for


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    state: ServerState = request.app[STATE_KEY]
    guard = state.connections
    if guard is None:
        return await _admit(request, handler, state)
    guard.request_started(request.protocol)  # no read deadline while the request runs
    try:
        return await _admit(request, handler, state)
    finally:
        guard.request_finished(request.protocol)  # a kept-alive connection may now idle (--timeout-keep-alive)


async def _admit(request: web.Request, handler, state: ServerState):
    if state.authorizations is not None and request.path.startswith(("/v1", "/invocations")):
        given = request.headers.get("Authorization", "").encode("utf-8", "replace")
        if not any(hmac.compare_digest(given, key) for key in state.authorizations):
            return error_response(401, "Incorrect or missing API key.", code="invalid_api_key")
    if request.path in _UNTRACKED:
        return await _handle(request, handler, state)
    if state.draining:
        state.metrics.on_rejected("shutting_down")
        resp = error_response(503, SHUTTING_DOWN, type_="service_unavailable", code="shutting_down")
        resp.force_close()
        return resp
    state.inflight += 1
    state.idle.clear()
    try:
        await state.engine.intake_turn()
        return await _handle(request, handler, state)
    finally:
        state.engine.intake_ended()
        state.inflight -= 1
        if state.inflight == 0:
            state.idle.set()


async def _handle(request: web.Request, handler, state: ServerState):
    try:
        return await handler(request)
    except APIError as e:
        resp = error_response(e.status, e.message, e.type, e.param, e.code)
        if e.status == 408:  # the rest of the body may still come: the connection cannot be reused
            resp.force_close()
        return resp
    except ParamError as e:
        return error_response(400, str(e), param=e.param, code=e.code)
    except EngineOverloadedError as e:
        state.metrics.on_rejected(e.code)
        resp = error_response(429, str(e), type_="rate_limit_error", code=e.code)
        resp.headers["Retry-After"] = str(e.retry_after)
        return resp
    except EngineDeadError as e:
        return error_response(503, str(e), type_="service_unavailable")
    except ValueError as e:
        return error_response(400, str(e))
    except web.HTTPException as e:
        if e.status == 404:
            return error_response(404, f"no route {request.method} {request.path}", code="not_found")
        if e.status == 405:
            return error_response(405, f"method {request.method} not allowed on {request.path}")
        if e.status == 413:
            return error_response(
                413,
                f"the request body is larger than this server's limit of {MAX_BODY_BYTES} bytes",
                code="request_too_large",
            )
        raise
    except asyncio.CancelledError:
        raise
    except ConnectionError as e:  # the client hung up (e.g. while sending its body): not the server's fault
        logger.debug("client disconnected during %s %s: %r", request.method, request.path, e)
        return error_response(400, "the client disconnected", code="client_disconnected")
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal server error", type_="server_error")


def _static_json(obj):
    """A handler answering `obj`, encoded once."""
    body = msgspec.json.encode(obj)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return handler


# aiohttp's server settings for the app: a handler whose client disconnects is cancelled (its requests end)
SERVER_OPTIONS = {"handler_cancellation": True}


def build_app(
    engine: AsyncEngine,
    served_model_name: str | list[str],
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    enable_prompt_tokens_details: bool = False,
    enable_tokenizer_info_endpoint: bool = False,
    response_role: str = "assistant",
    cors_options: CorsOptions | None = cors.ALLOW_ALL,
    reasoning_parser: str | None = None,
    log_requests: bool = False,
    trust_request_chat_template: bool = False,
    default_chat_template_kwargs: dict | None = None,
    force_include_usage: bool = False,
    return_tokens_as_token_ids: bool = False,
    request_id_headers: bool = False,
    openapi: bool = True,
    stream_interval: int = 1,
) -> web.Application:
    """`cors_options` None: no CORS headers and no preflight answers (OPTIONS gets 405)."""
    app = web.Application(middlewares=[errors_and_auth], client_max_size=MAX_BODY_BYTES)
    if cors_options is not None:
        cors.install(app, cors_options)
    app[ENGINE_KEY] = engine
    state = app[STATE_KEY] = ServerState(engine, served_model_name, api_key)
    state.response_role = response_role
    state.reasoning_parser = reasoning_parser
    state.think_end_token = think_end_token(engine.config.tokenizer, reasoning_parser) if reasoning_parser else None
    state.log_requests = log_requests
    state.trust_request_chat_template = trust_request_chat_template
    state.default_template_kwargs = default_chat_template_kwargs or None
    state.force_include_usage = force_include_usage
    state.tokens_as_token_ids = return_tokens_as_token_ids
    state.stream_interval = stream_interval
    if request_id_headers:
        app.on_response_prepare.append(_add_request_id)
    state.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    state.enable_auto_tool_choice = enable_auto_tool_choice
    state.enable_prompt_tokens_details = enable_prompt_tokens_details
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    responses = ResponsesEndpoint(_chat_completions)
    app.router.add_post("/v1/responses", responses.create)
    app.router.add_get("/v1/responses/{response_id}", responses.retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", responses.cancel)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_get("/version", _static_json({"version": __version__}))
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)  # vLLM's (SageMaker's) name for the same, by GET or POST
    app.router.add_post("/ping", health)
    app.router.add_post("/invocations", invocations)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    if enable_tokenizer_info_endpoint:
        app.router.add_get("/tokenizer_info", _static_json(tokenizer_info(engine)))
    if openapi:
        app.router.add_get("/openapi.json", _static_json(openapi_spec()))

    async def on_startup(app):
        engine.start()

    async def on_cleanup(app):
        await engine.shutdown()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
