"""vLLM's `sharegpt` benchmark dataset from a local file (--dataset-path; aserve downloads nothing): a JSON list of
conversations, `[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}, ...]`.
Each request is a conversation's first turn, asking for as many tokens as its second turn has (or a fixed
--output-len); conversations are shuffled by --seed, and those vLLM would skip (a prompt or reply under 4 tokens, a
prompt over 1024, both over 2048) are skipped."""

from __future__ import annotations

import json
import random

from loadgen.workloads import RequestSpec

_MIN_LEN, _MAX_PROMPT_LEN, _MAX_TOTAL_LEN = 4, 1024, 2048


def read_sharegpt(path: str, seed: int, shuffle: bool = True) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with two turns or more, shuffled unless `shuffle` is False."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"--dataset-path {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path {path}: not JSON ({e}); the sharegpt dataset is a JSON list") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: the sharegpt dataset is a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no conversation with two turns")
    if shuffle:
        random.Random(seed).shuffle(pairs)
    return pairs


class ShareGPTSampler:
    """Takes conversations offered in order, with their token counts, until it has `num_requests` usable ones."""

    def __init__(self, num_requests: int, output_len: int | None) -> None:
        self.num_requests, self.output_len = num_requests, output_len
        self.specs: list[RequestSpec] = []

    @property
    def done(self) -> bool:
        return len(self.specs) >= self.num_requests

    def offer(self, prompt: str, prompt_len: int, completion_len: int) -> None:
        output_len = completion_len if self.output_len is None else self.output_len
        too_short = prompt_len < _MIN_LEN or (self.output_len is None and output_len < _MIN_LEN)
        if too_short or prompt_len > _MAX_PROMPT_LEN or prompt_len + output_len > _MAX_TOTAL_LEN:
            return
        self.specs.append(RequestSpec(prompt=prompt, max_tokens=output_len, prompt_tokens=prompt_len))
