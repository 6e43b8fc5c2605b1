"""One token budget per step, no prefill/decode phases (vLLM v1's model).

Each step: running requests first (in arrival order), then waiting ones FCFS, each given up to
`num_tokens - num_computed_tokens` tokens from the shared budget (plus, with async scheduling, the token a step still
running will sample: see `Request.num_inflight`). A prompt longer than what is left (or than
`long_prefill_token_threshold`, when set) is chunked; the rest comes in later steps, mixed with other requests'
decodes. With a prompt cap (`--max-decode-slowdown`), a step that decodes takes only so many prompt tokens.
When the pool runs out of blocks, the newest running request is preempted: its blocks are freed and it is
recomputed later (prefix caching usually makes that cheap).
A waiting request with structured output is skipped until its grammar is compiled (vLLM's WAITING_FOR_FSM); one
whose grammar failed to compile ends with an error (its output waits in `take_outputs()`).
A paused request (`set_paused`: the server's stream for it stopped being read) is not scheduled, running or waiting,
and keeps its place and blocks until they are wanted: a running request short of blocks, or a waiting one short of
blocks or of a sequence slot, preempts paused requests first.

The scheduler owns every change to a request's state: `schedule()` hands out tokens, `update_from_output()` applies
a step's result (tokens appended, drafts accepted, in-flight counts, EOS / stop-token / length finishes, faulty
outputs), `finish_request()` ends one from outside (abort, stop string, error). Each of them tells `stats`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from aserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.metrics import EngineStats
from aserve.core.outputs import NO_ALLOWED_TOKEN, EngineCoreOutput, RunnerOutput
from aserve.core.request import Request, RequestStatus
from aserve.core.scheduler_invariants import check_queues
from aserve.spec.ngram import FollowIndex, propose_ngram

NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or infinity) for this request"


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    # The request's live block-id lists, one per group of layers (aserve/core/kv_cache_groups.py; no per-step
    # copy): valid until the next schedule() allocates.
    block_ids: tuple[list[int], ...]
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified in this step (the last query tokens)
    num_draft_next: int = 0  # drafts to propose after this step (the speculative policy's choice)
    # Does this step produce a new token for the request (is its last known token computed)?
    samples: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    scores_prompt: bool = False  # does a scheduled chunk score prompt tokens (a request asking for prompt logprobs)?

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def verifies(self) -> bool:
        """Does the step verify drafts (how many tokens it adds is known only once it ran)?"""
        return any(s.spec_token_ids for s in self.scheduled)

    @property
    def drafts_next(self) -> bool:
        """Does a request ask for drafts after this step (they follow the token it samples)?"""
        return any(s.num_draft_next for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager | HybridKVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        spec_policy=None,
        vocab_size: int | None = None,
        stats: EngineStats | None = None,
        long_prefill_token_threshold: int = 0,
        prompt_cap=None,
    ) -> None:
        self.kv = kv_cache_manager
        self.prompt_cap = prompt_cap  # PromptCap: prompt tokens beside decodes (aserve/core/prompt_cap.py), or None
        # A request computes at most this many tokens per step (0: no limit but the budget)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.spec_policy = spec_policy  # None: no speculative decoding
        self.vocab_size = vocab_size  # sampled ids at or past it end their request with an error
        self.stats = stats if stats is not None else EngineStats()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_paused = 0  # live requests with `paused` set
        self.num_with_grammar = 0  # live requests with structured output
        self._outputs: list[EngineCoreOutput] = []  # endings found outside a step's update (a grammar that failed)

    # -- queue management -------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.num_with_grammar += request.grammar is not None

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request wherever it is (abort, stop string) and frees its blocks. Unknown ids are ignored."""
        assert status.finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        if request.paused:
            request.paused = False
            self.num_paused -= 1
        if request.grammar is not None:
            request.grammar.free()
            self.num_with_grammar -= 1
        self.stats.on_request_finished(request, time.monotonic())
        return request

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def set_paused(self, request_ids, paused: bool) -> None:
        """Pauses (or resumes) live requests: a paused one is not scheduled until resumed. Unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and request.paused != paused:
                request.paused = paused
                self.num_paused += 1 if paused else -1

    def all_paused(self) -> bool:
        """Is every live request paused (and at least one live)?"""
        return 0 < len(self.requests) == self.num_paused

    # -- the step --------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.spec_policy is not None:
            self.spec_policy.begin_step()
        # Prompt chunks and recomputation beside decodes, where capped (aserve/core/prompt_cap.py); None: no cap
        prompt_cap, live = self.prompt_cap, len(self.requests)
        prompt_budget = prompt_cap.step_budget(self.running, self._length_reached, live) if prompt_cap else None

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.paused or (request.num_inflight and self._length_reached(request, request.num_inflight)):
                i += 1  # paused, or its in-flight token is its last: nothing more to compute
                continue
            # Known tokens not yet computed, then the drafts to verify; never past max_model_len.
            num_new = (
                request.num_tokens + request.num_inflight + len(request.spec_token_ids) - request.num_computed_tokens
            )
            capped = prompt_budget is not None and num_new > 1 + len(request.spec_token_ids)  # prompt work, capped
            if capped and prompt_budget == 0:
                i += 1  # no prompt tokens left in this step
                continue
            step_budget = min(budget, prompt_budget) if capped else budget
            num_new = min(self._chunk(num_new), step_budget, self.max_model_len - request.num_computed_tokens)
            assert num_new > 0, f"{request} has nothing to compute"
            k_next, lookahead = self._drafts_next(request, num_new)
            while self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead) is None:
                victim, i = self._pop_victim(i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # preempted itself: everything after it already was
            self._schedule(out, request, num_new, k_next)
            budget -= num_new
            if capped:
                prompt_budget -= num_new
            i += 1

        now = time.monotonic()
        skipped: list[Request] = []  # paused, or waiting for their grammar: skipped, keeping their place in the queue
        # Admitting new work right after a preemption would just preempt again.
        if prompt_budget is not None:
            budget = min(budget, prompt_budget)  # all a waiting request computes is prompt work
        while not out.preempted and self.waiting and budget > 0:
            request = self.waiting[0]
            if request.paused:
                skipped.append(self.waiting.popleft())
                continue
            if len(self.running) >= self.max_num_seqs:
                if self._preempt_paused():
                    continue  # its sequence slot is free: try again
                break
            if request.num_inflight:
                break  # preempted while its last step ran: re-admitted once that step's token is in
            if request.grammar is not None and not request.grammar.start():
                if request.grammar.error is not None:
                    self._outputs.append(self._fail(request, request.grammar.error))
                else:
                    skipped.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit = [], 0
            # Prompt logprobs need the logits of every prompt position: no prefix-cache hits for those requests.
            if request.num_computed_tokens == 0 and request.prompt_logprobs is None:
                hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(self._chunk(request.num_tokens - request.num_computed_tokens - num_hit), budget)
            k_next, lookahead = self._drafts_next(request, num_hit + num_new)
            if self.kv.allocate_slots(request, num_new, hit_blocks, num_lookahead_tokens=lookahead) is None:
                if self._preempt_paused():
                    continue  # its blocks are free: try again
                break
            self.waiting.popleft()
            request.num_computed_tokens += num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.scheduled_time is None:
                request.scheduled_time = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(out, request, num_new, k_next)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return out

    def _newest_paused(self) -> int | None:
        """The index in `running` of the newest paused request, if any."""
        if self.num_paused:
            for j in range(len(self.running) - 1, -1, -1):
                if self.running[j].paused:
                    return j
        return None

    def _pop_victim(self, i: int) -> tuple[Request, int]:
        """Takes the request to preempt so that running[i] gets blocks out of `running`: the newest paused one, else
        the newest. -> (it, the index of running[i] after its removal)."""
        j = self._newest_paused()
        if j is None:
            return self.running.pop(), i
        return self.running.pop(j), (i - 1 if j < i else i)

    def _preempt_paused(self) -> bool:
        """Preempts the newest paused running request (its blocks or sequence slot are wanted). -> was there one?"""
        j = self._newest_paused()
        if j is not None:
            self._preempt(self.running.pop(j))
        return j is not None

    def _chunk(self, num_new: int) -> int:
        """A long prompt's share of one step: at most long_prefill_token_threshold tokens (when set)."""
        threshold = self.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new else num_new

    def take_outputs(self) -> list[EngineCoreOutput]:
        """Endings found by schedule() rather than by a step (a request whose grammar did not compile)."""
        outputs, self._outputs = self._outputs, []
        return outputs

    def waiting_for_grammars(self) -> list[Request]:
        return [r for r in self.waiting if r.grammar is not None and not r.grammar.future.done()]

    def _length_reached(self, request: Request, extra: int = 0) -> bool:
        """Has the request (with `extra` more tokens: those in flight) reached max_tokens or max_model_len?"""
        max_tokens = request.sampling_params.max_tokens
        return (max_tokens is not None and request.num_output_tokens + extra >= max_tokens) or (
            request.num_tokens + extra >= self.max_model_len
        )

    def _drafts_next(self, request: Request, num_new: int) -> tuple[int, int]:
        """-> (drafts to propose after this step, KV lookahead slots to allocate for drafting them)."""
        if self.spec_policy is None or request.num_computed_tokens + num_new < request.num_tokens:
            return 0, 0  # mid-prompt: nothing to draft from yet
        k = self.spec_policy.num_drafts(request, len(self.running))
        # Verifying k drafts computes positions up to (computed + new) + k (layer_skip's drafting writes KV there
        # too): stay inside max_model_len.
        k = max(0, min(k, self.max_model_len - (request.num_computed_tokens + num_new) - 1))
        if k and self._no_ngram_can_follow(request, num_new):
            return 0, 0
        return k, self.spec_policy.config.lookahead_slots(k)

    def _no_ngram_can_follow(self, request: Request, num_new: int) -> bool:
        """n-gram speculation, a step that computes every known token of the request and verifies nothing (so it
        adds exactly one token): True where no proposal can follow that token (FollowIndex). The step then asks for
        no drafts and the next one may be launched behind it."""
        cfg = self.spec_policy.config
        if cfg.method != "ngram" or cfg.prompt_lookup_min < 2 or request.num_inflight or request.spec_token_ids:
            return False
        if request.num_computed_tokens + num_new != request.num_tokens:
            return False
        if request.spec_follow_index is None:
            request.spec_follow_index = FollowIndex(cfg.prompt_lookup_min - 1)
        return not request.spec_follow_index.could_propose(request.all_token_ids)

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int, k_next: int) -> None:
        known = request.num_tokens + request.num_inflight
        end = request.num_computed_tokens + num_new
        num_drafts = max(0, end - known)
        samples = end >= known
        out.scheduled.append(
            ScheduledRequest(
                request,
                request.num_computed_tokens,
                num_new,
                self.kv.get_block_ids(request.request_id),
                request.spec_token_ids[:num_drafts],
                k_next,
                samples,
            )
        )
        if request.prompt_logprobs is not None and request.num_computed_tokens < request.num_prompt_tokens - 1:
            out.scores_prompt = True
        request.num_computed_tokens = end
        if samples:
            request.num_inflight += 1  # until the engine appends the token (process) or the step is rolled back

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.spec_token_ids, request.spec_draft_probs = [], None
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the step --------------------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Applies a finished step: for each request that sampled, its in-flight token lands, accepted drafts and the
        sampled token are appended (up to a stop condition), the next step's drafts are set. A request whose logits
        were not finite (its KV may hold NaNs too: dropped from the prefix cache), or whose token lies outside the
        vocabulary, ends with an error instead. Requests aborted while the step ran are skipped. -> what changed for
        each request the step advanced or ended."""
        now = time.monotonic()
        sampler = result.sampler_output
        n = len(result.sampled)
        drafts = result.next_drafts or [None] * n
        draft_probs = result.next_draft_probs or [None] * n
        nonfinite = sampler.nonfinite or [False] * n
        for s, first, entries in result.prompt_logprobs:
            self._add_prompt_logprobs(s.request, first, entries)
        outputs = []
        for s, token_ids, lps, next_drafts, probs, bad in zip(
            result.sampled, sampler.token_ids, sampler.logprobs, drafts, draft_probs, nonfinite
        ):
            request = s.request
            request.num_inflight -= 1
            if request.is_finished:  # aborted while the step ran (or finished by the step before it)
                continue
            if bad:  # its tokens are argmaxes of garbage (in the vocabulary all the same): use none of them
                self.stats.on_corrupted()
                outputs.append(self._fail(request, NON_FINITE_LOGITS, forget_kv=True))
                continue
            if s.spec_token_ids:
                self._accept_drafts(s, len(token_ids) - 1)
            appended, error = self._append_tokens(request, token_ids, now)
            if error is not None:
                outputs.append(self._fail(request, error, new_token_ids=appended))
                continue
            if not request.is_finished and s.num_draft_next > 0:
                self._set_drafts(request, s.num_draft_next, next_drafts, probs)
            outputs.append(self._output(request, appended, lps[: len(appended)] if lps is not None else None))
            if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                outputs[-1].prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        return outputs

    @staticmethod
    def _add_prompt_logprobs(request: Request, first: int, entries: list) -> None:
        """Entries for prompt tokens first, first + 1, ...; those already held (a chunk recomputed after a preemption)
        are skipped."""
        have = len(request.prompt_logprobs) + 1  # index of the next prompt token to score (token 0 has none)
        if first <= have:
            request.prompt_logprobs.extend(entries[have - first :])

    def _append_tokens(self, request: Request, token_ids: list[int], now: float) -> tuple[list[int], str | None]:
        """Appends a step's tokens until one finishes the request. -> (the tokens appended, an error for a token id
        outside the vocabulary: e.g. from NaN logits; fed back as input it would fail every later step of its
        batch)."""
        appended = []
        for token_id in token_ids:
            if self.vocab_size is not None and not 0 <= token_id < self.vocab_size:
                return appended, f"internal error: the model produced token id {token_id}, outside the vocabulary"
            # A token outside the request's grammar or allowed_token_ids is sampled only from a row its constraints
            # masked whole (the sampler masks the rest): the request's own doing.
            if request.grammar is not None and not request.grammar.accept(token_id):
                return appended, NO_ALLOWED_TOKEN
            if request.allowed_token_set is not None and token_id not in request.allowed_token_set:
                return appended, NO_ALLOWED_TOKEN
            self.stats.on_token(request, now)
            appended.append(token_id)
            if self._append_token(request, token_id):
                break
        return appended, None

    def _append_token(self, request: Request, token_id: int) -> bool:
        """Adds a sampled token; finishes the request (freeing its blocks) if a stop condition is met.
        Returns whether it finished."""
        request.append_token(token_id)
        params = request.sampling_params
        status = None
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                status = RequestStatus.FINISHED_STOPPED
            elif token_id in params.stop_token_ids:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        if status is None and request.grammar is not None and request.grammar.terminated:
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete and took its stop token
        if status is None and self._length_reached(request):
            status = RequestStatus.FINISHED_LENGTH
        if status is None:
            return False
        self.finish_request(request.request_id, status)
        return True

    def _accept_drafts(self, scheduled: ScheduledRequest, num_accepted: int) -> None:
        """After verification: KV past the accepted drafts is garbage, so those positions count as uncomputed
        again (the blocks stay with the request). The drafts are spent."""
        request = scheduled.request
        num_drafted = len(scheduled.spec_token_ids)
        request.num_computed_tokens -= num_drafted - num_accepted
        request.spec_token_ids, request.spec_draft_probs = [], None
        self.stats.on_drafts(num_drafted, num_accepted)
        if self.spec_policy is not None:
            self.spec_policy.observe(request, num_drafted, num_accepted)

    def _set_drafts(self, request: Request, k: int, model_drafts, model_probs) -> None:
        """Drafts for the next step: from the model drafter (computed in the step), or n-gram lookup here."""
        if model_drafts is not None:
            request.spec_token_ids, request.spec_draft_probs = model_drafts[:k], model_probs
        else:
            cfg = self.spec_policy.config
            request.spec_token_ids = propose_ngram(
                request.all_token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max
            )
            if not request.spec_token_ids and self.spec_policy.empty_is_rejection:
                self.spec_policy.observe(request, 1, 0)

    def _fail(self, request: Request, error: str, forget_kv: bool = False, new_token_ids=()) -> EngineCoreOutput:
        if forget_kv:
            self.kv.forget_uncomputed(request, 0)
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        return self._output(request, list(new_token_ids), None, error)

    @staticmethod
    def _output(request: Request, new_token_ids, new_logprobs, error: str | None = None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request.request_id,
            new_token_ids,
            new_logprobs,
            request.status.finish_reason,
            request.stop_reason,
            error,
            max(0, request.num_cached_tokens),
        )

    def fail_requests(self, request_ids, error: str) -> list[EngineCoreOutput]:
        """Ends live requests with an error (a failed step, a fault in their output)."""
        return [self._fail(r, error) for rid in request_ids if (r := self.requests.get(rid)) is not None]

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list:
        """Ends live requests from outside (a client gone, a stop string found in the text). -> their outputs."""
        return [self._output(r, [], None) for rid in request_ids if (r := self.finish_request(rid, status)) is not None]

    def rollback_failed_step(self, out: SchedulerOutput) -> None:
        """The model step for `out` failed: nothing it scheduled was computed."""
        for s in out.scheduled:
            if s.samples:
                s.request.num_inflight -= 1
            if s.request.status == RequestStatus.RUNNING:
                s.request.num_computed_tokens = s.num_computed_tokens
                self.kv.forget_uncomputed(s.request, s.num_computed_tokens)

    def check_invariants(self) -> None:
        """For `debug_invariants`: raises InvariantError where the queues or the KV manager are inconsistent."""
        check_queues(self)
