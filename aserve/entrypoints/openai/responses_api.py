"""OpenAI's Responses API on aserve's chat path: POST /v1/responses (whole or streamed), GET /v1/responses/{id}
(a stored response) and POST /v1/responses/{id}/cancel (refused: nothing runs in the background). A response is a
chat request (responses_protocol.py) run by the server's own chat handler, its reply made into a response object or
its events (responses_output.py, responses_stream.py); errors name the Responses fields a client sent."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from aserve.entrypoints.openai.protocol import APIError
from aserve.entrypoints.openai.responses_output import ResponseReply
from aserve.entrypoints.openai.responses_protocol import ResponsesRequest, responses_param
from aserve.entrypoints.openai.responses_store import ResponseStore
from aserve.entrypoints.openai.server_state import STATE_KEY, ServerState, json_response
from aserve.sampling_params import ParamError

# server._chat_completions: (request, state, chat request, reply) -> the response
RunChat = Callable[..., Awaitable[web.StreamResponse]]


class ResponsesEndpoint:
    """The routes' handlers, with the store they share."""

    def __init__(self, run_chat: RunChat, store: ResponseStore | None = None) -> None:
        self.run_chat = run_chat
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses."""
        state: ServerState = request.app[STATE_KEY]
        req = await state.bodies.parse(request, ResponsesRequest)
        try:
            history = self._history(req)
            chat = req.chat_request(history, state.engine.config.max_model_len)
            state.add_template_defaults(chat)
            reply = ResponseReply(req, state.model_name, state.engine.config.default_sampling, history, self.store)
            return await self.run_chat(request, state, chat, reply)
        except (ParamError, APIError) as e:  # named as the Responses request names the field
            e.param = responses_param(e.param)
            raise

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{response_id}: a stored response."""
        if request.query:
            name = next(iter(request.query))
            raise APIError(400, f"query parameter {name!r} is not supported (stored responses are complete; there is "
                           "nothing to stream)", param=name)  # fmt: skip
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return json_response(stored.body)

    async def cancel(self, request: web.Request) -> web.Response:
        """POST /v1/responses/{response_id}/cancel: as vLLM answers it for a response that was not made in the
        background (aserve makes none there): 400 for a stored one, which is already complete; 404 otherwise."""
        response_id = request.match_info["response_id"]
        if self.store.get(response_id) is None:
            raise _not_found(response_id, "response_id")
        raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")

    def _history(self, req: ResponsesRequest) -> list:
        """The conversation before this request's input: the stored response's that previous_response_id names."""
        if req.previous_response_id is None:
            return []
        stored = self.store.get(req.previous_response_id)
        if stored is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        return stored.items


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found (responses are kept in this server's memory, "
                    "the most recent ones, when stored)", param=param, code="response_not_found")  # fmt: skip
