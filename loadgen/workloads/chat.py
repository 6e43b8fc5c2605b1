"""Multi-turn conversations: every turn resends the growing history, so turn k's prompt contains turns 1..k-1."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from loadgen.workloads.base import PromptMaker, RequestSpec, Session, Workload
from loadgen.workloads.lengths import LengthDist


class ChatWorkload(Workload):
    """Conversations of `num_turns` user messages of --input-len tokens each. The runner sends turn k+1 after the
    reply to turn k, with the model's real replies in the history (so reply lengths compound as in real chats)."""

    name = "chat"

    def __init__(self, maker: PromptMaker, num_turns: int, input_len: LengthDist, output_len: LengthDist) -> None:
        if maker.prompt_format != "text":
            raise ValueError("the chat workload needs text prompts (--prompt-format text)")
        if num_turns < 1:
            raise ValueError("--num-turns must be >= 1")
        self.maker, self.num_turns, self.input_len, self.output_len = maker, num_turns, input_len, output_len

    def sessions(self, rng: np.random.Generator) -> Iterator[Session]:
        while True:
            turns, history_tokens = [], 0
            for _ in range(self.num_turns):
                (n_in,), (n_out,) = self.input_len.sample(rng, 1), self.output_len.sample(rng, 1)
                message = self.maker.random(rng, n_in)
                # An estimate: earlier replies are counted at their max_tokens until the server reports usage.
                turns.append(RequestSpec(prompt=message, max_tokens=n_out, prompt_tokens=history_tokens + n_in))
                history_tokens += n_in + n_out
            yield Session(turns, multi_turn=True)

    def describe(self) -> str:
        return (
            f"chat ({self.num_turns} turns, user messages {self.input_len.describe()}, replies "
            f"{self.output_len.describe()})"
        )
