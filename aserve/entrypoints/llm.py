"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Callable, Sequence

from tqdm import tqdm

from aserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from aserve.config import EngineArgs
from aserve.core.metrics import PeriodicLogger, PrometheusMetrics
from aserve.core.structured_output import compile_error
from aserve.engine.llm_engine import LLMEngine
from aserve.entrypoints.chat_utils import parse_conversation, takes_content_parts
from aserve.entrypoints.openai.protocol import TEMPLATE_CONTROLS
from aserve.entrypoints.openai.request_fields import STRUCTURED_OUTPUT_BACKENDS
from aserve.inputs import PromptType
from aserve.metrics_reader import Metric, get_metrics_snapshot
from aserve.outputs import RequestOutput
from aserve.sampling_params import RequestOutputKind, SamplingParams
from aserve.tokenize_options import TokenizeOptions
from aserve.worker.profiler_hooks import require

logger = logging.getLogger("aserve")

_POOLING = "aserve serves generative models only (no embeddings, scores, classes or rewards)"
_CONTENT_FORMATS = ("auto", "string", "openai")
# use_tqdm: True (tqdm's bar), False (none), or vLLM's callable making the bar (e.g. functools.partial(tqdm, ...))
ProgressBar = bool | Callable[..., tqdm]


def _refused(name: str, why: str, error: type[Exception] = NotImplementedError):
    """An LLM method of vLLM's that aserve does not have: calling it raises `error` saying so."""

    def method(self, *args, **kwargs):
        raise error(f"LLM.{name}() is not supported: {why}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"vLLM's LLM.{name}(): not supported ({why})."
    return method


def _refuse_lora(lora_request) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: aserve does not run LoRA adapters")


def _check_structured_outputs_config(config: dict | None) -> None:
    """vLLM's LLM(structured_outputs_config={"backend": ...}): xgrammar (or auto) with its defaults is what aserve
    runs; anything else is refused."""
    if config is None:
        return
    backend = config.get("backend", "auto") if isinstance(config, dict) else None
    if not isinstance(config, dict) or set(config) - {"backend"} or backend not in STRUCTURED_OUTPUT_BACKENDS:
        raise ValueError(f"structured_outputs_config {config!r}: structured output always uses xgrammar with its "
                         'defaults ({"backend": "xgrammar"} or "auto" only)')  # fmt: skip


def _template_kwargs(chat_template_kwargs: dict | None, tools: list[dict] | None) -> dict:
    """LLM.chat's chat_template_kwargs with its tools (which win over a "tools" key, as in vLLM). Keys that control
    how the chat is rendered rather than what the template reads are refused by name."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & (TEMPLATE_CONTROLS - {"tools"}))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r}: LLM.chat takes add_generation_prompt, "
                         "continue_final_message, tools and chat_template as its own arguments, truncation and "
                         "max_length in tokenization_kwargs")  # fmt: skip
    if tools is not None:
        kwargs["tools"] = tools
    return kwargs


class LLM:
    def __init__(self, model: str | None = None, disable_log_stats: bool = True,
                 structured_outputs_config: dict | None = None, **engine_args) -> None:  # fmt: skip
        """disable_log_stats: True by default, as in vLLM's LLM; False keeps the engine's Prometheus series for
        get_metrics() and logs the periodic stats line (logger "aserve", INFO). structured_outputs_config: vLLM's,
        {"backend": "xgrammar"} or "auto" only."""
        _check_structured_outputs_config(structured_outputs_config)
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()
        self._metrics: PrometheusMetrics | None = None
        if not disable_log_stats:
            config = self.engine.config
            cache_config = config.cache_metrics_info(self.engine.core.num_kv_blocks)
            self._metrics = PrometheusMetrics(config.served_model_name, cache_config=cache_config,
                                              max_model_len=config.max_model_len)  # fmt: skip
            self.engine.stats.add_listener(self._metrics)
            self.engine.stats.add_listener(PeriodicLogger(logger.info))

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine."""
        return self.engine

    @property
    def model_config(self):
        """vLLM's `llm.model_config`: the engine's settings as resolved (max_model_len, hf_config, ...)."""
        return self.engine.model_config

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what the model can be asked to do; aserve serves generative models only."""
        return ("generate",)

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the processes the model runs in, the tensor-parallel size (include_dp changes nothing: there is no
        pipeline or data parallelism)."""
        return self.engine.config.args.tensor_parallel_size

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given none: the model's generation config's sampling (generation_config)."""
        return SamplingParams.from_optional(**self.engine.config.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressBar = True,
        lora_request=None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt (a string, TextPrompt or TokensPrompt: aserve/inputs.py) to completion; outputs come back
        in prompt order, each the final one (vLLM's LLM runs every request FINAL_ONLY). vLLM's lora_request is
        refused unless None (no LoRA adapters), priority unless every one is 0 (first-come scheduling);
        tokenization_kwargs: aserve/tokenize_options.py."""
        _refuse_lora(lora_request)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
            if any(p != 0 for p in priority):
                raise ValueError("priority: aserve schedules first come, first served (only priority 0 is taken)")
        options = TokenizeOptions.from_kwargs(tokenization_kwargs, self.engine.config.max_model_len)
        tokenized = [(p, options.apply(self.engine.tokenize_prompt(p, options.add_special_tokens)[1]))
                     for p in prompts]  # fmt: skip
        return self._generate(tokenized, sampling_params, use_tqdm)

    def _generate(self, tokenized: list[tuple[PromptType | None, list[int]]], sampling_params, use_tqdm: ProgressBar):
        """(prompt as given, or None, its token ids) for each request -> their final outputs."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(tokenized)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(tokenized):
                raise ValueError(f"{len(tokenized)} prompts but {len(params_list)} sampling params")
            if not all(isinstance(p, SamplingParams) for p in params_list):
                raise TypeError("sampling_params must be a SamplingParams or a list of them")
        # Validate everything first, so bad input leaves nothing half-queued.
        max_model_len = self.engine.config.max_model_len
        tokenized = [(prompt, params.truncate_prompt(ids, max_model_len)) for (prompt, ids), params in
                     zip(tokenized, params_list)]  # fmt: skip
        for (_, ids), params in zip(tokenized, params_list):
            self.engine.validate_prompt(ids)
            self.engine.validate_params(params)
        # Structured-output grammars compile in parallel in the engine's pool; one that does not raises here.
        for grammar in [self.engine.grammar_future(params) for params in params_list]:
            if grammar is not None and (error := compile_error(grammar)) is not None:  # (waits for it)
                raise error
        request_ids = []
        try:
            for (prompt, ids), params in zip(tokenized, params_list):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params, prompt_token_ids=ids,
                                        output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
                request_ids.append(request_id)
        except BaseException:
            for request_id in request_ids:  # what one request's checks let through, none of the batch runs
                self.engine.abort_request(request_id)
            raise
        return self._run(request_ids, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:  # fmt: skip
        """vLLM's beam search (aserve/beam_search.py): each prompt's beam_width best sequences, their text the
        whole sequence's; a prompt's cache_salt salts its beams' steps. concurrency_limit: prompts searched at once
        (default: all)."""
        _refuse_lora(lora_request)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenized = [self.engine.tokenize_prompt(p)[1] for p in prompts]  # (which checks a dict's keys)
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        for ids in tokenized:
            self.engine.validate_prompt(ids)
        group = concurrency_limit or max(1, len(tokenized))
        step, outputs = params.step_params(), []
        for start in range(0, len(tokenized), group):
            search = BeamSearch(tokenized[start : start + group], params, self.engine.config.eos_token_id,
                                self.engine.config.max_model_len)  # fmt: skip
            while not search.done:
                beam_salts = [salt for salt, beams in zip(salts[start : start + group], search.beams) for _ in beams]
                steps = [(None if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}, ids)
                         for salt, ids in zip(beam_salts, search.step_prompts())]  # fmt: skip
                runs = self._generate(steps, step, use_tqdm)
                search.advance([run.outputs[0].logprobs[0] for run in runs])
            outputs += search.outputs(self.get_tokenizer().decode)
        return outputs

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: ProgressBar = True,
        lora_request=None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the chat template (the tokenizer's, or `chat_template`), then generates;
        each output's prompt is the rendered text. chat_template_content_format (vLLM's): "string" joins a message's
        text parts with newlines, "openai" gives the template every content as a list of text parts, "auto" the
        list where the template loops over a message's content (else the string). tokenization_kwargs as
        generate()'s, add_special_tokens False unless given (the template writes them)."""
        _refuse_lora(lora_request)
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs: aserve serves text only: there is no multimodal processor")
        if chat_template_content_format not in _CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format {chat_template_content_format!r} is not supported "
                             f"({', '.join(_CONTENT_FORMATS)})")  # fmt: skip
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        kwargs = _template_kwargs(chat_template_kwargs, tools)
        options = TokenizeOptions.from_kwargs(tokenization_kwargs, self.engine.config.max_model_len,
                                              add_special_tokens=False)  # fmt: skip
        tokenized = []
        for conv in conversations:
            text, ids = self.render_chat(conv, add_generation_prompt, continue_final_message, chat_template, kwargs,
                                         chat_template_content_format, options.add_special_tokens)  # fmt: skip
            tokenized.append((text, options.apply(ids)))
        return self._generate(tokenized, sampling_params, use_tqdm)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict | None = None, content_format: str = "auto",
                    add_special_tokens: bool = False) -> tuple[str, list[int]]:  # fmt: skip
        """A conversation through the chat template -> (its text, its token ids)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        tokenizer = self.engine.tokenizer
        if chat_template is None and tokenizer.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template: pass chat_template=..., or use generate()")
        keep_parts = content_format == "openai" or (
            content_format == "auto" and takes_content_parts(chat_template or tokenizer.chat_template)
        )
        conversation = parse_conversation(messages, keep_parts, all_parts=content_format == "openai")
        text = tokenizer.apply_chat_template(conversation, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}))  # fmt: skip
        return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """A conversation's prompt token ids (the tokenizer's template, with the generation prompt)."""
        return self.render_chat(messages)[1]

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prompt prefix (later prompts hit none of the blocks computed so far); True, as
        vLLM's."""
        return self.engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """vLLM's: the profiler of profiler_config (aserve/worker/profiler_hooks.py) runs over the steps until
        stop_profile(), on every rank. RuntimeError without a profiler_config, or when one is running already."""
        self.engine.core.runner.start_profile(require(self.engine.config.profiler))

    def stop_profile(self) -> None:
        """Ends the run start_profile() began; the traces are written before this returns."""
        self.engine.core.runner.stop_profile()

    def reset_mm_cache(self) -> None:
        """vLLM's reset of its multimodal processor cache: aserve takes text only and keeps no such cache, so there
        is nothing to forget."""

    def get_metrics(self) -> list[Metric]:
        """vLLM's snapshot of the engine's Prometheus series (the `aserve:` names of `GET /metrics`) as Counter, Gauge,
        Histogram and Vector objects (aserve/metrics_reader.py). As in vLLM, an AssertionError unless the LLM was made
        with disable_log_stats=False."""
        if self._metrics is None:
            raise AssertionError("Stat logging disabled: make the LLM with disable_log_stats=False to collect metrics")
        return get_metrics_snapshot(self._metrics.registry)

    # vLLM's methods for what aserve does not do: each says so when called (rather than an AttributeError)
    encode = _refused("encode", _POOLING, ValueError)
    embed = _refused("embed", _POOLING, ValueError)
    score = _refused("score", _POOLING, ValueError)
    classify = _refused("classify", _POOLING, ValueError)
    reward = _refused("reward", _POOLING, ValueError)
    sleep = _refused("sleep", "aserve has no sleep mode: weights and KV cache stay in memory until `del llm`")
    wake_up = _refused("wake_up", "aserve has no sleep mode: weights and KV cache stay in memory until `del llm`")
    collective_rpc = _refused("collective_rpc", "aserve's workers run its own steps only")
    apply_model = _refused("apply_model", "aserve's workers run its own steps only")

    def _run(self, request_ids: list[str], use_tqdm: ProgressBar) -> list[RequestOutput]:
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        if callable(use_tqdm):
            bar = use_tqdm(total=len(request_ids), desc="Generating")
        else:
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
