"""The Responses API's request (POST /v1/responses, vLLM's ResponsesRequest fields) and its translation to a chat
request: the conversation that `instructions`, an earlier response's conversation (previous_response_id) and `input`
spell, with the sampling, tool-calling, structured-output and reasoning fields as /v1/chat/completions takes them, so
that a response runs the chat path (template, sampling parameters, tool and reasoning parsing, grammars) as it is.
Every field is implemented, accepted without effect, or refused with a 400 naming it (RESPONSES_REFUSED and the
chat request's own refusals); any other is unrecognised (connections._decode)."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from aserve.entrypoints.openai.protocol import ChatCompletionRequest, StreamOptions
from aserve.entrypoints.openai.request_fields import REFUSED_FIELDS, asks_for
from aserve.entrypoints.openai.responses_items import chat_messages, continues_last
from aserve.entrypoints.openai.structured_request import JSONSchemaFormat, ResponseFormat
from aserve.sampling_params import ParamError

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value: the output text's logprobs
TEXT_FORMATS = ("text", "json_object", "json_schema")
# OpenAI's documented bounds on metadata (it is echoed and stored): pairs, characters of a key, of a value
METADATA_LIMITS = (16, 64, 512)

# The Responses fields aserve does not implement -> why; each refused whenever it asks for something
# (request_fields.asks_for), as the chat request's REFUSED_FIELDS are.
RESPONSES_REFUSED = {
    "background": "background responses are not implemented; stream the response instead",
    "background_options": "background responses are not implemented",
    "conversation": "stored conversations are not implemented; send previous_response_id or the whole input",
    "prompt": "prompt templates are not supported (as in vLLM)",
    "context_management": "context compaction is not implemented",
    "image": "aserve generates text only",
    "access_programs": "aserve runs no hosted programs",
    "enable_response_messages": "vLLM's raw input and output messages are not returned",
    "previous_input_messages": "vLLM's gpt-oss (Harmony) message history is not implemented; send input items",
    "previous_response": "vLLM's stateless gpt-oss turns are not implemented; send input items or previous_response_id",
    **{name: REFUSED_FIELDS[name] for name in ("moderation", "priority", "vllm_xargs", "mm_processor_kwargs")},
}


class ReasoningConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`reasoning`: effort goes to the chat template as chat's reasoning_effort (with enable_thinking)."""

    effort: str | None = None
    summary: str | None = None  # refused: no summaries are generated (reasoning items carry the reasoning itself)
    generate_summary: str | None = None  # OpenAI's older name for summary


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`text.format`: {"type": "text" | "json_object" | "json_schema", "name", "schema", "description", "strict"}."""

    type: str
    name: str | None = None
    schema: dict | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused, as chat's verbosity


class ResponsesStreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # accepted: aserve's events carry no obfuscation padding


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | list | None = None  # a string (one user message), or items (responses_items.py)
    instructions: str | None = None  # a system message first; not carried to a later response (OpenAI's rule)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False  # null: false (OpenAI's nullable field, as vLLM reads it)
    stream_options: ResponsesStreamOptions | None = None
    tools: list | None = None  # function tools in the flat shape: {"type": "function", "name", "parameters", ...}
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None  # with include ["message.output_text.logprobs"]
    truncation: str | None = None  # "disabled" (default) | "auto": the prompt's last max_model_len tokens
    metadata: dict[str, str] | None = None  # echoed and stored
    store: bool | None = None  # default true: kept in memory for previous_response_id and GET (responses_store.py)
    previous_response_id: str | None = None
    # accepted without effect (request_fields.IGNORED_FIELDS; max_tool_calls caps built-in tools, which aserve has
    # none of)
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    max_tool_calls: int | None = None
    # refused (RESPONSES_REFUSED)
    background: bool | None = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    image: Any = None
    moderation: Any = None
    access_programs: Any = None
    # vLLM's extras, as its chat request has them
    request_id: str | None = None  # the response's id after "resp_" (an X-Request-Id header wins)
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict | None = None
    cache_salt: str | None = None
    logit_bias: dict[str, float] | None = None
    priority: int = 0
    vllm_xargs: dict | None = None
    mm_processor_kwargs: dict | None = None
    enable_response_messages: bool = False
    previous_input_messages: list | None = None
    previous_response: dict | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def check_unsupported(self) -> None:
        """400 for what the chat request cannot say: the refused fields, `include` values, reasoning summaries,
        text.verbosity and text.format's shape, truncation, metadata beyond OpenAI's bounds."""
        for name, why in RESPONSES_REFUSED.items():
            if asks_for(name, getattr(self, name)):
                raise ParamError(name, f"{name} is not supported: {why}")
        if self.input is None:
            raise ParamError("input", "input is required: a string or a list of input items")
        for value in self.include or ():
            if value != LOGPROBS_INCLUDE:
                raise ParamError("include", f"include {value!r} is not supported; aserve includes {LOGPROBS_INCLUDE}")
        if self.top_logprobs and not self.wants_logprobs:
            raise ParamError("top_logprobs", f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]")
        for name in ("summary", "generate_summary"):
            if self.reasoning is not None and getattr(self.reasoning, name) is not None:
                raise ParamError(f"reasoning.{name}", "reasoning summaries are not generated; with --reasoning-parser "
                                 "the reasoning items carry the reasoning text itself")  # fmt: skip
        if self.text is not None and self.text.verbosity is not None:
            raise ParamError("text.verbosity", f"text.verbosity is not supported: {REFUSED_FIELDS['verbosity']}")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type not in TEXT_FORMATS:
            raise ParamError("text.format.type", f"text.format.type must be one of {', '.join(TEXT_FORMATS)}")
        if fmt is not None and fmt.type == "json_schema" and fmt.schema is None:
            raise ParamError("text.format.schema", "text.format of type 'json_schema' needs a schema")
        if self.truncation not in (None, "disabled", "auto"):
            raise ParamError("truncation", "truncation must be 'disabled' or 'auto'")
        pairs, key_chars, value_chars = METADATA_LIMITS
        metadata = self.metadata or {}
        if len(metadata) > pairs or any(len(k) > key_chars or len(v) > value_chars for k, v in metadata.items()):
            raise ParamError("metadata", f"metadata holds at most {pairs} pairs, keys of at most {key_chars} "
                             f"characters and values of at most {value_chars}")  # fmt: skip

    def input_items(self) -> list:
        """The input as items: a string is one user message."""
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else list(self.input)

    def chat_request(self, history: list, max_model_len: int) -> ChatCompletionRequest:
        """The chat request this response runs as. `history`: the items of the conversation so far (an earlier
        response's, previous_response_id), before this request's input. truncation "auto" keeps the prompt's last
        max_model_len - max_output_tokens tokens, room for the reply (without max_output_tokens, its last
        max_model_len)."""
        self.check_unsupported()
        items = [*history, *self.input_items()]
        messages = chat_messages(items, start=-len(history))  # errors name this input's items from 0
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        continues = continues_last(items)
        logprobs = self.wants_logprobs
        return ChatCompletionRequest(
            messages=messages, model=self.model, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream,
            stream_options=StreamOptions(include_usage=False,
                                         include_obfuscation=self.stream_options.include_obfuscation)
            if self.stream_options is not None else None,
            tools=_chat_tools(self.tools), tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls is not False, response_format=self._response_format(),
            structured_outputs=self.structured_outputs, logprobs=logprobs,
            top_logprobs=self.top_logprobs if logprobs else None,
            reasoning_effort=self.reasoning.effort if self.reasoning is not None else None,
            add_generation_prompt=not continues, continue_final_message=continues,
            truncate_prompt_tokens=self._kept_prompt_tokens(max_model_len), request_id=self.request_id,
            top_k=self.top_k, repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, cache_salt=self.cache_salt,
            logit_bias=self.logit_bias,
        )  # fmt: skip

    def _kept_prompt_tokens(self, max_model_len: int) -> int | None:
        if self.truncation != "auto":
            return None
        room = self.max_output_tokens if isinstance(self.max_output_tokens, int) else 0
        return max_model_len - room if 0 < room < max_model_len else -1

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else ResponseFormat(type=fmt.type)
        schema = JSONSchemaFormat(name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict)
        return ResponseFormat(type="json_schema", json_schema=schema)


def _chat_tools(tools: list | None) -> list[dict] | None:
    """Flat function tools -> chat's {"type": "function", "function": {...}}; any other tool type is refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ParamError(f"tools[{i}].type", f"tool type {kind!r} is not supported: aserve calls function "
                             "tools, which the client runs (it has no built-in tools)")  # fmt: skip
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """{"type": "function", "name": ...} -> chat's {"type": "function", "function": {"name": ...}}."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ParamError("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                         '"name": ...}: aserve has no built-in tools and no allowed_tools lists')  # fmt: skip
    return {"type": "function", "function": {"name": choice["name"]}}


# The chat request's names (and SamplingParams') -> the Responses field a client sent
_CHAT_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "response_format": "text.format", "logprobs": "top_logprobs", "reasoning_effort": "reasoning.effort",
                "truncate_prompt_tokens": "truncation"}  # fmt: skip


def responses_param(param: str | None) -> str | None:
    """The Responses field an error about a chat request's field is about."""
    if param is None or param.startswith("messages"):
        return "input" if param is not None else None
    if param.startswith("tools["):
        return re.sub(r"\.function\b", "", param)
    return _CHAT_PARAMS.get(param, param)
