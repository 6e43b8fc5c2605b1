"""Between the engine core and its front ends (LLM, AsyncEngine): per-sequence token updates in, RequestOutputs out.

The core knows sequences; a client request has `n` of them. Here each request's state gathers its sequences' tokens,
turns them into text (incremental detokenizing), finds stop strings, shapes logprobs and builds outputs: deltas for
streams, one cumulative output at the end for the offline API.

Some endings start here and must reach the core: a stop string found in the text (the sequence stops), a fault while
processing a sequence's output, or a sequence ended by an error (its siblings fail with it: the whole request fails).
`process` returns those as a `Finishes` for the front end to hand to `EngineCore.finish_requests`; the outputs the
core then reports for them change nothing here (those sequences are finished already).

Text grows token by token (IncrementalDetokenizer), in one of two ways chosen once per tokenizer (`TokenBytes.build`):

- The token-bytes table: with byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) a token's text is a fixed byte string
  whatever surrounds it, so a sequence's text is its tokens' bytes run through one incremental UTF-8 decoder: a table
  lookup and a few bytes decoded per token, with text held back while a character's bytes are incomplete. The table
  is checked against the tokenizer's own `decode` on sample text and every added token before it is used.
- tokenizers' DecodeStream for any other decoder (SentencePiece-style "▁" and byte fallback among them), or where
  the check fails. Both take about 1 us per token on valid text; the table also stays that fast on ids the
  tokenizer does not know (DecodeStream raises and restarts on each: ~11 us).
  With byte fallback (<0xNN> tokens), the tokenizer decodes a run of byte tokens as a whole: valid UTF-8 gives its
  characters, anything else one U+FFFD per byte, so a late byte can turn characters already decoded into U+FFFD.
  Such a run is therefore held back until the token after it (or the end of the sequence) and stepped with that
  token, so that the text is the tokenizer's `decode` of the whole output. Where DecodeStream still finds the text
  before its window changed ("Invalid prefix"), a new stream, primed with the ids of the last text, decodes the same
  ids again (vLLM's recovery), so that no text is lost.

Stop strings are searched in the newly grown tail; a matched stop string is cut from the text. While a request runs,
the last `len(longest stop) - 1` characters are held back from streaming, so a stop string that is still forming
never leaks to a client.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from aserve.core.outputs import EngineCoreOutput, SampledLogprobs
from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.sampling_params import SamplingParams

logger = logging.getLogger("aserve")

_PRIME_TOKENS = 6  # prompt tokens fed to the decoder first, so the first output token decodes in context
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # what tokenizers' ByteFallback decoder reads as one byte
_CHECK_TEXT = (
    "Grüße aus Köln! 日本語のテキスト, emoji 🙂👍🏽, tabs\tand\nnew lines, numbers 3.14159 and code `x += 1;` "
    "Ελληνικά, русский, العربية, हिन्दी."
)


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """Each token id's bytes, two tables: special tokens kept, and special tokens as b"" (skip_special_tokens)."""

    def __init__(self, keep: list[bytes], skip: list[bytes]) -> None:
        self.keep = keep
        self.skip = skip

    @classmethod
    def build(cls, tokenizer) -> TokenBytes | None:
        """The table for a fast (Rust-backed) HF tokenizer, or None where its text is not a fixed function of each
        token (DecodeStream is used then)."""
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            return None
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
        except Exception:
            return None
        if decoder.get("type") != "ByteLevel":
            return None
        added = backend.get_added_tokens_decoder()
        byte_map = _byte_level_map()
        keep, skip = [], []
        for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
            # Added tokens go through the decoder like any other (tokenizers decodes them the same way).
            token = backend.id_to_token(token_id)
            if token is None:
                data = b""
            else:  # a character outside the alphabet stands for itself
                data = b"".join(bytes([byte_map[c]]) if c in byte_map else c.encode() for c in token)
            keep.append(data)
            skip.append(b"" if token_id in added and added[token_id].special else data)
        table = cls(keep, skip)
        return table if table._agrees_with(backend) else None

    def _agrees_with(self, backend) -> bool:
        """The table gives the tokenizer's own decode on sample text and on every added token, after a context
        token, both special-token settings."""
        ids = backend.encode(_CHECK_TEXT, add_special_tokens=False).ids
        context = backend.encode("The", add_special_tokens=False).ids[:1]
        added = sorted(backend.get_added_tokens_decoder())
        samples = [ids, ids + added + ids]
        for skip in (True, False):
            table = self.skip if skip else self.keep
            head = backend.decode(context, skip_special_tokens=skip)
            for sample in samples:
                expected = backend.decode(context + sample, skip_special_tokens=skip)
                got = head + b"".join(table[t] for t in sample).decode("utf-8", "replace")
                if got != expected:
                    return False
        return True


def byte_fallback_ids(tokenizer, skip_special_tokens: bool) -> frozenset[int]:
    """Where a fast HF tokenizer's decoder has ByteFallback: the ids that continue a run of byte tokens (<0xNN>), which
    are the byte tokens and, where they are skipped, the special tokens (the bytes on both sides of one join). Else
    empty."""
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        decoder = backend.decoder.__getstate__()  # the decoder's JSON
    except Exception:
        return frozenset()
    if b'"ByteFallback"' not in decoder:
        return frozenset()
    ids = {i for token, i in backend.get_vocab(with_added_tokens=True).items() if _BYTE_TOKEN.fullmatch(token)}
    if ids and skip_special_tokens:
        ids.update(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return frozenset(ids)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop_strings: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        token_bytes: TokenBytes | None = None,
        byte_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`byte_ids`: the ids that continue a run of byte tokens (`byte_fallback_ids`), for DecodeStream."""
        self.stop_strings = stop_strings
        self.include_stop_str_in_output = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text = ""
        self._pending: list[int] = []  # byte tokens held back (DecodeStream with byte fallback)
        self._unsent: list[int] = []  # ids in the stream that gave no text yet
        if token_bytes is not None:
            self._table = token_bytes.skip if skip_special_tokens else token_bytes.keep
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._step = self._step_table
            for token_id in prompt_token_ids[-_PRIME_TOKENS:]:
                self._step(token_id)
        else:
            self._backend = tokenizer._tokenizer  # the Rust tokenizers.Tokenizer behind a fast HF tokenizer
            self._skip_special_tokens = skip_special_tokens
            self._byte_ids = byte_ids
            self._step = self._step_stream
            # the prompt's last tokens up to its last one that is not a byte token (a byte run at the end of the
            # prompt would otherwise join the output's first bytes)
            end = len(prompt_token_ids)
            while end > 0 and prompt_token_ids[end - 1] in byte_ids:
                end -= 1
            self._context: int | list[int] = prompt_token_ids[max(0, end - _PRIME_TOKENS) : end]  # the last text's ids
            self._stream = self._new_stream(self._context)

    def _new_stream(self, context: int | list[int]) -> DecodeStream:
        """A DecodeStream whose next text follows the text of `context` (spacing as in the whole sequence)."""
        stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        context = [context] if isinstance(context, int) else context
        if context:
            try:
                primed = stream.step(self._backend, context)
            except Exception:
                primed = None
            if primed is None:
                text = self._backend.decode(context, skip_special_tokens=self._skip_special_tokens)
                if text.endswith("\ufffd"):  # the context's text is not complete: it would leak into the next text
                    stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return stream

    def _step_table(self, token_id: int) -> str:
        table = self._table
        return self._utf8.decode(table[token_id]) if 0 <= token_id < len(table) else ""

    def _step_stream(self, token_id: int) -> str:
        if token_id in self._byte_ids:  # a byte run decodes as a whole: held until the token after it
            self._pending.append(token_id)
            return ""
        ids: int | list[int] = token_id
        if self._pending:
            ids, self._pending = [*self._pending, token_id], []
        try:
            text = self._stream.step(self._backend, ids)
        except Exception as e:
            return self._step_again(ids, e)
        if text is None:
            self._unsent += [ids] if isinstance(ids, int) else ids
            return ""
        if self._unsent:
            self._unsent = []
        self._context = ids
        return text

    def _step_again(self, ids: int | list[int], error: Exception) -> str:
        """After DecodeStream raised: "Invalid prefix" (the text before its window changed) restarts the stream after
        the last text and decodes the same ids again; an id the tokenizer cannot decode (e.g. a padded vocab entry) is
        dropped, with the stream restarted."""
        invalid_prefix = "Invalid prefix" in str(error)
        self._stream = self._new_stream(self._context if invalid_prefix else [])
        self._unsent = []
        if not invalid_prefix:
            return ""
        try:
            text = self._stream.step(self._backend, ids)
        except Exception:
            self._stream = self._new_stream([])
            return ""
        if text is None:
            self._unsent = [ids] if isinstance(ids, int) else list(ids)
            return ""
        self._context = ids
        return text

    def add_token(self, token_id: int) -> str | None:
        """Appends one token's text. Returns the stop string it completed, if any (the text is then cut)."""
        return self._append(self._step(token_id))

    def flush(self) -> str | None:
        """At the end of the sequence: appends the text of byte tokens still held back, as the tokenizer's `decode`
        gives it (U+FFFD for each byte of an invalid run). Returns the stop string it completed, if any."""
        if not self._pending and not self._unsent:
            return None
        pending, self._pending = self._pending, []
        text = None
        if pending:
            try:
                text = self._stream.step(self._backend, pending)
            except Exception:
                pass
        if text is None:  # the text ends inside a character: no later token makes it valid
            text = self._backend.decode(self._unsent + pending, skip_special_tokens=self._skip_special_tokens)
        self._unsent = []
        return self._append(text)

    def _append(self, new_text: str) -> str | None:
        if not new_text:
            return None
        self.text += new_text
        if not self.stop_strings:
            return None
        search_from = len(self.text) - len(new_text)
        matches = []
        for stop in self.stop_strings:
            idx = self.text.find(stop, max(0, search_from - len(stop) + 1))
            if idx != -1:
                matches.append((idx, stop))
        if not matches:
            return None
        idx, stop = min(matches, key=lambda m: m[0])
        self.text = self.text[: idx + len(stop)] if self.include_stop_str_in_output else self.text[:idx]
        return stop

    def streamable_len(self, finished: bool) -> int:
        """How much of `text` may be sent to a client now."""
        if finished or not self.stop_strings:
            return len(self.text)
        return max(0, len(self.text) - self.holdback)


@dataclass(eq=False)
class RequestState:
    """One client request: its sequences (ids in the core), their text and tokens, and what was reported so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequence_ids: list[str]
    detokenizers: list[IncrementalDetokenizer]
    delta: bool  # stream deltas (AsyncEngine) or report once, cumulatively, when finished (LLM.generate)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)
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
        return all(reason is not None for reason in self.finish_reasons)


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

    def add_request(self, request_id, prompt, prompt_token_ids, params, sequence_ids, delta: bool) -> None:
        detokenizers = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.stop_strings,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
                self.token_bytes,
                self.byte_ids[params.skip_special_tokens],
            )
            for _ in sequence_ids
        ]
        n = len(sequence_ids)
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, list(sequence_ids), detokenizers, delta,
            token_ids=[[] for _ in range(n)], logprobs=[[] for _ in range(n)], finish_reasons=[None] * n,
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
            out = self._finalize(state) if state.finished else (self._make_output(state) if state.delta else None)
            if out is not None:
                outputs.append(out)
        return outputs, finishes

    def _absorb(self, state: RequestState, index: int, out: EngineCoreOutput, finishes: Finishes) -> None:
        if index == 0:
            state.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:  # every sequence scores the prompt
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
            known.update(zip(missing, self.tokenizer.batch_decode([[t] for t in missing])))
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
        for i, detok in enumerate(state.detokenizers):
            finished = state.finish_reasons[i] is not None
            text_end = detok.streamable_len(finished)
            n_tokens = len(state.token_ids[i])
            if state.delta:
                unchanged = text_end == state.sent_text[i] and n_tokens == state.sent_tokens[i]
                if unchanged and (not finished or state.finish_sent[i]):
                    continue
                text = detok.text[state.sent_text[i] : text_end]
                token_ids = state.token_ids[i][state.sent_tokens[i] :]
                logprobs = state.logprobs[i][state.sent_tokens[i] :] if want_logprobs else None
            else:
                text, token_ids = detok.text[:text_end], list(state.token_ids[i])
                logprobs = state.logprobs[i] if want_logprobs else None
            state.sent_text[i], state.sent_tokens[i] = text_end, n_tokens
            state.finish_sent[i] = finished
            reason = state.finish_reasons[i]
            completions.append(CompletionOutput(i, text, token_ids, reason, state.stop_reasons[i], logprobs))
        if not completions:
            return None
        prompt_logprobs = state.prompt_logprobs
        if state.delta:  # a stream reports them once, with the first output that has them
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = prompt_logprobs is not None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            error=state.error,
            prompt_logprobs=prompt_logprobs,
        )
