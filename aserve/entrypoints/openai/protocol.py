"""The OpenAI API on the wire: request types (msgspec) and their translation to SamplingParams (responses.py shapes
what goes back)."""

from __future__ import annotations

from typing import Any

import msgspec

from aserve.entrypoints.chat_utils import parse_conversation
from aserve.entrypoints.openai.request_fields import REFUSED_FIELDS, asks_for, null_as_default
from aserve.entrypoints.openai.structured_request import (
    STRUCTURED_FIELDS,
    ResponseFormat,
    structured_outputs_params,
)
from aserve.entrypoints.openai.tool_request import check_tools, forced_output
from aserve.sampling_params import ParamError, SamplingParams

# What one API request may ask for. A client can always split work across requests; these bound what a single
# request costs the server before any of it is checked against the model (per-token stop-string scans, fan-out).
MAX_N = 128  # OpenAI's documented maximum for n
MAX_SEQUENCES = 1024  # prompts x n in one /v1/completions request
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256  # also bounds how much text a stream holds back while a stop string may be forming
MAX_BAD_WORDS = 256  # bad_words: each tokenised twice when the request is queued, each checked every step
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI allows 20 top_logprobs in chat
MAX_LOGIT_BIAS = 1024  # logit_bias entries
_INT64 = (-(2**63), 2**63 - 1)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# apply_chat_template's own arguments: chat_template_kwargs may not set them
TEMPLATE_CONTROLS = frozenset({"add_generation_prompt", "continue_final_message", "tools", "tokenize", "conversation",
                                "chat_template", "return_dict", "return_tensors", "padding", "truncation",
                                "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})  # fmt: skip


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = True  # vLLM's default: stream_options asks for the usage chunk unless false or null
    continuous_usage_stats: bool | None = False  # vLLM's: usage (so far) on every chunk too
    include_obfuscation: bool | None = None  # accepted: aserve's chunks carry no obfuscation padding


class _GenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras). A field that is none
    of these is a 400 (connections._decode)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1  # null: the default, for each of request_fields.NULLABLE_FIELDS (null_as_default)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None  # structured output (structured_outputs_params)
    # Parsed only to be refused where they would change the output (check_unsupported, request_fields.py): msgspec
    # drops unknown fields, so without them a client asking for them would silently get nothing
    best_of: int | None = None
    use_beam_search: bool = False
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    structured_outputs: dict | None = None  # vLLM's StructuredOutputsParams fields
    # vLLM's older spelling of structured_outputs' json / regex / choice / grammar (removed in vLLM 0.12)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: the last max_model_len)
    return_token_ids: bool | None = None  # the prompt's and each choice's token ids in the response
    add_special_tokens: bool | None = None  # None: completions' prompts get them (BOS), chat's only the template's
    truncation_side: str | None = None  # truncate_prompt_tokens keeps the last N ("left", default) or first N ("right")
    request_id: str | None = None  # the response's id after "cmpl-" / "chatcmpl-" (an X-Request-Id header wins)
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens written "token_id:N"
    stream_interval: int | None = None  # streamed chunks of at least this many tokens (raises --stream-interval)
    # vLLM's fields that aserve accepts without effect or refuses (request_fields.py)
    session_id: str | None = None
    length_penalty: float = 1.0
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool = True
    routed_experts_prompt_start: int = 0
    priority: int = 0
    watermarking: bool | None = None
    thinking_token_budget: int | None = None
    logprob_token_ids: list[int] | None = None
    repetition_detection: dict | None = None
    kv_transfer_params: dict | None = None
    ec_transfer_params: dict | None = None
    vllm_xargs: dict | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        null_as_default(self)

    @property
    def include_usage(self) -> bool:
        """A usage chunk ends the stream: stream_options with include_usage true, its default (as vLLM)."""
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's stream_options.continuous_usage_stats)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def truncate(self, ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens keeps it, from the side truncation_side names."""
        kept = params.truncate_prompt(ids, max_model_len)
        return ids[: len(kept)] if self.truncation_side == "right" else kept

    def num_logprobs(self) -> int | None:
        return None

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def check_unsupported(self) -> None:
        """400 for what aserve does not do (rather than ignoring it): request_fields.REFUSED_FIELDS, best_of; and
        stream_options without stream (vLLM's 400)."""
        for name, why in REFUSED_FIELDS.items():
            if asks_for(name, getattr(self, name, None)):
                raise ParamError(name, f"{name} is not supported: {why}")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ParamError("stream_interval", "stream_interval must be >= 1")
        if self.truncation_side not in (None, "left", "right"):
            raise ParamError("truncation_side", "truncation_side must be 'left' or 'right'")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "Stream options can only be defined when `stream=True`.")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise ParamError("best_of", "best_of is not supported (only best_of = n)")

    def check_limits(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        """The caps above, plus integers that must fit in 64 bits (JSON integers are unbounded). max_logprobs: the
        engine's (--max-logprobs; -1: the vocabulary, which the engine checks)."""
        self.check_unsupported()
        self.structured_outputs_params()
        if isinstance(self.n, int) and self.n > MAX_N:
            raise ParamError("n", f"n must be <= {MAX_N}, got {self.n}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if self.bad_words is not None and (len(self.bad_words) > MAX_BAD_WORDS or any(
                isinstance(w, str) and len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words)):  # fmt: skip
            raise ParamError("bad_words", f"at most {MAX_BAD_WORDS} bad_words of at most {MAX_STOP_STRING_CHARS} "
                             "characters each are allowed")  # fmt: skip
        if any(len(stop) > MAX_STOP_STRING_CHARS for stop in stops):
            raise ParamError("stop", f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParamError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed")
        cap = None if max_logprobs == -1 else max_logprobs
        num_logprobs = self.num_logprobs()
        if num_logprobs is not None and cap is not None and num_logprobs > cap:
            raise ParamError(self.logprobs_param, f"at most {cap} logprobs per token are allowed")
        if self.prompt_logprobs is not None and (
            self.prompt_logprobs < -1 or (cap is not None and not 0 <= self.prompt_logprobs <= cap)
        ):
            raise ParamError("prompt_logprobs", f"prompt_logprobs must be in [0, {cap}]")
        for name in ("seed", "top_k", "min_tokens", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and not _INT64[0] <= value <= _INT64[1]:
                raise ParamError(name, f"{name} must be a 64-bit integer")
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ParamError("logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed")

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with its JSON keys as token ids."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise ParamError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            bias[int(key)] = value
        return bias

    logprobs_param = "logprobs"

    def param_names(self) -> dict[str, str]:
        """SamplingParams' field -> this request's name for it, where they differ (for the `param` of errors)."""
        return {}

    def to_sampling_params(self, max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        """After check_limits (which the handler runs once, before tokenising). `defaults`: the sampling fields a
        request leaves unset (EngineConfig.default_sampling: the model's generation config), else SamplingParams'."""
        defaults = defaults or {}
        if (cap := defaults.get("max_tokens")) is not None:  # the generation config's max_new_tokens, as vLLM
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)

        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            logit_bias=self.token_logit_bias(),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            cache_salt=self.cache_salt,
            structured_outputs=self.structured_outputs_params(),
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words,
        )

    def structured_outputs_params(self):
        """The constraint on the output: structured output's fields (structured_request.py); None when no field asks
        for it."""
        if all(getattr(self, name) is None for name in STRUCTURED_FIELDS):
            return None
        return structured_outputs_params(self)


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: str | list  # a string, token ids, or a list of either (validated by prompts())
    max_tokens: int | None = 16  # OpenAI's default when absent; null: up to the context length (as vLLM)
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    prompt_embeds: Any = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens must be >= 1 (0 only with echo: scoring the prompt)")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def score_only(self) -> bool:
        """echo with max_tokens 0: the prompt's logprobs, nothing generated (one token is, and dropped)."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.score_only else self.max_tokens

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too (as many alternatives as either field asks for)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of strings / token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ParamError("prompt", "prompt must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return [list(p)]
        prompts = []
        for item in p:
            if isinstance(item, str):
                prompts.append(item)
            elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                prompts.append(list(item))
            else:
                raise ParamError(
                    "prompt", "prompt must be a string, a list of token ids, or a list of strings / token-id lists"
                )
        return prompts


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message stays open: the reply continues it
    echo: bool = False  # vLLM's: the reply starts with the last message's text when it continues that message
    chat_template_kwargs: dict | None = None
    reasoning_effort: str | None = None  # to the chat template, as vLLM passes it (with enable_thinking)
    include_reasoning: bool = True  # with --reasoning-parser: false drops the reasoning (reasoning.py)
    tools: list[dict] | None = None  # tool calling: tool_request.py (the request), tool_output.py (the response)
    tool_choice: str | dict | None = None  # None: "auto" with tools, "none" without (OpenAI's defaults)
    parallel_tool_calls: bool | None = True
    documents: list[dict] | None = None  # to the chat template (retrieval-augmented templates read them)
    chat_template: str | None = None  # the request's own template (the server's --trust-request-chat-template)
    # OpenAI's and vLLM's fields that aserve accepts without effect or refuses (request_fields.py)
    media_io_kwargs: dict | None = None
    mm_processor_kwargs: dict | None = None
    return_prompt_text: bool | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    moderation: dict | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools is not None or self.tool_choice is not None:
            check_tools(self.tools, self.tool_choice)
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("continue_final_message", "Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")  # fmt: skip
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise ParamError("reasoning_effort", f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}")
        reserved = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_CONTROLS)
        if reserved:
            raise ParamError("chat_template_kwargs", f"chat_template_kwargs may not set {reserved[0]!r} (request "
                             "fields set add_generation_prompt, continue_final_message and tools)")  # fmt: skip

    def template_kwargs(self, exclude_tools_when_none: bool = False) -> dict | None:
        """The chat template's extra arguments: chat_template_kwargs, tools (not with tool_choice "none" where
        exclude_tools_when_none), documents, continue_final_message, reasoning_effort with enable_thinking (unless
        chat_template_kwargs sets it), as vLLM passes them, and the request's own chat_template (the server checks
        that it may)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools and not (exclude_tools_when_none and self.tool_choice == "none"):
            kwargs["tools"] = self.tools
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs or None

    def echo_text(self, conversation: list[dict]) -> str:
        """With echo, the last message's text when the reply continues it (it is the assistant's, or no generation
        prompt follows it), else ""."""
        last = conversation[-1]
        if not self.echo or (self.add_generation_prompt and last["role"] != "assistant"):
            return ""
        content = last["content"]
        return content if isinstance(content, str) else "".join(part["text"] for part in content)

    def structured_outputs_params(self):
        """tool_choice "required" or a named function forces the output's shape (tool_request.forced_output), which
        no other structured output may then change."""
        forced = forced_output(self.tools, self.tool_choice, self.parallel_tool_calls) if self.tools else None
        if forced is None:
            return super().structured_outputs_params()
        if super().structured_outputs_params() is not None:
            raise ParamError("tool_choice", "tool_choice 'required' or a named function cannot be combined with "
                             "response_format or structured_outputs")  # fmt: skip
        return forced

    logprobs_param = "top_logprobs"

    def param_names(self) -> dict[str, str]:
        names = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
            return None
        return self.top_logprobs or 0

    def conversation(self, keep_parts: bool = False) -> list[dict]:
        """Messages in the shape chat templates expect (chat_utils.parse_conversation)."""
        return parse_conversation(self.messages, keep_parts)


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /tokenize: a prompt, or messages rendered as /v1/chat/completions renders them (the same template
    arguments); return_token_strs adds each token's string."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None  # prompt: default true; messages: default false (the template's only)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None
    tools: list[dict] | None = None
    mm_processor_kwargs: dict | None = None
    return_token_strs: bool = False

    def chat_request(self) -> ChatCompletionRequest:
        """The messages and template arguments as a chat request, checked as one."""
        chat = ChatCompletionRequest(messages=self.messages, add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message,
                                     chat_template=self.chat_template, chat_template_kwargs=self.chat_template_kwargs,
                                     documents=self.documents, tools=self.tools,
                                     mm_processor_kwargs=self.mm_processor_kwargs)  # fmt: skip
        chat.check_unsupported()
        return chat


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


class _MessageText(msgspec.Struct):
    content: msgspec.Raw = msgspec.Raw(b"null")


class _PromptText(msgspec.Struct):
    """A request body's prompt fields as undecoded JSON: reading them is a scan of the body, with no string made."""

    prompt: msgspec.Raw = msgspec.Raw(b"null")
    messages: list[_MessageText] | None = None


_JSON_BYTES_PER_CHAR = 12  # the most a JSON string spends on one character: an escaped surrogate pair


def min_prompt_chars(body: bytes | bytearray) -> tuple[str, int] | None:
    """A lower bound on the characters of a request body's prompt text, read without decoding any string: -> ("prompt",
    the longest prompt's) for completions, ("messages", all string contents' together) for chat; None when the body
    has neither or does not parse (decoding it reports why). Lets a server refuse a prompt of tens of megabytes
    before making it into a string."""
    try:
        sniffed = msgspec.json.decode(body, type=_PromptText)
        if sniffed.messages:
            texts = [m.content for m in sniffed.messages if _lead(m.content) == b'"']
            return "messages", sum(_chars_at_least(t) for t in texts)
        prompt = sniffed.prompt
        if _lead(prompt) == b'"':
            return "prompt", _chars_at_least(prompt)
        if _lead(prompt) == b"[" and _lead(prompt, 1) == b'"':  # a list of strings (a list of token ids is skipped)
            items = msgspec.json.decode(prompt, type=list[msgspec.Raw])
            return "prompt", max((_chars_at_least(t) for t in items if _lead(t) == b'"'), default=0)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    return None


def _lead(raw: msgspec.Raw, skip: int = 0) -> bytes:
    """The first byte of `raw` after `skip` bytes and any whitespace."""
    view = memoryview(raw)
    for i in range(skip, min(len(view), skip + 64)):
        if view[i] not in b" \t\r\n":
            return bytes(view[i : i + 1])
    return b""


def _chars_at_least(string: msgspec.Raw) -> int:
    return max(0, len(string) - 2) // _JSON_BYTES_PER_CHAR


class APIError(Exception):
    """An error the server answers with an OpenAI error body and `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
