"""Synthetic workloads: independent random prompts, and prompts behind a few shared system prompts."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from loadgen.workloads.base import PromptMaker, RequestSpec, Session, Workload
from loadgen.workloads.lengths import LengthDist


class RandomWorkload(Workload):
    """Prompts of random tokens (ids) or random words (text): nothing is shared, so no prefix-cache hits."""

    name = "random"

    def __init__(self, maker: PromptMaker, input_len: LengthDist, output_len: LengthDist) -> None:
        self.maker, self.input_len, self.output_len = maker, input_len, output_len

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        while True:
            (n_in,), (n_out,) = self.input_len.sample(rng, 1), self.output_len.sample(rng, 1)
            spec = RequestSpec(prompt=self.maker.random(rng, n_in), max_tokens=n_out, prompt_tokens=n_in)
            yield Session([spec])

    def describe(self) -> str:
        return f"random (input {self.input_len.describe()}, output {self.output_len.describe()})"


class SharedPrefixWorkload(Workload):
    """K system prompts of P tokens, each request one of them (uniformly) + a unique suffix: what prefix caching is
    for. With K prefixes and N requests, an ideal cache computes each prefix once: hit rate -> P(N-K) / N(P+S)."""

    name = "shared-prefix"

    def __init__(
        self, maker: PromptMaker, num_prefixes: int, prefix_len: int, suffix_len: LengthDist, output_len: LengthDist
    ) -> None:
        if num_prefixes < 1 or prefix_len < 1:
            raise ValueError("--num-prefixes and --prefix-len must be >= 1")
        self.maker, self.num_prefixes, self.prefix_len = maker, num_prefixes, prefix_len
        self.suffix_len, self.output_len = suffix_len, output_len

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        prefixes = [self.maker.random(rng, self.prefix_len) for _ in range(self.num_prefixes)]
        while True:
            k = int(rng.integers(0, self.num_prefixes))
            (n_in,), (n_out,) = self.suffix_len.sample(rng, 1), self.output_len.sample(rng, 1)
            prompt = self.maker.join(prefixes[k], self.maker.random(rng, n_in))
            yield Session([RequestSpec(prompt=prompt, max_tokens=n_out, prompt_tokens=self.prefix_len + n_in)])

    def describe(self) -> str:
        return (
            f"shared-prefix ({self.num_prefixes} prefixes of {self.prefix_len} tokens, suffix "
            f"{self.suffix_len.describe()}, output {self.output_len.describe()})"
        )
