"""Grounded generation: ask the model to repeat, or lightly edit, a passage given in the prompt. Most of the output
is already in the prompt, which is what n-gram (prompt-lookup) speculative decoding exploits."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from loadgen.workloads.base import PromptMaker, RequestSpec, Session, Workload
from loadgen.workloads.corpus import SENTENCE_STARTS, VOCABULARY, WORDS
from loadgen.workloads.lengths import LengthDist

_REPEAT = "Repeat the following passage exactly, word for word. Write nothing else."
_REPLACE = 'Copy the following passage, but replace every "{old}" with "{new}". Write nothing else.'
_FIX = (
    "The following passage has a few spelling mistakes. Write it out again with the mistakes corrected and "
    "nothing else changed."
)


class GroundedWorkload(Workload):
    """Passages of --input-len tokens cut from the built-in corpus at sentence starts, with one of three tasks:
    repeat verbatim, replace one word everywhere, or fix a few injected typos. Without --output-len, max_tokens is
    the passage length plus 25 % (the model should stop by itself, so EOS is not ignored by default)."""

    name = "grounded"

    def __init__(self, maker: PromptMaker, passage_len: LengthDist, output_len: LengthDist | None) -> None:
        if maker.prompt_format != "text":
            raise ValueError("the grounded workload needs text prompts (--prompt-format text)")
        self.maker, self.passage_len, self.output_len = maker, passage_len, output_len

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        while True:
            (n_tokens,) = self.passage_len.sample(rng, 1)
            passage = self._passage(rng, self.maker.num_words(n_tokens))
            task = int(rng.integers(0, 3))
            if task == 0:
                instruction = _REPEAT
            elif task == 1:
                candidates = sorted({w for w in passage if w.isalpha() and len(w) > 3})
                old = candidates[int(rng.integers(0, len(candidates)))] if candidates else passage[0]
                new = VOCABULARY[int(rng.integers(0, len(VOCABULARY)))]
                instruction = _REPLACE.format(old=old, new=new)
            else:
                instruction = _FIX
                passage = _with_typos(rng, passage)
            prompt = f"{instruction}\n\nPassage:\n{' '.join(passage)}"
            prompt_tokens = math.ceil(len(prompt.split()) * self.maker.tokens_per_word)
            if self.output_len is not None:
                (max_tokens,) = self.output_len.sample(rng, 1)
            else:
                max_tokens = math.ceil(1.25 * len(passage) * self.maker.tokens_per_word) + 16
            yield Session([RequestSpec(prompt=prompt, max_tokens=max_tokens, prompt_tokens=prompt_tokens)])

    @staticmethod
    def _passage(rng: np.random.Generator, num_words: int) -> list[str]:
        start = SENTENCE_STARTS[int(rng.integers(0, len(SENTENCE_STARTS)))]
        return [WORDS[(start + i) % len(WORDS)] for i in range(num_words)]  # wraps round for long passages

    def describe(self) -> str:
        out = "auto" if self.output_len is None else self.output_len.describe()
        return f"grounded (passages of {self.passage_len.describe()} tokens, output {out})"


def _with_typos(rng: np.random.Generator, words: list[str]) -> list[str]:
    """Swaps two inner letters in about one word in twenty (at least one), only in plain words of 5+ letters."""
    out = list(words)
    eligible = [i for i, w in enumerate(out) if w.isalpha() and len(w) >= 5]
    if not eligible:
        return out
    count = max(1, len(eligible) // 20)
    for i in rng.choice(eligible, size=min(count, len(eligible)), replace=False):
        w = out[i]
        j = int(rng.integers(1, len(w) - 2))
        out[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return out
