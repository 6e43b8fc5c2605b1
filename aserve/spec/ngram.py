"""Prompt-lookup (n-gram) drafts: find the most recent earlier occurrence of the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it. Costs no model time;
pays when outputs copy their context (quoting, editing, code).

FollowIndex tells the scheduler, before a step samples a request's next token, that no proposal can follow that
token whatever it is (its last prompt_lookup_min - 1 tokens occur nowhere earlier): such a step asks for no drafts,
so with async scheduling the next step is launched behind it instead of after its result reaches the host.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_WINDOW = 4096  # search only the last tokens: bounds the cost per step


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    if k <= 0 or len(token_ids) <= n_min:
        return []
    tokens = np.asarray(token_ids[-_WINDOW:], dtype=np.int64)
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[-n:]
        # Candidate starts exclude the suffix itself; the match must be followed by at least one token.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        hits = hits[hits + n < length]
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class FollowIndex:
    """The m-grams (m = prompt_lookup_min - 1) of a growing sequence that end before its last token, counted over
    the last _WINDOW positions. `could_propose(tokens)`: False only where propose_ngram(tokens + [x], ...) is empty
    for every x: each pattern it tries (n >= m + 1 tokens) ends with the sequence's last m tokens followed by x, so a
    match needs those m tokens at an earlier place. Kept per request and fed the same list as it grows; the count
    covers a window at least as wide as propose_ngram's (so it never rules out a proposal it would find)."""

    def __init__(self, m: int) -> None:
        assert m >= 1, "with prompt_lookup_min 1 any next token may match: nothing to rule out"
        self.m = m
        self.counts: dict = {}
        # The m-grams ending at positions first .. ends - 1 are counted: those before the last token, in the window.
        self.first = self.ends = m - 1

    def _key(self, tokens: list[int], end: int):
        return tokens[end] if self.m == 1 else tuple(tokens[end - self.m + 1 : end + 1])

    def could_propose(self, tokens: list[int]) -> bool:
        last = len(tokens) - 1
        start = max(self.ends, last - _WINDOW)  # a long prompt: only its last _WINDOW positions are ever counted
        if start > self.ends:
            self.counts.clear()
            self.first = start
        for end in range(start, last):  # every m-gram ending before the last token, once
            key = self._key(tokens, end)
            self.counts[key] = self.counts.get(key, 0) + 1
        for end in range(self.first, last - _WINDOW):  # those that left the window
            old = self._key(tokens, end)
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old]
        self.first = max(self.first, last - _WINDOW)
        self.ends = max(self.ends, last)
        return last >= self.m - 1 and self._key(tokens, last) in self.counts
