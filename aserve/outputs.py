"""What generate() returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One entry per generated token: {token_id: Logprob} holding the sampled token and the top-n alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs (with logprobs asked for)
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    lora_request: None = None  # (vLLM's; aserve runs no LoRA adapters)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """vLLM's fields; those for what aserve does not run are always None: metrics (vLLM fills them only with stats
    logging on; aserve's engine keeps its own, `LLMEngine.stats`), lora_request, encoder_prompt and
    encoder_prompt_token_ids (decoder-only models), kv_transfer_params (no KV transfer between instances)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then {token_id: Logprob} for each other
    # (the prompt token and the top alternatives)
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request ended because of an internal error
    kv_transfer_params: None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """vLLM's: merges a later output of the same request into this one. aggregate (DELTA outputs): each
        completion's new text, token ids and logprobs are appended to those it has; otherwise (CUMULATIVE) a
        completion is replaced by its newer one. A completion not seen before is added."""
        self.finished |= next_output.finished
        for new in next_output.outputs:
            for i, old in enumerate(self.outputs):
                if old.index != new.index:
                    continue
                if aggregate:
                    old.text += new.text
                    old.token_ids = [*old.token_ids, *new.token_ids]  # (new lists: the engine's are never extended)
                    if new.logprobs:
                        old.logprobs = [*(old.logprobs or []), *new.logprobs]
                    old.cumulative_logprob = new.cumulative_logprob
                    old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
                else:
                    self.outputs[i] = new
                break
            else:
                self.outputs.append(new)
