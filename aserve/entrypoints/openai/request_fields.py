"""Request fields that aserve does not implement, each decided once: accepted without effect (none of them changes
the output; vLLM ignores them too) or refused with a 400 naming the field whenever it asks for something. Every other
field of the request types (protocol.py) is implemented; their check_unsupported refuses these, and a field that is
none of them is refused as unrecognised (OpenAI's rule; vLLM only logs it)."""

from __future__ import annotations

import functools

import msgspec

# Accepted and ignored: what they ask for is bookkeeping, billing or routing, or has no effect here, never the output.
IGNORED_FIELDS = {
    "user": "an end-user id for abuse monitoring",
    "safety_identifier": "an end-user id for abuse monitoring",
    "store": "OpenAI's stored completions",
    "metadata": "tags for stored completions",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "OpenAI's prompt-cache routing (aserve's prefix cache needs no key)",
    "prompt_cache_retention": "OpenAI's prompt-cache lifetime",
    "prompt_cache_options": "OpenAI's prompt-cache breakpoints",
    "session_id": "vLLM's session id for routing related requests",
    "return_token_offsets": "vLLM's render endpoints only (ignored by its generation endpoints too)",
    "return_mm_kwargs": "vLLM's render endpoints only (ignored by its generation endpoints too)",
    "routed_experts_prompt_start": "vLLM's routed-expert data, which aserve does not return (nor vLLM by default)",
}

# Refused when they ask for something (any value but null, false, "", [], modalities ["text"] or the value
# ACCEPTED_VALUES names) -> why.
REFUSED_FIELDS = {
    "functions": "the deprecated form of tools; send tools",
    "function_call": "the deprecated form of tool_choice; send tools and tool_choice",
    "audio": "aserve generates text only",
    "modalities": 'aserve generates text only (modalities ["text"])',
    "prediction": "predicted outputs are not implemented",
    "verbosity": "a model's verbosity cannot be set",
    "web_search_options": "aserve has no web search",
    "moderation": "aserve does no moderation",
    "suffix": "fill-in-the-middle is not implemented",
    "priority": "the server does not use priority scheduling (priority 0 only)",
    "watermarking": "watermarking is not implemented",
    "thinking_token_budget": "a thinking budget is not implemented (-1: unlimited)",
    "logprob_token_ids": "logprobs of chosen token ids are not implemented; use logprobs",
    "repetition_detection": "repetition detection is not implemented",
    "kv_transfer_params": "disaggregated serving (KV transfer) is not implemented",
    "ec_transfer_params": "disaggregated serving (encoder-cache transfer) is not implemented",
    "vllm_xargs": "aserve has no custom extensions to pass arguments to",
    "media_io_kwargs": "aserve takes text only",
    "mm_processor_kwargs": "aserve takes text only",
    "prompt_embeds": "prompt embeddings are not accepted; send text or token ids",
    "return_prompt_text": "the rendered prompt is not returned; /tokenize renders it with return_token_strs",
    "guided_decoding_backend": "structured output always uses xgrammar",
    "guided_whitespace_pattern": "a whitespace pattern is not supported; structured_outputs.disable_any_whitespace "
    "removes whitespace",
}

# Structured output's backend names that mean the one aserve has (the request field, and `aserve serve`'s flags)
STRUCTURED_OUTPUT_BACKENDS = ("xgrammar", "auto")

# Values of refused fields that ask for what aserve does anyway.
ACCEPTED_VALUES = {
    "modalities": (["text"],),
    "priority": (0,),
    "thinking_token_budget": (-1,),
    "guided_decoding_backend": STRUCTURED_OUTPUT_BACKENDS,
}


def asks_for(name: str, value) -> bool:
    """Whether a refused field's value asks for something."""
    if value is None or value is False or value in ("", []):
        return False
    return value not in ACCEPTED_VALUES.get(name, ())


# OpenAI's request fields that may be null, meaning their default (as OpenAI and vLLM read them: clients send null for
# what they leave unset); vLLM's own fields take no null, as in vLLM.
NULLABLE_FIELDS = frozenset({"n", "presence_penalty", "frequency_penalty", "stream", "echo", "logprobs",
                             "parallel_tool_calls"})  # fmt: skip


def null_as_default(request: msgspec.Struct) -> None:
    """Sets each of a request's NULLABLE_FIELDS that came as null to the field's default."""
    for name, default in _nullable_defaults(type(request)):
        if getattr(request, name) is None:
            setattr(request, name, default)


@functools.cache
def _nullable_defaults(request_type: type) -> tuple[tuple[str, object], ...]:
    return tuple((f.name, f.default) for f in msgspec.structs.fields(request_type)
                 if f.name in NULLABLE_FIELDS and f.default not in (None, msgspec.NODEFAULT))  # fmt: skip
