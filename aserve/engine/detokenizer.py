"""Incremental detokenization with stop strings.

Text grows token by token (tokenizers' DecodeStream: a token that ends inside a multi-byte character yields text
only once the character is complete). Stop strings are searched in the newly grown tail; a matched stop string is
cut from the text. While a request runs, the last `len(longest stop) - 1` characters are held back from streaming,
so a stop string that is still forming never leaks to a client.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 6  # prompt tokens fed to the stream first, so the first output token decodes in context


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop_strings: list[str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
    ) -> None:
        self._backend = tokenizer._tokenizer  # the Rust tokenizers.Tokenizer behind a fast HF tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._prime(prompt_token_ids[-_PRIME_TOKENS:])
        self.stop_strings = stop_strings
        self.include_stop_str_in_output = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text = ""

    def _prime(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            self._step(token_id)

    def _step(self, token_id: int) -> str:
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
