"""What a Responses request gets back: the response object (OpenAI's shape: id resp_..., status, output items,
usage, the request's parameters echoed) made from the chat path's reply, whole or at the end of its stream of events
(responses_stream.py), and kept for previous_response_id when the request stores it."""

from __future__ import annotations

import msgspec

from aserve.entrypoints.openai.responses import ChoiceState, cached_tokens
from aserve.entrypoints.openai.responses_items import INCOMPLETE, output_items, response_status
from aserve.entrypoints.openai.responses_protocol import ResponsesRequest
from aserve.entrypoints.openai.responses_store import ResponseStore
from aserve.entrypoints.openai.responses_stream import ResponseEventStream


def response_usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": input_tokens + output_tokens,
    }


class ResponseReply:
    """How one Responses request's chat reply goes back (server._generate's `reply`): its id's prefix, its stream
    (`event_stream`, in place of a chat stream) or its whole body (`body`), and the response object either makes.
    `history`: the conversation before this request's input (previous_response_id); `store`: where a stored
    response goes."""

    id_prefix = "resp_"

    def __init__(self, req: ResponsesRequest, model: str, defaults: dict, history: list,
                 store: ResponseStore | None) -> None:  # fmt: skip
        self.req, self.model = req, model
        self.history, self.store = history, store
        # the sampling parameters echoed as they apply: the request's, else the model's generation config's
        self.temperature = req.temperature if req.temperature is not None else defaults.get("temperature", 1.0)
        self.top_p = req.top_p if req.top_p is not None else defaults.get("top_p", 1.0)

    def event_stream(self, *args) -> ResponseEventStream:
        """The stream's sink: event_stream.EventStream's arguments."""
        return ResponseEventStream(*args, reply=self)

    def body(self, chat_body: dict, choices: list[ChoiceState]) -> dict:
        """A whole chat completion (its message as the tool-call and reasoning handling left it) -> the response."""
        choice, (state,) = chat_body["choices"][0], choices
        status = response_status(choice["finish_reason"])
        output = output_items(choice["message"], choice["logprobs"], status)
        details = chat_body["usage"].get("completion_tokens_details")
        return self.finish(chat_body["id"], chat_body["created"], status, output, state, details)

    def finish(self, response_id: str, created: int, status: str, output: list[dict], choice: ChoiceState,
               details: dict | None) -> dict:  # fmt: skip
        """The finished response (stored if asked for); `details`: the chat usage's completion_tokens_details (the
        reasoning parser's count of reasoning tokens; None without one)."""
        usage = response_usage(len(choice.prompt_token_ids), choice.num_tokens, cached_tokens([choice], 1),
                               (details or {}).get("reasoning_tokens", 0))  # fmt: skip
        response = self.response(response_id, created, status, output, usage)
        if self.store is not None and self.req.store is not False:
            self.store.put(response, [*self.history, *self.req.input_items(), *output])
        return response

    def response(self, response_id: str, created: int, status: str, output: list[dict], usage: dict | None = None,
                 error: dict | None = None) -> dict:  # fmt: skip
        """OpenAI's response object, with the request's parameters as they apply."""
        req = self.req
        text_format = {"type": "text"}
        if req.text is not None and req.text.format is not None:
            text_format = {k: v for k, v in msgspec.structs.asdict(req.text.format).items() if v is not None}
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == INCOMPLETE else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning is not None else None, "summary": None},
            "safety_identifier": req.safety_identifier,
            "service_tier": req.service_tier or "auto",
            "store": req.store is not False,
            "temperature": self.temperature,
            "text": {"format": text_format},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": self.top_p,
            "truncation": req.truncation or "disabled",
            "usage": usage,
            "user": req.user,
        }
