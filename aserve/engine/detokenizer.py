"""Token ids to text for aserve/engine/output_processor.py.

A sequence's text grows token by token (IncrementalDetokenizer), in one of two ways chosen once per tokenizer
(`TokenBytes.build`):

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

With spaces_between_special_tokens off (and special tokens kept), an added token right after another is its content
alone, without the space some decoders (WordPiece's) put between tokens: vLLM's rule. Byte-level BPE puts none, so
only DecodeStream needs it.

Logprobs name each candidate token by its text alone (`single_token_decoder`).
"""

from __future__ import annotations

import codecs
import json
import logging
import re

from tokenizers.decoders import DecodeStream

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
        min_tokens: int = 0,
        joined_added_tokens: dict[int, str] | None = None,
    ) -> None:
        """`byte_ids`: the ids that continue a run of byte tokens (`byte_fallback_ids`), for DecodeStream.
        `min_tokens`: no stop string ends within the text of the first min_tokens tokens (as vLLM).
        `joined_added_tokens` (spaces_between_special_tokens off): added token id -> its content, each written as
        that alone right after another added token."""
        self.stop_strings = stop_strings
        self._joined = joined_added_tokens
        self._last_added = False
        self.min_tokens = min_tokens
        self.num_tokens = 0
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
        self.num_tokens += 1
        text = self._step(token_id)
        if self._joined is not None:
            content = self._joined.get(token_id)
            if content is not None and self._last_added:
                text = content
            self._last_added = content is not None
        return self._append(text)

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
        if not self.stop_strings or self.num_tokens <= self.min_tokens:
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


class NoText:
    """The detokenizer of a sequence with SamplingParams(detokenize=False): token ids only, no text."""

    text = ""

    def add_token(self, token_id: int) -> None:
        return None

    def flush(self) -> None:
        return None

    def streamable_len(self, finished: bool) -> int:
        return 0


def single_token_decoder(tokenizer):
    """ids -> each id's text alone, as tokenizer.batch_decode([[id] for id in ids]) gives it: through a fast
    tokenizer's Rust decode, one id at a time (decode_batch's thread pool costs more than it saves on the 21 ids of
    a token with 20 top logprobs), with transformers' clean-up of spaces where the tokenizer applies it. 21 ids:
    15 us against 61 through batch_decode (SmolLM2's tokenizer, 2-core VM)."""
    backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizers.Tokenizer, as above
    if backend is None:
        return lambda ids: tokenizer.batch_decode([[t] for t in ids])
    decode = backend.decode
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        clean = tokenizer.clean_up_tokenization
        return lambda ids: [clean(decode([t], skip_special_tokens=False)) for t in ids]
    return lambda ids: [decode([t], skip_special_tokens=False) for t in ids]
