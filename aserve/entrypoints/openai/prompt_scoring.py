"""Scoring prompts over the OpenAI API: completions' `echo` (the prompt first in the choice's text and, with
`logprobs`, its tokens' logprobs first in the legacy logprobs object, the first token's null), `max_tokens: 0` with
echo (score only: the one token generated is dropped, as vLLM does), and vLLM's `prompt_logprobs` field in responses.
This is what lm-evaluation-harness sends for log-likelihood tasks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aserve.outputs import CompletionOutput, Logprob

if TYPE_CHECKING:
    from aserve.entrypoints.openai.responses import ChoiceState


def first_token_entry(token_id: int, text: str) -> dict[int, Logprob]:
    """The placeholder entry of a prompt's first token (nothing precedes it): rank 0, reported as nulls."""
    return {token_id: Logprob(float("nan"), 0, text)}


class Echo:
    """One choice's echo: before its first output, the prompt's text (and, with logprobs, its token entries) go
    first; with score_only, generated tokens are dropped (the finish reason stays)."""

    __slots__ = ("text", "token_ids", "first_token_text", "score_only", "done")

    def __init__(self, text: str, token_ids: list[int], first_token_text: str, score_only: bool) -> None:
        self.text, self.token_ids, self.first_token_text = text, token_ids, first_token_text
        self.score_only = score_only
        self.done = False

    def apply(self, choice: ChoiceState, comp: CompletionOutput) -> CompletionOutput:
        if not self.done:
            self.done = True
            choice.text += self.text
            choice.delta_text += self.text
            if choice.want_logprobs:
                assert choice.prompt_logprobs is not None, "echo with logprobs scores the prompt"
                entries = [first_token_entry(self.token_ids[0], self.first_token_text)] + choice.prompt_logprobs[1:]
                choice.token_ids += self.token_ids
                choice.delta_token_ids += self.token_ids
                choice.logprobs += entries
                choice.delta_logprobs += entries
        if self.score_only:
            return CompletionOutput(comp.index, "", [], finish_reason=comp.finish_reason, stop_reason=comp.stop_reason)
        return comp


async def make_echoes(engine, choices: list[ChoiceState], n: int, prompts, score_only: bool) -> None:
    """Gives each choice its prompt's Echo (choice index = prompt index * n + sample index); `prompts` as the
    handler holds them: (text or None for token ids, ids, params)."""
    for i, (text, ids, _) in enumerate(prompts):
        if text is None:
            text = await engine.detokenize(ids)
        first = await engine.detokenize(ids[:1])
        for j in range(n):
            choices[i * n + j].echo = Echo(text, ids, first, score_only)


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's shape: None for the first token, then {token id: {logprob, rank, decoded_token}} per prompt token."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def add_prompt_logprobs(body: dict, choices: list[ChoiceState], chat: bool) -> None:
    """vLLM's `prompt_logprobs` field, once per choice, as soon as known: in each completions choice, at the top of a
    chat response (or chunk). `choices`: those `body["choices"]` was built from, in order."""
    for choice, out in zip(choices, body["choices"]):
        if choice.prompt_logprobs is None or choice.prompt_logprobs_sent:
            continue
        choice.prompt_logprobs_sent = True
        value = prompt_logprobs_json(choice.prompt_logprobs)
        if chat:
            body["prompt_logprobs"] = value
        else:
            out["prompt_logprobs"] = value
