"""Prompt-lookup (n-gram) drafts: find the most recent earlier occurrence of the sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it. Costs no model time;
pays when outputs copy their context (quoting, editing, code)."""

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
