"""What a workload produces (sessions of request specs) and how synthetic prompts are made."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import msgspec
import numpy as np

from loadgen.workloads.corpus import VOCABULARY


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    prompt: str | list[int]  # text or token ids; in a multi-turn session, this turn's user message
    max_tokens: int
    prompt_tokens: int  # the workload's count (estimated for text); the server's usage wins when it reports one


class Session(msgspec.Struct, frozen=True):
    """Requests sent one after another by one user. One turn for most workloads; a chat conversation resends the
    history (earlier user messages and the model's actual replies) with every turn."""

    turns: list[RequestSpec]
    multi_turn: bool = False


class PromptMaker:
    """Random prompts of a given token length. Text is words from the built-in vocabulary; `tokens_per_word` (measured
    against the server's /tokenize when it has one, else 1.0) converts a token budget into a word count."""

    def __init__(self, prompt_format: str = "text", vocab_size: int = 32000, tokens_per_word: float = 1.0) -> None:
        assert prompt_format in ("text", "ids") and tokens_per_word > 0
        self.prompt_format = prompt_format
        self.vocab_size = vocab_size
        self.tokens_per_word = tokens_per_word

    def num_words(self, num_tokens: int) -> int:
        return max(1, round(num_tokens / self.tokens_per_word))

    def random(self, rng: np.random.Generator, num_tokens: int) -> str | list[int]:
        if self.prompt_format == "ids":
            return [int(t) for t in rng.integers(0, self.vocab_size, size=num_tokens)]
        picks = rng.integers(0, len(VOCABULARY), size=self.num_words(num_tokens))
        return " ".join(VOCABULARY[i] for i in picks)

    @staticmethod
    def join(a: str | list[int], b: str | list[int]) -> str | list[int]:
        if isinstance(a, list):
            return a + b
        return f"{a}\n\n{b}"


class Workload(ABC):
    """An endless, seed-determined stream of sessions; the runner takes as many as the run needs."""

    name: str

    @abstractmethod
    def sessions(self, rng: np.random.Generator) -> Iterator[Session]: ...

    def describe(self) -> str:
        return self.name
