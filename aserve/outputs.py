"""What generate() returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One entry per generated token: {token_id: Logprob} holding the sampled token and the top-n alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs (with logprobs asked for)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request ended because of an internal error
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: Logprob} for each other
    # (the prompt token and the top alternatives)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
