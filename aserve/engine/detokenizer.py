"""Token ids -> text, one token at a time, for streams.

Two ways, chosen once per tokenizer (`TokenBytes.build`):

- The token-bytes table: with byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) a token's text is a fixed byte string
  whatever surrounds it, so a sequence's text is its tokens' bytes run through one incremental UTF-8 decoder: a table
  lookup and a few bytes decoded per token, with text held back while a character's bytes are incomplete. The table
  is checked against the tokenizer's own `decode` on sample text and every added token before it is used.
- tokenizers' DecodeStream for any other decoder (SentencePiece-style "▁" and byte fallback among them), or where
  the check fails. Both take about 1 us per token on valid text; the table also stays that fast on ids the
  tokenizer does not know (DecodeStream raises and restarts on each: ~11 us).

Stop strings are searched in the newly grown tail; a matched stop string is cut from the text. While a request runs,
the last `len(longest stop) - 1` characters are held back from streaming, so a stop string that is still forming
never leaks to a client.
"""

from __future__ import annotations

import codecs
import json

from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 6  # prompt tokens fed to the decoder first, so the first output token decodes in context
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


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop_strings: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        token_bytes: TokenBytes | None = None,
    ) -> None:
        self.stop_strings = stop_strings
        self.include_stop_str_in_output = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text = ""
        if token_bytes is not None:
            self._table = token_bytes.skip if skip_special_tokens else token_bytes.keep
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._step = self._step_table
        else:
            self._backend = tokenizer._tokenizer  # the Rust tokenizers.Tokenizer behind a fast HF tokenizer
            self._skip_special_tokens = skip_special_tokens
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            self._step = self._step_stream
        for token_id in prompt_token_ids[-_PRIME_TOKENS:]:
            self._step(token_id)

    def _step_table(self, token_id: int) -> str:
        table = self._table
        return self._utf8.decode(table[token_id]) if 0 <= token_id < len(table) else ""

    def _step_stream(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception:
            # An id the tokenizer cannot decode (e.g. a padded vocab entry): drop it and restart the stream.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return ""

    def add_token(self, token_id: int) -> str | None:
        """Appends one token's text. Returns the stop string it completed, if any (the text is then cut)."""
        new_text = self._step(token_id)
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
