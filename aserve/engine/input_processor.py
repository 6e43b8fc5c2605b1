"""Prompts and sampling parameters in, validated engine requests out: tokenising, the checks that need the model
(context length, vocabulary), and the `n` fan-out into one sequence per sample (siblings share the prompt's KV
blocks through their block hashes)."""

from __future__ import annotations

import time

from aserve.core.block_pool import BlockHasher
from aserve.core.request import Request
from aserve.engine.config import EngineConfig
from aserve.sampling_params import ParamError, SamplingParams

PromptType = str | dict


class InputProcessor:
    def __init__(self, config: EngineConfig) -> None:
        self.tokenizer = config.tokenizer
        self.max_model_len = config.max_model_len
        self.vocab_size = config.vocab_size
        self.block_size = config.block_size
        self.eos_token_id = config.eos_token_id
        self.enable_prefix_caching = config.args.enable_prefix_caching

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """-> (the prompt's text if it has one, its token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids' or 'prompt', got {type(prompt)}")

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ParamError("prompt", "the prompt is empty")
        if n > self.max_model_len:
            raise ParamError(
                "prompt",
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has {n} "
                "tokens. Please reduce the length of the prompt.",
                code="context_length_exceeded",
            )
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ParamError("prompt", f"prompt token id {bad!r} is out of range [0, {self.vocab_size})")

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: values the step would fail on (which would end every
        request batched with this one)."""
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ParamError("logprobs", f"logprobs must be <= the vocabulary size ({self.vocab_size})")
        if params.seed is not None and not -(2**63) <= params.seed <= 2**63 - params.n:  # sibling i uses seed + i
            raise ParamError("seed", "seed must be a 64-bit signed integer")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ParamError("logit_bias", f"logit_bias token ids must be < the vocabulary size ({self.vocab_size})")

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        max_tokens_must_fit: bool = False,
    ) -> tuple[SamplingParams, list[Request]]:
        """Validates a tokenised request (ParamError) and makes its sequences: one Request per sample, ids
        `request_id` (n = 1) or `request_id#i`. max_tokens_must_fit (the OpenAI server's rule): prompt + max_tokens
        beyond max_model_len is an error rather than a request that ends at the context length.
        -> (the parameters with max_tokens resolved, the sequences)."""
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        n = len(prompt_token_ids)
        if max_tokens_must_fit and params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ParamError(
                "max_tokens",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.",
                code="context_length_exceeded",
            )
        if params.max_tokens is None:
            params = params.clone(max_tokens=max(1, self.max_model_len - len(prompt_token_ids)))
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if self.enable_prefix_caching:
            hasher = BlockHasher(self.block_size, params.cache_salt)
        elif params.n > 1:  # siblings still share the prompt's blocks, with nobody else
            hasher = BlockHasher(self.block_size, f"group:{id(params)}:{request_id}")
        else:
            hasher = None
        if params.n == 1:
            return params, [Request(request_id, prompt_token_ids, params, self.eos_token_id, hasher, arrival_time)]
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child_params = params.clone(n=1, seed=seed)
            child_id = f"{request_id}#{i}"
            children.append(Request(child_id, prompt_token_ids, child_params, self.eos_token_id, hasher, arrival_time))
        return params, children
