"""Prompts, in vLLM's shapes (`vllm.inputs`): a string, a TextPrompt `{"prompt": text}` or a TokensPrompt
`{"prompt_token_ids": [...]}`, either dict with an optional `cache_salt` (the request's prefix-cache salt, as
SamplingParams.cache_salt).

aserve serves text: vLLM's multimodal keys (multi_modal_data, mm_processor_kwargs, multi_modal_uuids), prompt
embeddings, cross-encoder token type ids and encoder/decoder prompts are refused by name, as is any other key, so that
nothing a prompt asks for is dropped unseen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NotRequired, TypedDict

from aserve.sampling_params import ParamError, SamplingParams


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids spell, reported as the output's prompt
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt

_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
# vLLM's prompt keys for what aserve does not serve -> why
_REFUSED_KEYS = {
    "multi_modal_data": "aserve serves text only (a vision-language checkpoint runs as its language model)",
    "mm_processor_kwargs": "aserve serves text only: there is no multimodal processor",
    "multi_modal_uuids": "aserve serves text only: there are no multimodal items",
    "prompt_embeds": "aserve takes text or token ids, not embeddings",
    "token_type_ids": "token type ids are for cross-encoder (scoring) models; aserve serves generative models",
    "encoder_prompt": "aserve serves decoder-only models: pass the prompt itself",
    "decoder_prompt": "aserve serves decoder-only models: pass the prompt itself",
}


@dataclass(slots=True)
class ParsedPrompt:
    text: str | None  # the prompt's text (a TokensPrompt's only if it gives one)
    token_ids: list[int] | None  # None: the text is still to be tokenised
    cache_salt: str | None = None


def parse_prompt(prompt: PromptType) -> ParsedPrompt:
    """A prompt as given -> its parts. ParamError (a ValueError) names a key aserve does not take; TypeError for what
    is not a prompt at all."""
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if not isinstance(prompt, dict):
        raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids' or 'prompt', got {type(prompt)}")
    for key in prompt:
        if key in _REFUSED_KEYS:
            raise ParamError("prompt", f"the prompt's {key!r} is not supported: {_REFUSED_KEYS[key]}")
        if key not in _KEYS:
            raise ParamError("prompt", f"unknown prompt key {key!r}: a prompt dict takes {', '.join(_KEYS)}")
    text, salt = prompt.get("prompt"), prompt.get("cache_salt")
    if text is not None and not isinstance(text, str):
        raise ParamError("prompt", f"the prompt's 'prompt' must be a string, got {type(text).__name__}")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ParamError("cache_salt", f"the prompt's 'cache_salt' must be a non-empty string, got {salt!r}")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise ParamError("prompt", f"prompt_token_ids must be a list, got {type(ids).__name__}")
        return ParsedPrompt(text, list(ids), salt)
    if text is None:
        raise ParamError("prompt", "a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    return ParsedPrompt(text, None, salt)


def with_prompt_salt(params: SamplingParams, salt: str | None) -> SamplingParams:
    """The request's parameters with its prompt's cache_salt (vLLM's place for it) as their cache_salt; a salt that
    differs from one the parameters already carry is refused."""
    if salt is None or salt == params.cache_salt:
        return params
    if params.cache_salt is not None:
        raise ParamError("cache_salt", f"the prompt's cache_salt {salt!r} differs from SamplingParams.cache_salt "
                         f"{params.cache_salt!r}: give one")  # fmt: skip
    return params.clone(cache_salt=salt)
