"""What flows out of a step: the sampler's tokens (SamplerOutput), the model runner's result (RunnerOutput), and what
the step changed for each sequence (EngineCoreOutput), which the output processor turns into client outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aserve.core.scheduler import ScheduledRequest


@dataclass(slots=True)
class SampledLogprobs:
    """For one emitted token: the ids and logprobs of the token (first) and the top-n alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int

    @staticmethod
    def of(token: int, logprob: float, rank: int, top_ids: list[int], top_logprobs: list[float], n: int):
        """The entry a request asking for `n` logprobs gets (top_ids/top_logprobs: at least n, best first)."""
        return SampledLogprobs([token] + top_ids[:n], [logprob] + top_logprobs[:n], rank)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[list[int]]  # per request: accepted drafts, then one sampled token
    logprobs: list[list[SampledLogprobs] | None]
    num_drafts: list[int]
    # Per request: whether any of its logits rows held NaN or infinity (its tokens are meaningless). Empty: unknown.
    nonfinite: list[bool] = field(default_factory=list)

    @staticmethod
    def empty() -> SamplerOutput:
        return SamplerOutput([], [], [])


@dataclass(slots=True)
class RunnerOutput:
    """Tokens of the requests that sample this step (in `SchedulerOutput.scheduled` order): accepted drafts plus
    one sampled token each; and, from a model drafter, the drafts to verify next step."""

    sampled: list[ScheduledRequest]
    sampler_output: SamplerOutput
    next_drafts: list[list[int]] | None = None
    next_draft_probs: list | None = None
    # Requests asking for prompt logprobs whose chunk scored prompt tokens: (request, index of the first prompt
    # token scored, one entry per token scored), in any order; sampling or not.
    prompt_logprobs: list[tuple[ScheduledRequest, int, list[SampledLogprobs]]] = field(default_factory=list)


# A request's own constraints leave it no token to sample: the engine ends it with this error, which the server
# reports as the client's (HTTP 400), not as an internal fault.
NO_ALLOWED_TOKEN = (
    "no token satisfies every constraint of the request: its grammar (structured output), allowed_token_ids and "
    "bad_words leave nothing to generate (a grammar whose language is empty or never ends, or constraints that "
    "exclude each other)"
)
CLIENT_ERRORS = frozenset({NO_ALLOWED_TOKEN})


@dataclass(slots=True)
class EngineCoreOutput:
    """What a step (or an abort) changed for one sequence: the tokens it gained, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[SampledLogprobs] | None = None  # one per new token, where the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it (stop strings: the output processor's)
    error: str | None = None  # why the engine ended it, for finish_reason "error"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With the first new token of a request asking for prompt logprobs: one entry per prompt token after the first.
    prompt_logprobs: list[SampledLogprobs] | None = None
