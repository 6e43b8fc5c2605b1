"""A request as the scheduler sees it: tokens known so far and how many of them have KV computed.

There is no prefill or decode phase. A request has `num_tokens` known tokens (prompt + generated) and
`num_computed_tokens` of them in the KV cache; each step the scheduler gives it some of the difference.
When `num_computed_tokens` reaches `num_tokens`, the step samples one more token.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from aserve.core.block_pool import BlockHasher
from aserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from aserve.core.structured_output import GrammarState


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class SampleGroup:
    """The sequences of one request with `n` > 1 (vLLM's ParentRequest, for metrics): the request is done when the
    last of them finishes, and its longest sample is what it generated at most."""

    __slots__ = ("n", "num_unfinished", "max_num_generation_tokens")

    def __init__(self, n: int) -> None:
        self.n = n
        self.num_unfinished = n
        self.max_num_generation_tokens = 0


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        hasher: BlockHasher | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by steps already launched but not yet appended (async scheduling: step N+1 is scheduled
        # while step N runs; the scheduler counts this request's next token as known, its id comes later).
        self.num_inflight = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache; set when first scheduled
        self.num_preemptions = 0
        self.paused = False  # its client stopped reading its stream (Scheduler.set_paused): not scheduled
        # SamplingParams.bad_words as token sequences (the engine tokenises them): the sampler bans their completion
        self.bad_words_token_ids: list[list[int]] = []
        allowed = sampling_params.allowed_token_ids
        self.allowed_token_set = frozenset(allowed) if allowed else None  # every sampled token must be one of these
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        # Chained hashes of the request's full blocks, extended as tokens are appended.
        self.hasher = hasher
        self.block_hashes: list[bytes] = []
        if hasher is not None:
            hasher.extend(self.block_hashes, self.all_token_ids)

        # Speculative decoding: drafts to verify in the next step (and, from a draft model, the distributions they
        # were sampled from), and the running acceptance counts of the adaptive policy.
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs = None
        self.spec_accepted = 0.0
        self.spec_trials = 0.0
        self.spec_follow_index = None  # n-gram speculation: aserve/spec/ngram.py FollowIndex, made when first needed

        # The request's own random stream when it has a seed (created by the sampler on its device).
        self.generator: torch.Generator | None = None

        # Prompt logprobs, when asked for: one entry per prompt token after the first, gathered chunk by chunk;
        # reported with the first generated token.
        self.prompt_logprobs: list | None = [] if sampling_params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False

        # Structured output: the sequence's grammar (compiled, then matched), set by the engine; None: unconstrained.
        self.grammar: GrammarState | None = None

        # Timestamps (monotonic) for metrics, and the request's other samples when it is one of n.
        self.sample_group: SampleGroup | None = None
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.hasher is not None and self.num_tokens % self.hasher.block_size == 0:
            self.hasher.extend(self.block_hashes, self.all_token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
