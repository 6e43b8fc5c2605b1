"""GET /openapi.json: an OpenAPI 3.1 description of the routes, with request bodies generated from the msgspec
request types that parse them (so the description cannot drift from what the server accepts) plus the API limits."""

from __future__ import annotations

import msgspec

from aserve.entrypoints.openai import protocol
from aserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from aserve.entrypoints.openai.responses_protocol import ResponsesRequest

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}

_ERRORS = {
    "400": "invalid request (the message names the field and the fix)",
    "401": "missing or wrong API key (when the server has one)",
    "404": "unknown model or route",
    "413": "request body over the server's size limit",
    "429": "the waiting queue is full (--max-queue-len); see the Retry-After header",
    "500": "internal error while running this request (other requests are unaffected)",
    "503": "shutting down, or the engine stopped",
}


def _limits(schemas: dict) -> None:
    """The caps protocol.py enforces, as JSON Schema keywords (enforced in code, with clearer messages)."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["n"].update(minimum=1, maximum=protocol.MAX_N)
        stop_string = {"type": "string", "minLength": 1, "maxLength": protocol.MAX_STOP_STRING_CHARS}
        props["stop"]["anyOf"] = [
            stop_string, {"type": "array", "items": stop_string, "maxItems": protocol.MAX_STOP_STRINGS},
            {"type": "null"},
        ]  # fmt: skip
        props["stop_token_ids"]["anyOf"][0]["maxItems"] = protocol.MAX_STOP_TOKEN_IDS
        props["max_tokens"]["anyOf"][0]["minimum"] = 1
    for name, field in (("CompletionRequest", "logprobs"), ("ChatCompletionRequest", "top_logprobs")):
        schemas[name]["properties"][field]["anyOf"][0].update(minimum=0, maximum=protocol.MAX_LOGPROBS)


_CHUNKS = ("with stream=true: `data: {chunk}` events, then `data: [DONE]`; a stream that cannot finish ends with "
           '`data: {"error": {...}}` before [DONE]')  # fmt: skip
_RESPONSE_EVENTS = ("with stream=true: `event: {type}` / `data: {event}` events, response.created to "
                    "response.completed; one that cannot finish ends with `error` and response.failed")  # fmt: skip


def _post(summary: str, schema_ref: dict, streams: bool, stream_description: str = _CHUNKS) -> dict:
    content = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}, "description": stream_description}
    responses = {"200": {"description": "OK", "content": content}}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for status, why in _ERRORS.items():
        responses[status] = {"description": why, "content": error}
    body = {"required": True, "content": {"application/json": {"schema": schema_ref}}}
    return {"post": {"summary": summary, "requestBody": body, "responses": responses}}


def openapi_spec() -> dict:
    types = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest]
    refs, schemas = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    _limits(schemas)
    schemas["Error"] = _ERROR
    completion, chat, tokenize, detokenize, responses = refs
    ok = {"200": {"description": "OK"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "aserve", "version": "0.1.0", "description": "OpenAI-compatible LLM inference server"},
        "paths": {
            "/v1/completions": _post(
                "Text completion (prompt: string, token ids, or a list of either)", completion, streams=True
            ),
            "/v1/chat/completions": _post("Chat completion", chat, streams=True),
            "/v1/responses": _post("OpenAI's Responses API, on the chat path", responses, True, _RESPONSE_EVENTS),
            "/v1/responses/{response_id}": {"get": {"summary": "A stored response", "responses": ok}},
            "/v1/responses/{response_id}/cancel": {
                "post": {
                    "summary": "400 for a stored response (none runs in the background); 404 otherwise",
                    "responses": {"400": {"description": "Cannot cancel a synchronous response."}},
                }
            },
            "/tokenize": _post("Tokenise a prompt or chat messages", tokenize, streams=False),
            "/detokenize": _post("Token ids to text", detokenize, streams=False),
            "/v1/models": {"get": {"summary": "The served model", "responses": ok}},
            "/health": {
                "get": {"summary": "200 when serving; 503 when shutting down or the engine stopped", "responses": ok}
            },
            "/ping": {
                "get": {"summary": "/health by vLLM's other name", "responses": ok},
                "post": {"summary": "/health by vLLM's other name", "responses": ok},
            },
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": ok}},
            "/invocations": _post(
                "vLLM's SageMaker route: a chat completion when the body has messages, else a completion",
                {"oneOf": [chat, completion]},
                streams=True,
            ),
        },
        "components": {"schemas": schemas},
    }
