"""OpenAI request fields that aserve does not implement, each decided once: accepted without effect (none of them
changes the output; vLLM ignores them too) or refused with a 400 naming the field whenever it asks for something.
Every other field of the request types (protocol.py) is implemented; their check_unsupported refuses these."""

from __future__ import annotations

# Accepted and ignored: what they ask for is OpenAI's bookkeeping, billing or routing, never the output.
IGNORED_FIELDS = {
    "user": "an end-user id for abuse monitoring",
    "safety_identifier": "an end-user id for abuse monitoring",
    "store": "OpenAI's stored completions",
    "metadata": "tags for stored completions",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "OpenAI's prompt-cache routing (aserve's prefix cache needs no key)",
    "prompt_cache_retention": "OpenAI's prompt-cache lifetime",
    "prompt_cache_options": "OpenAI's prompt-cache breakpoints",
}

# Refused when they ask for something (any value but null, false, "", [] or modalities ["text"]) -> why.
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
    "use_beam_search": "beam search is not implemented",
}
