"""Requests from a JSONL file: one object per line with "prompt" (text or token ids) and optional "max_tokens"."""

from __future__ import annotations

import math
from collections.abc import Iterator

import msgspec
import numpy as np

from loadgen.workloads.base import PromptMaker, RequestSpec, Session, Workload
from loadgen.workloads.lengths import LengthDist


class _Line(msgspec.Struct):
    prompt: str | list[int]
    max_tokens: int | None = None


class FileWorkload(Workload):
    """The file's requests in order, starting again from the top when the run needs more. Lines without max_tokens
    get a draw from --output-len."""

    name = "file"

    def __init__(self, path: str, maker: PromptMaker, output_len: LengthDist) -> None:
        self.path, self.maker, self.output_len = path, maker, output_len
        self.lines = read_jsonl(path)

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        while True:
            for line in self.lines:
                max_tokens = line.max_tokens if line.max_tokens is not None else self.output_len.sample(rng, 1)[0]
                if isinstance(line.prompt, list):
                    prompt_tokens = len(line.prompt)
                else:
                    prompt_tokens = math.ceil(len(line.prompt.split()) * self.maker.tokens_per_word)
                yield Session([RequestSpec(prompt=line.prompt, max_tokens=max_tokens, prompt_tokens=prompt_tokens)])

    def describe(self) -> str:
        return f"file ({self.path}, {len(self.lines)} requests)"


def read_jsonl(path: str) -> list[_Line]:
    lines = []
    decoder = msgspec.json.Decoder(_Line)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = decoder.decode(raw)
            except msgspec.DecodeError as e:  # ValidationError is a DecodeError
                raise ValueError(f'{path}:{number}: {e} (expected {{"prompt": ..., "max_tokens": N}})') from e
            if line.max_tokens is not None and line.max_tokens < 1:
                raise ValueError(f"{path}:{number}: max_tokens must be >= 1")
            if not line.prompt:
                raise ValueError(f"{path}:{number}: empty prompt")
            lines.append(line)
    if not lines:
        raise ValueError(f"{path}: no requests in the file")
    return lines
