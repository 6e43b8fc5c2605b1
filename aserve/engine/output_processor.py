"""Between the engine core and its front ends (LLM, AsyncEngine): per-sequence token updates in, RequestOutputs out.

The core knows sequences; a client request has `n` of them. Here each request's state gathers its sequences' tokens,
turns them into text (incremental detokenizing), finds stop strings, shapes logprobs and builds outputs as the
request's RequestOutputKind asks: the whole output so far after every step that changed it (CUMULATIVE), what is new
since the last output (DELTA: the server's streams, slicing only the new text), or one output at the end (FINAL_ONLY:
LLM.generate).

Some endings start here and must reach the core: a stop string found in the text (the sequence stops), a fault while
processing a sequence's output, or a sequence ended by an error (its siblings fail with it: the whole request fails).
`process` returns those as a `Finishes` for the front end to hand to `EngineCore.finish_requests`; the outputs the
core then reports for them change nothing here (those sequences are finished already).

Text grows token by token through aserve/engine/detokenizer.py (IncrementalDetokenizer).

Stop strings are searched in the newly grown tail; a matched stop string is cut from the text. While a request runs,
the last `len(longest stop) - 1` characters are held back from streaming, so a stop string that is still forming
never leaks to a client.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from aserve.core.outputs import EngineCoreOutput, SampledLogprobs
from aserve.engine.detokenizer import (
    IncrementalDetokenizer,
    NoText,
    TokenBytes,
    byte_fallback_ids,
    single_token_decoder,
)
from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY

logger = logging.getLogger("aserve")


@dataclass(eq=False)
class RequestState:
    """One client request: its sequences (ids in the core), their text and tokens, and what was reported so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequence_ids: list[str]
    detokenizers: list[IncrementalDetokenizer | NoText]
    output_kind: RequestOutputKind
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)
    cumulative_logprobs: list[float] = field(default_factory=list)  # per sequence: the sum of its tokens' logprobs
    finish_reasons: list[str | None] = field(default_factory=list)
    stop_reasons: list[int | str | None] = field(default_factory=list)
    sent_text: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    finish_sent: list[bool] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None
    # vLLM's shape: None for the first prompt token, then {token_id: Logprob} per prompt token (once the core sent them)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return None not in self.finish_reasons


@dataclass(slots=True)
class Finishes:
    """Sequences the core must end: stopped by a stop string, or failed (with the reason)."""

    stopped: list[str] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)  # error -> sequence ids

    def __bool__(self) -> bool:
        return bool(self.stopped or self.failed)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes.build(tokenizer)
        # by skip_special_tokens: the ids that continue a byte run (DecodeStream only)
        self.byte_ids = {
            skip: frozenset() if self.token_bytes else byte_fallback_ids(tokenizer, skip) for skip in (False, True)
        }
        self.states: dict[str, RequestState] = {}
        self.sequence_to_state: dict[str, tuple[RequestState, int]] = {}
        # each token's text alone (logprobs' decoded_token), decoded once per id: a request asking for 20 top
        # logprobs would otherwise decode 21 tokens per generated token
        self.token_texts: dict[int, str] = {}
        self._decode_each = single_token_decoder(tokenizer)
        self._added_tokens: dict[int, str] | None = None  # id -> content, built when a request first needs it

    def _joined_added_tokens(self, params: SamplingParams) -> dict[int, str] | None:
        """What IncrementalDetokenizer needs for spaces_between_special_tokens off: only where special tokens are kept
        and text goes through DecodeStream (byte-level BPE puts no spaces between tokens)."""
        if params.spaces_between_special_tokens or params.skip_special_tokens or self.token_bytes is not None:
            return None
        if self._added_tokens is None:
            decoder = self.tokenizer._tokenizer.get_added_tokens_decoder()
            self._added_tokens = {token_id: token.content for token_id, token in decoder.items()}
        return self._added_tokens

    def add_request(self, request_id, prompt, prompt_token_ids, params, sequence_ids,
                    output_kind: RequestOutputKind) -> None:  # fmt: skip
        detokenizers = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
                self.token_bytes,
                self.byte_ids[params.skip_special_tokens],
                params.min_tokens,
                self._joined_added_tokens(params),
            )
            if params.detokenize
            else NoText()
            for _ in sequence_ids
        ]
        n = len(sequence_ids)
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, list(sequence_ids), detokenizers, output_kind,
            token_ids=[[] for _ in range(n)], logprobs=[[] for _ in range(n)], cumulative_logprobs=[0.0] * n,
            finish_reasons=[None] * n,
            stop_reasons=[None] * n, sent_text=[0] * n, sent_tokens=[0] * n, finish_sent=[False] * n,
        )  # fmt: skip
        self.states[request_id] = state
        for i, sequence_id in enumerate(sequence_ids):
            self.sequence_to_state[sequence_id] = (state, i)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def live_sequence_ids(self, request_id: str, error: str | None = None) -> list[str]:
        """The request's sequences that have not finished (for an abort); `error`: why the server ends it."""
        state = self.states.get(request_id)
        if state is None:
            return []
        if error is not None:
            state.error = error
        return [s for s, reason in zip(state.sequence_ids, state.finish_reasons) if reason is None]

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], Finishes]:
        finishes = Finishes()
        changed: dict[int, RequestState] = {}
        for out in core_outputs:
            entry = self.sequence_to_state.get(out.request_id)
            if entry is None:
                continue
            state, index = entry
            if state.finish_reasons[index] is not None:
                continue  # ended here already (a stop string, a sibling's failure)
            changed[id(state)] = state
            try:
                self._absorb(state, index, out, finishes)
            except Exception as e:  # a fault in one request's output (detokenizer, bad token) ends only that request
                logger.exception("processing the output of request %s failed; ending it", state.request_id)
                self._fail(state, f"internal error while processing the output: {type(e).__name__}", finishes)
        outputs = []
        for state in changed.values():
            if state.finished:
                out = self._finalize(state)
            else:
                out = self._make_output(state) if state.output_kind is not FINAL_ONLY else None
            if out is not None:
                outputs.append(out)
        return outputs, finishes

    def _absorb(self, state: RequestState, index: int, out: EngineCoreOutput, finishes: Finishes) -> None:
        if index == 0:
            state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:  # (the first sequence scores it)
            state.prompt_logprobs = [None] + [self._logprob_dict(lp) for lp in out.prompt_logprobs]
        detok = state.detokenizers[index]
        # The stop token (EOS or one of stop_token_ids) that ends a sequence is no text, as in vLLM, even where
        # special tokens are kept (skip_special_tokens false); include_stop_str_in_output keeps it.
        ended = out.finish_reason is not None
        last_is_stop = out.finish_reason == "stop" and not state.params.include_stop_str_in_output
        last = len(out.new_token_ids) - 1
        for i, token_id in enumerate(out.new_token_ids):
            stop = None if last_is_stop and i == last else detok.add_token(token_id)
            state.token_ids[index].append(token_id)
            if out.new_logprobs is not None:
                state.logprobs[index].append(self._logprob_dict(out.new_logprobs[i]))
                state.cumulative_logprobs[index] += out.new_logprobs[i].logprobs[0]  # the sampled token's
            if stop is not None:  # tokens after it (accepted drafts) are dropped
                state.finish_reasons[index], state.stop_reasons[index] = "stop", stop
                if not ended:
                    finishes.stopped.append(out.request_id)
                return
        if ended:
            if out.error is not None:
                self._fail(state, out.error, finishes)
            elif (stop := detok.flush()) is not None:  # text held back to the end completed a stop string
                state.finish_reasons[index], state.stop_reasons[index] = "stop", stop
            else:
                state.finish_reasons[index], state.stop_reasons[index] = out.finish_reason, out.stop_reason

    def _fail(self, state: RequestState, error: str, finishes: Finishes) -> None:
        """Ends every sequence of a request with finish_reason "error" (siblings included: the whole request fails);
        the next output reports `error`."""
        state.error = error
        for sequence_id, reason in zip(state.sequence_ids, state.finish_reasons):
            if reason is None:
                finishes.failed.setdefault(error, []).append(sequence_id)
        state.finish_reasons = ["error" if r is None else r for r in state.finish_reasons]

    def _logprob_dict(self, lp: SampledLogprobs) -> dict[int, Logprob]:
        known = self.token_texts
        missing = [t for t in lp.token_ids if t not in known]
        if missing:
            known.update(zip(missing, self._decode_each(missing)))
        texts = [known[t] for t in lp.token_ids]
        out = {lp.token_ids[0]: Logprob(lp.logprobs[0], lp.sampled_rank, texts[0])}
        for rank, (tid, value, text) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:], texts[1:]), start=1):
            out.setdefault(tid, Logprob(value, rank, text))
        return out

    def _finalize(self, state: RequestState) -> RequestOutput | None:
        if self.states.pop(state.request_id, None) is None:
            return None  # already reported
        for sequence_id in state.sequence_ids:
            self.sequence_to_state.pop(sequence_id, None)
        return self._make_output(state)

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        completions = []
        want_logprobs = state.params.logprobs is not None
        delta = state.output_kind is DELTA
        finished_all = state.finished
        # a running request's cumulative output is a copy: the next step's must not change it
        copy = state.output_kind is CUMULATIVE and not finished_all
        finish_reasons, sent_text, sent_tokens = state.finish_reasons, state.sent_text, state.sent_tokens
        for i, detok in enumerate(state.detokenizers):
            finish_reason = finish_reasons[i]
            finished = finish_reason is not None
            text_end = detok.streamable_len(finished)
            seq_tokens = state.token_ids[i]
            n_tokens = len(seq_tokens)
            if delta:
                sent = sent_tokens[i]
                if text_end == sent_text[i] and n_tokens == sent and (not finished or state.finish_sent[i]):
                    continue
                text = detok.text[sent_text[i] : text_end]
                token_ids = seq_tokens[sent:]
                logprobs = state.logprobs[i][sent:] if want_logprobs else None
            else:
                text, token_ids = detok.text[:text_end], list(seq_tokens)
                logprobs = (list(state.logprobs[i]) if copy else state.logprobs[i]) if want_logprobs else None
            sent_text[i], sent_tokens[i] = text_end, n_tokens
            state.finish_sent[i] = finished
            cumulative = state.cumulative_logprobs[i] if want_logprobs else None  # of all its tokens (as vLLM)
            completions.append(CompletionOutput(i, text, token_ids, cumulative, logprobs, finish_reason,
                                                state.stop_reasons[i]))  # fmt: skip
        if not completions:
            return None
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:  # a stream of deltas reports them once, with the first output
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, prompt_logprobs, completions,
                             finished_all, num_cached_tokens=state.num_cached_tokens, error=state.error)  # fmt: skip
