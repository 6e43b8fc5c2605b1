"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence

from tqdm import tqdm

from aserve.config import EngineArgs
from aserve.core.structured_output import compile_error
from aserve.engine.llm_engine import LLMEngine, PromptType
from aserve.outputs import RequestOutput
from aserve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        # Validate everything first, so a bad prompt leaves nothing half-queued.
        max_model_len = self.engine.config.max_model_len
        tokenized = [self.engine.tokenize_prompt(p) for p in prompts]
        tokenized = [(text, params.truncate_prompt(ids, max_model_len)) for (text, ids), params in
                     zip(tokenized, params_list)]  # fmt: skip
        for _, ids in tokenized:
            self.engine.validate_prompt(ids)
        # Structured-output grammars compile in parallel in the engine's pool; one that does not raises here.
        for grammar in [self.engine.grammar_future(params) for params in params_list]:
            if grammar is not None and (error := compile_error(grammar)) is not None:  # (waits for it)
                raise error
        request_ids = []
        for (text, ids), params in zip(tokenized, params_list):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, text, params, prompt_token_ids=ids)
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Renders each conversation with the tokenizer's chat template, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(conv)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        tokenizer = self.engine.tokenizer
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm)
        gc_was_enabled = gc.isenabled()
        gc.disable()  # no cyclic-GC pauses between steps; what accumulates is collected after the call
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            for request_id in pending:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
            if gc_was_enabled:
                gc.enable()
        return [results[r] for r in request_ids]
