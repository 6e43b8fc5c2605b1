"""Beam search, as vLLM runs it (`LLM.beam_search(prompts, BeamSearchParams(...))`, the servers' `use_beam_search`):
on top of the engine, one token per step. Each step runs every live beam of every prompt as a one-token request
asking for 2 x beam_width logprobs (transformers' candidate count); each candidate extends its beam by its logprob; a
candidate that is the end-of-sequence token completes its beam (unless ignore_eos); the beam_width best of the rest
go on. After max_tokens steps (or once no beam is left) the completed beams and those still going are ranked by
cum_logprob / length ** length_penalty and the beam_width best returned. The prefix cache keeps a step cheap: a beam's
prompt is its parent's plus one token.

BeamSearch holds the search's state and is driven step by step: `step_prompts()` gives the token lists to run,
`advance()` takes their logprobs; the offline API drives it with LLM.generate, the server with the AsyncEngine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aserve.outputs import Logprob
from aserve.sampling_params import BeamSearchParams  # (defined there, as in vLLM; imported from here too)


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), the logprobs of each generated position (the candidates'), its
    cumulative logprob; `text` (the whole sequence's, prompt included, as vLLM's) once returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (the end-of-sequence token) or "length"
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's best sequences, at most beam_width, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty (the length without a final end-of-sequence token), as transformers."""
    length = len(beam.tokens) - (eos_token_id is not None and beam.tokens[-1] == eos_token_id)
    return beam.cum_logprob / (length**length_penalty)


class BeamSearch:
    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                 max_model_len: int) -> None:  # fmt: skip
        self.params, self.eos_token_id, self.max_model_len = params, eos_token_id, max_model_len
        self.beams = [[BeamSearchSequence(list(p))] for p in prompts]  # per prompt, the beams still going
        self.completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.beams)

    def step_prompts(self) -> list[list[int]]:
        """The token lists this step runs: every live beam's, prompt by prompt."""
        return [beam.tokens for beams in self.beams for beam in beams]

    def advance(self, step_logprobs: list[dict[int, Logprob]]) -> None:
        """Each live beam's candidates, in step_prompts' order -> the next beams. A beam that fills the context
        completes ("length")."""
        results = iter(step_logprobs)
        for i, beams in enumerate(self.beams):
            candidates = []
            for beam in beams:
                logprobs = next(results)
                for token_id, logprob in logprobs.items():
                    child = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [logprobs],
                                               beam.cum_logprob + logprob.logprob)  # fmt: skip
                    if token_id == self.eos_token_id and not self.params.ignore_eos:
                        child.finish_reason = "stop"
                        self.completed[i].append(child)
                    elif len(child.tokens) >= self.max_model_len:
                        child.finish_reason = "length"
                        self.completed[i].append(child)
                    else:
                        candidates.append(child)
            candidates.sort(key=self._score, reverse=True)
            self.beams[i] = candidates[: self.params.beam_width]
            # a completed beam's score is final: only the beam_width best can be returned
            self.completed[i] = sorted(self.completed[i], key=self._score, reverse=True)[: self.params.beam_width]
        self.steps += 1

    def outputs(self, decode: Callable[[list[int]], str] | None = None) -> list[BeamSearchOutput]:
        """The best beam_width sequences of each prompt, their text decoded (the prompt's included; without
        `decode`, left None)."""
        outputs = []
        for beams, completed in zip(self.beams, self.completed):
            for beam in beams:
                beam.finish_reason = beam.finish_reason or "length"
            best = sorted(completed + beams, key=self._score, reverse=True)[: self.params.beam_width]
            for beam in best if decode is not None else ():
                beam.text = decode(beam.tokens)
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos_token_id, self.params.length_penalty)
