"""The engine as the offline API and the server's AsyncEngine use it: requests in, RequestOutputs out.

    add_request:  tokenise, validate, n sequences                   -> EngineCore.add_request, OutputProcessor
    step:         EngineCore.step (schedule -> execute -> update)   -> OutputProcessor.process -> RequestOutputs
    abort:        EngineCore.finish_requests                        -> OutputProcessor.process

Endings the output processor finds (stop strings, faults in a request's output, a sequence whose siblings failed)
go back to the core in `_process`, before anything else is scheduled.

The server tokenises and renders chat templates off the event loop (TokenizerPool, below). Short texts are
tokenised inline (a thread hop would cost more than the work). Longer ones, and every chat rendering, run in a fixed
pool of threads (the tokenizer releases the GIL while it encodes, and a Jinja template yields it every switch
interval), so /health and every stream keep answering meanwhile. At most `max_pending_chars` characters of text may
be queued or in work in the pool at once: tokenising holds ~350 bytes per token until it ends, and without a cap a
burst of long prompts (each of which fits the context on its own) adds up to gigabytes.
Beyond the cap a request gets EngineOverloadedError (HTTP 429, Retry-After) before any of its text is touched.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from aserve.config import EngineArgs
from aserve.core.block_pool import BlockHasher
from aserve.core.kv_cache_manager import InvariantError
from aserve.core.outputs import EngineCoreOutput
from aserve.core.request import Request, SampleGroup
from aserve.core.structured_output import compile_error
from aserve.engine.config import EngineConfig
from aserve.engine.core import EngineCore
from aserve.engine.errors import EngineOverloadedError
from aserve.engine.output_processor import OutputProcessor
from aserve.inputs import ParsedPrompt, PromptType, parse_prompt, with_prompt_salt
from aserve.outputs import RequestOutput
from aserve.sampling_params import ParamError, RequestOutputKind, SamplingParams
from aserve.tokenize_options import TokenizeOptions

logger = logging.getLogger("aserve")

# A serving process gc.freeze()s what its engine loads (freeze_for_serving); unfreeze at exit so that interpreter
# shutdown collects it (native extensions report anything left over as a leak).
atexit.register(gc.unfreeze)


def freeze_for_serving() -> None:
    """Moves everything allocated so far (model, tokenizer, pools) out of the cyclic GC's scans, which otherwise stall
    steps at random. Only for an engine that lives as long as the process: frozen cycles are never collected, so an
    offline `LLM` (which `del llm` must free, GPU memory included) does not freeze; it pauses the cyclic GC while
    generating instead (`LLM._run`)."""
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        self.config = config = EngineConfig.from_engine_args(args)
        self.core = EngineCore(config)
        self.output_processor = OutputProcessor(config.tokenizer)
        self.startup_time = time.perf_counter() - t0
        runner = self.core.runner
        logger.info(
            "Loaded %s (%s, %.1fM params, %s on %s) in %.1f s; KV cache (%s): %d blocks x %d = %d tokens; "
            "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, prefix caching %s, async scheduling %s",
            config.served_model_name,
            config.architecture,
            runner.num_params / 1e6,
            str(config.dtype).removeprefix("torch."),
            config.device,
            self.startup_time,
            str(runner.kv_dtype).removeprefix("torch."),
            self.core.num_kv_blocks,
            config.block_size,
            self.core.kv_capacity_tokens,
            config.max_model_len,
            args.max_num_seqs,
            config.max_num_batched_tokens,
            "on" if args.enable_prefix_caching else "off",
            "on" if config.async_scheduling else "off",
        )

    @property
    def tokenizer(self):
        return self.config.tokenizer

    @property
    def stats(self):
        return self.core.stats

    @property
    def model_config(self) -> EngineConfig:
        """vLLM's name for the model's settings as the engine resolved them (`llm.llm_engine.model_config
        .max_model_len`): aserve's EngineConfig (max_model_len, vocab_size, dtype, tokenizer, ...)."""
        return self.config

    # -- requests ---------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request=None,
        tokenization_kwargs: dict | None = None,
        trace_headers=None,
        priority: int = 0,
        prompt_text: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        max_tokens_must_fit: bool = False,
        grammar_after: int | None = None,
        output_kind: RequestOutputKind | None = None,
    ) -> None:
        """Validates and queues a request. Raises ValueError (bad input) without changing any state. The positional
        parameters are vLLM's: lora_request and trace_headers are refused unless None (no LoRA adapters, no
        tracing), priority unless 0 (first-come scheduling); tokenization_kwargs as LLM.generate's
        (aserve/tokenize_options.py); prompt_text: the text of a token-ids prompt, reported in its outputs.
        prompt_token_ids: the prompt's ids where the caller tokenised it (`prompt` then gives its text and cache
        salt, if any). max_tokens_must_fit: see _make_sequences. grammar_after: a token id (a reasoning model's end of
        thinking) before which the structured-output grammar does not apply: it constrains the tokens after that
        one. output_kind: what step()'s outputs for it hold (default: the params' output_kind)."""
        for name, value, why in (("lora_request", lora_request, "aserve does not run LoRA adapters"),
                                 ("trace_headers", trace_headers, "aserve does not export traces")):  # fmt: skip
            if value is not None:
                raise ParamError(name, f"{name}: {why}")
        if priority != 0:
            raise ParamError("priority", "priority: aserve schedules first come, first served (priority 0 only)")
        params = params or SamplingParams()
        if self.output_processor.has_request(request_id):
            raise ParamError("request_id", f"request id {request_id!r} is already in use")
        grammar = self.grammar_future(params)
        if grammar is not None and grammar.done() and (error := compile_error(grammar)) is not None:
            raise error  # a ParamError naming the problem
        parsed = parse_prompt(prompt) if prompt is not None else ParsedPrompt(None, None)
        prompt_text = parsed.text if prompt_text is None else prompt_text
        if tokenization_kwargs:
            options = TokenizeOptions.from_kwargs(tokenization_kwargs, self.config.max_model_len)
            if prompt_token_ids is None:
                prompt_token_ids = self.tokenize_prompt(prompt, options.add_special_tokens)[1]
            prompt_token_ids = options.apply(prompt_token_ids)
        if prompt_token_ids is None:
            prompt_token_ids = parsed.token_ids if parsed.token_ids is not None else self._encode(parsed.text)
        params = with_prompt_salt(params, parsed.cache_salt)
        prompt_token_ids = params.truncate_prompt(prompt_token_ids, self.config.max_model_len)
        params, sequences = self._make_sequences(
            request_id, prompt_token_ids, params, arrival_time, max_tokens_must_fit
        )
        if any(s.request_id in self.core.scheduler.requests for s in sequences):
            raise ParamError("request_id", f"request id {request_id!r} is already in use")
        if grammar is not None:  # one matcher per sequence; they wait for the compile in the scheduler's queue
            for sequence in sequences:
                sequence.grammar = self.core.structured_output.sequence_state(grammar, grammar_after)
        sequence_ids = [s.request_id for s in sequences]
        self.output_processor.add_request(request_id, prompt_text, prompt_token_ids, params, sequence_ids,
                                          params.output_kind if output_kind is None else output_kind)  # fmt: skip
        for sequence in sequences:
            self.core.add_request(sequence)

    def grammar_future(self, params: SamplingParams | None) -> Future | None:
        """The compile of the request's structured-output grammar (cached; compiling in the grammar pool), or None
        without one. Its exception is a ParamError naming what does not compile."""
        if params is None or params.structured_outputs is None:
            return None
        return self.core.structured_output.compile(params.structured_outputs)

    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """-> (the prompt's text if it has one, its token ids). A prompt dict's keys are checked
        (aserve/inputs.py)."""
        parsed = parse_prompt(prompt)
        if parsed.token_ids is not None:
            return parsed.text, parsed.token_ids
        return parsed.text, self._encode(parsed.text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_prompt_chars(len(text))
        return self.config.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_prompt_chars(self, num_chars: int, param: str = "prompt", at_least: bool = False) -> None:
        """Refuses, before any tokenising, a text that no tokenisation fits in max_model_len tokens
        (EngineConfig.max_prompt_chars). at_least: `num_chars` is a lower bound (the text was not decoded)."""
        config = self.config
        if num_chars > config.max_prompt_chars:
            raise ParamError(
                param,
                f"This model's maximum context length is {config.max_model_len} tokens. However, your prompt has "
                f"{'at least ' if at_least else ''}{num_chars} characters, more than any {config.max_model_len} "
                "tokens of this tokenizer spell (at "
                f"most {config.max_chars_per_token} characters each). Please reduce the length of the prompt.",
                code="context_length_exceeded",
            )

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        n, max_model_len, vocab_size = len(prompt_token_ids), self.config.max_model_len, self.config.vocab_size
        if n == 0:
            raise ParamError("prompt", "the prompt is empty")
        if n > max_model_len:
            raise ParamError(
                "prompt",
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has {n} tokens. "
                "Please reduce the length of the prompt.",
                code="context_length_exceeded",
            )
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise ParamError("prompt", f"prompt token ids must be integers, got {bad!r}")
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ParamError("prompt", f"prompt token id {bad!r} is out of range [0, {vocab_size})")

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: values the step would fail on (which would end every
        request batched with this one)."""
        vocab_size, limit = self.config.vocab_size, self.config.args.max_logprobs
        limit = vocab_size if limit == -1 else min(limit, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and (value > limit or (value == -1 and limit < vocab_size)):
                asked = "the whole vocabulary" if value == -1 else value
                raise ParamError(name, f"{name}: {asked} per token asked for, at most {limit} allowed "
                                 "(max_logprobs; -1 allows the whole vocabulary)")  # fmt: skip
        if params.seed is not None and not -(2**63) <= params.seed <= 2**63 - params.n:  # sibling i uses seed + i
            raise ParamError("seed", "seed must be a 64-bit signed integer")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
            raise ParamError("stop_token_ids", f"stop_token_ids must be < the vocabulary size ({vocab_size})")
        if params.logit_bias and max(params.logit_bias) >= vocab_size:
            raise ParamError("logit_bias", f"logit_bias token ids must be < the vocabulary size ({vocab_size})")
        allowed = params.allowed_token_ids
        if allowed and (max(allowed) >= vocab_size or len(allowed) > vocab_size):
            raise ParamError("allowed_token_ids", f"allowed_token_ids must be at most {vocab_size} token ids, each < "
                             "the vocabulary size")  # fmt: skip

    def _make_sequences(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        max_tokens_must_fit: bool = False,
    ) -> tuple[SamplingParams, list[Request]]:
        """Validates a tokenised request (ParamError) and makes its sequences: one Request per sample, ids
        `request_id` (n = 1) or `request_id#i` (siblings share the prompt's KV blocks through their block hashes).
        max_tokens_must_fit (the OpenAI server's rule): prompt + max_tokens beyond max_model_len is an error rather
        than a request that ends at the context length. -> (the parameters with max_tokens resolved, the
        sequences)."""
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        config, n = self.config, len(prompt_token_ids)
        extra_eos = [i for i in config.extra_eos_token_ids if i not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:
            params = params.clone(stop_token_ids=[*params.stop_token_ids, *extra_eos])
        if max_tokens_must_fit and params.max_tokens is not None and n + params.max_tokens > config.max_model_len:
            raise ParamError(
                "max_tokens",
                f"This model's maximum context length is {config.max_model_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.",
                code="context_length_exceeded",
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) == -1:  # the whole vocabulary (max_logprobs allowed it)
                params = params.clone(**{name: config.vocab_size})
        if params.max_tokens is None:
            if max_tokens_must_fit and n >= config.max_model_len:  # nothing left to generate into
                raise ParamError(
                    "prompt",
                    f"This model's maximum context length is {config.max_model_len} tokens. However, your prompt has "
                    f"{n} tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
                    code="context_length_exceeded",
                )
            params = params.clone(max_tokens=max(1, config.max_model_len - n))
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if config.args.enable_prefix_caching:
            salt = params.cache_salt
            if config.long_prompt_len is not None and n > config.long_prompt_len:
                salt = f"{salt or ''}\x00long prompt"  # its blocks hold keys rotated otherwise
            hasher = BlockHasher(config.block_size, salt)
        elif params.n > 1:  # siblings still share the prompt's blocks, with nobody else
            hasher = BlockHasher(config.block_size, f"group:{id(params)}:{request_id}")
        else:
            hasher = None
        eos = config.eos_token_id
        if params.n == 1:
            sequences = [Request(request_id, prompt_token_ids, params, eos, hasher, arrival_time)]
        else:
            # the first sibling alone scores the prompt (prompt_logprobs): the request reports them once
            sequences = [Request(f"{request_id}#{i}", prompt_token_ids,
                                 params.clone(n=1, seed=None if params.seed is None else params.seed + i,
                                              prompt_logprobs=params.prompt_logprobs if i == 0 else None),
                                 eos, hasher, arrival_time) for i in range(params.n)]  # fmt: skip
            group = SampleGroup(params.n)
            for sequence in sequences:
                sequence.sample_group = group
        if params.bad_words:
            bad = self._bad_words_token_ids(params.bad_words)
            for sequence in sequences:
                sequence.bad_words_token_ids = bad
        return params, sequences

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens, and with a leading space where that makes another word token of the same length
        (vLLM's rule: a word is banned at the start of the text and after a space)."""
        encode, out = self.config.tokenizer.encode, []
        for word in words:
            plain = encode(word.lstrip(), add_special_tokens=False)
            spaced = encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(plain)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        if any(t >= self.config.vocab_size for ids in out for t in ids):
            raise ParamError("bad_words", f"bad_words spell token ids past the vocabulary ({self.config.vocab_size})")
        return [ids for ids in out if ids]

    def abort_request(self, request_id: str | Iterable[str], error: str | None = None) -> RequestOutput | None:
        """Ends a request at once and frees its blocks. Returns its final output (finish_reason "abort", with
        `error` as its reason when the server, not the client, ended it), or None for an unknown or finished one.
        Several ids (vLLM's form): each is ended; None is returned."""
        if not isinstance(request_id, str):
            for one in list(request_id):
                self.abort_request(one, error)
            return None
        sequence_ids = self.output_processor.live_sequence_ids(request_id, error)
        outputs = self.process(self.core.finish_requests(sequence_ids))
        return next((out for out in outputs if out.request_id == request_id), None)

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Pauses (or resumes) a request's sequences: paused, they are not scheduled but keep their state (their
        KV blocks until another request needs them). For a server whose client stopped reading."""
        self.core.set_paused(self.output_processor.live_sequence_ids(request_id), paused)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states) or self.core.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    def get_tokenizer(self):
        return self.config.tokenizer

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # -- the step ---------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        return self.process(self.core.step())

    def process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """The outputs of a step (or of `EngineCore.update`, for a front end that runs the step's phases itself)."""
        outputs = self._process(core_outputs)
        if self.config.args.debug_invariants:
            self.check_invariants()
        return outputs

    def _process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        outputs, finishes = self.output_processor.process(core_outputs)
        while finishes:  # endings found in the text reach the core; what it reports back changes nothing more
            more = self.core.finish_requests(finishes.stopped, stopped=True)
            for error, sequence_ids in finishes.failed.items():
                more += self.core.finish_requests(sequence_ids, error=error)
            extra, finishes = self.output_processor.process(more)
            outputs += extra
        return outputs

    # -- misc -------------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """What `debug_invariants` checks after every step and abort (InvariantError if broken): the request table
        and the scheduler agree (every unfinished sequence of a live request is queued, every queued sequence
        belongs to one), then the scheduler's queues and the KV blocks' ref counts and free list."""
        queued = self.core.scheduler.requests
        states = self.output_processor.states
        for sequence_id, (state, index) in self.output_processor.sequence_to_state.items():
            if states.get(state.request_id) is not state or state.sequence_ids[index] != sequence_id:
                raise InvariantError(f"sequence {sequence_id!r} maps to a request that is not live")
            if state.finish_reasons[index] is None and sequence_id not in queued:
                raise InvariantError(f"sequence {sequence_id!r} of live request {state.request_id!r} is unfinished "
                                     "but not queued")  # fmt: skip
        for sequence_id in queued:
            entry = self.output_processor.sequence_to_state.get(sequence_id)
            if entry is None or entry[0].finish_reasons[entry[1]] is not None:
                raise InvariantError(f"queued sequence {sequence_id!r} belongs to no live request")
        self.core.check_invariants()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix: no later request hits the blocks computed so far (blocks a running request
        holds stay its own). True, as vLLM's when it succeeds."""
        self.core.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        """Stops the engine's worker processes (tensor parallelism); garbage collection and interpreter exit do it
        too. The engine cannot run after it."""
        self.core.shutdown()


INLINE_CHARS = 4096  # texts (and token lists) up to this long are handled on the event loop: ~1-3 ms of work
DEFAULT_POOL_SIZE = 2
DEFAULT_MAX_PENDING_CHARS = 16 * 2**20


class TokenizerPool:
    def __init__(
        self,
        tokenizer,
        pool_size: int = DEFAULT_POOL_SIZE,
        max_pending_chars: int = DEFAULT_MAX_PENDING_CHARS,
        max_text_chars: int = 0,
    ) -> None:
        """max_text_chars: the longest text a request may bring (longer ones are refused before they get here); the
        cap is raised to it, so that every admissible text fits when the pool is idle."""
        if pool_size < 1:
            raise ValueError(f"the tokenizer pool needs at least one thread, got {pool_size}")
        self.tokenizer = tokenizer
        self.max_pending_chars = max(max_pending_chars, max_text_chars)
        self.pending_chars = 0
        self._executor = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="aserve-tokenize")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return (await self.encode_many([text], add_special_tokens))[0]

    async def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Texts (one, or a completions request's prompts): on the loop only while all of them together are short,
        else in one job in the pool."""
        encode, total = self.tokenizer.encode, sum(map(len, texts))
        if total <= INLINE_CHARS:
            return [encode(text, add_special_tokens=add_special_tokens) for text in texts]
        return await self._run(total, lambda: [encode(text, add_special_tokens=add_special_tokens) for text in texts])

    async def decode(self, token_ids: list[int]) -> str:
        decode = self.tokenizer.decode
        if len(token_ids) <= INLINE_CHARS:
            return decode(token_ids)
        return await self._run(len(token_ids), lambda: decode(token_ids))

    async def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        template_kwargs: dict | None,
        text_chars: int,
        check_chars: Callable[[int], None],
        add_special_tokens: bool = False,
    ) -> list[int]:
        """A conversation through the tokenizer's chat template -> its token ids, both in the pool. The messages'
        text (`text_chars` characters) counts against the cap; `check_chars(len(rendered))` may refuse the rendered
        text before it is tokenised."""
        tokenizer = self.tokenizer
        if tokenizer.chat_template is None and not (template_kwargs or {}).get("chat_template"):
            raise ParamError("messages", "this model's tokenizer has no chat template; use /v1/completions")

        def render() -> list[int]:
            try:
                text = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=add_generation_prompt, tokenize=False, **(template_kwargs or {})
                )
            except Exception as e:  # a template that rejects the conversation (e.g. roles out of order)
                raise ParamError("messages", f"the chat template rejected the messages: {e}") from e
            check_chars(len(text))
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await self._run(text_chars, render)

    async def _run(self, num_chars: int, fn):
        if self.pending_chars and self.pending_chars + num_chars > self.max_pending_chars:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.pending_chars} characters of prompt text are being tokenised "
                f"(limit {self.max_pending_chars}); retry later",
                retry_after=1,
                code="tokenizer_busy",
            )
        # Counted until the thread is done with it, not until its caller stops waiting: a client that hangs up does
        # not stop a running tokenisation.
        self.pending_chars += num_chars
        loop = asyncio.get_running_loop()
        future = self._executor.submit(fn)
        future.add_done_callback(lambda _: _call_soon(loop, self._release, num_chars))
        return await asyncio.wrap_future(future, loop=loop)

    def _release(self, num_chars: int) -> None:
        self.pending_chars -= num_chars

    def shutdown(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    with contextlib.suppress(RuntimeError):  # the loop has closed: nobody counts any more
        loop.call_soon_threadsafe(fn, *args)
