"""AsyncEngine: the engine driven by a step coroutine on the event loop.

    event loop thread                                  step worker thread
    ─────────────────                                  ──────────────────
    EngineCore.schedule()  ───── StepWork ──────────▶  EngineCore.execute(): model forward + sampling
       ▲                                                      │
    EngineCore.update(): the scheduler applies it  ◀── StepResult
    → OutputProcessor: text, stop strings, n → per-request asyncio.Queue → generate() iterators → HTTP streams

Scheduler and request state are only touched on the loop thread, so they need no locks. An abort frees a
request's blocks at once even while a step that uses them is running: blocks are only handed out again by the next
schedule(), which waits for that step to end — or, with async scheduling, launches a step queued behind it on the
same CUDA stream, so the new owner's writes still come after the old step's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from aserve.config import EngineArgs
from aserve.core.structured_output import compile_error
from aserve.engine.config import EngineConfig
from aserve.engine.errors import EngineClosedError, EngineDeadError, EngineOverloadedError
from aserve.engine.intake_gate import IntakeGate
from aserve.engine.llm_engine import (
    DEFAULT_MAX_PENDING_CHARS,
    DEFAULT_POOL_SIZE,
    LLMEngine,
    TokenizerPool,
    freeze_for_serving,
)
from aserve.engine.streams import OutputSink, RequestStream
from aserve.inputs import PromptType
from aserve.outputs import RequestOutput
from aserve.sampling_params import ParamError, RequestOutputKind, SamplingParams
from aserve.worker.profiler_hooks import require

logger = logging.getLogger("aserve")
LAUNCH_WAIT_S = 0.05  # the longest the event loop waits for a launch (one that compiles a kernel takes longer)


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        tokenizer_pool_size: int = DEFAULT_POOL_SIZE,
        max_pending_prompt_chars: int = DEFAULT_MAX_PENDING_CHARS,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer_pool = TokenizerPool(
            engine.tokenizer, tokenizer_pool_size, max_pending_prompt_chars, engine.config.max_prompt_chars
        )
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="aserve-step")
        self._streams: dict[str, RequestStream] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed_reason: str | None = None  # set by abort_all(): no new requests after a forced shutdown
        self.failure: BaseException | None = None  # what ended the step loop, if an error did
        self._failed: asyncio.Event | None = None
        self._gate: IntakeGate | None = None
        self.waits_for_launch = engine.config.device.type == "cuda"  # (_step_loop; a CPU launch is the step itself)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **serving) -> AsyncEngine:
        """serving: tokenizer_pool_size, max_pending_prompt_chars (see TokenizerPool).

        The engine is built in the step thread, the thread its steps will run in: on CPU, torch's ops run ~30 %
        slower in a thread other than the one that loaded and warmed the model (measured 2026-12-02 with
        SmolLM2, batch 64: 9.1 s against 6.9 s for the same generate)."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aserve-step")
        engine = executor.submit(LLMEngine, args).result()
        freeze_for_serving()
        return cls(engine, executor=executor, **serving)

    @property
    def config(self) -> EngineConfig:
        """The resolved engine configuration: served_model_name, model_dir, max_model_len, vocab_size, ..."""
        return self.engine.config

    @property
    def num_params(self) -> int:
        return self.engine.core.runner.num_params

    @property
    def kv_capacity_tokens(self) -> int:
        return self.engine.core.kv_capacity_tokens

    @property
    def stats(self):
        """The engine's running totals and gauges; `stats.add_listener(fn)` sees every step (metrics, logs)."""
        return self.engine.stats

    # -- text -------------------------------------------------------------------------------------------------

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text that cannot fit the context is refused (ParamError) before any of it is tokenised; long ones are
        tokenised in the tokenizer pool, off the event loop."""
        return (await self.tokenize_many([text], add_special_tokens))[0]

    async def tokenize_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """tokenize() for several texts at once: off the event loop unless all of them together are short."""
        for text in texts:
            self.engine.check_prompt_chars(len(text))
        return await self.tokenizer_pool.encode_many(texts, add_special_tokens=add_special_tokens)

    def check_prompt_chars(self, num_chars: int, param: str = "prompt", at_least: bool = False) -> None:
        """ParamError (context_length_exceeded) if a text of `num_chars` characters cannot fit the context."""
        self.engine.check_prompt_chars(num_chars, param, at_least)

    async def detokenize(self, token_ids: list[int]) -> str:
        vocab = self.engine.config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ParamError("tokens", f"token ids must be in [0, {vocab})")
        return await self.tokenizer_pool.decode(token_ids)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, template_kwargs=None,
                          add_special_tokens: bool = False):  # fmt: skip
        """A conversation through the tokenizer's chat template -> its prompt token ids (add_special_tokens: the
        tokenizer's own, e.g. BOS, on top of the template's). Messages whose text alone cannot fit the context are
        refused before rendering; rendering and tokenising run in the tokenizer pool."""
        check = self.engine.check_prompt_chars
        text_chars = sum(len(c) if isinstance(c := m.get("content"), str) else sum(len(p["text"]) for p in c or ())
                         for m in messages)  # fmt: skip
        check(text_chars, "messages")
        return await self.tokenizer_pool.render_chat(
            messages, add_generation_prompt, template_kwargs, text_chars, lambda n: check(n, "messages"),
            add_special_tokens,
        )  # fmt: skip

    # -- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._wakeup, self._failed = asyncio.Event(), asyncio.Event()
            self._gate = IntakeGate(self.engine.core.inflight_finished)
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._step_loop(), name="aserve-step-loop")
            self._task.add_done_callback(self._on_loop_exit)
            workers = self.engine.core.workers
            if workers is not None:  # a worker that fails wakes the loop, which then stops (EngineCore.check_workers)
                wakeup = self._wakeup
                workers.add_failure_listener(lambda: loop.call_soon_threadsafe(wakeup.set))

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        self._gate.retire()
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            logger.error("the engine step loop died", exc_info=error)
            self.failure = error
            self._failed.set()
            for stream in list(self._streams.values()):
                stream.deliver(EngineDeadError(f"the engine stopped: {type(error).__name__}"))
            self._streams.clear()

    @property
    def has_started(self) -> bool:
        return self._task is not None

    async def wait_failed(self) -> BaseException:
        """Returns the error that ends the step loop, once one does (the server then exits)."""
        self.start()
        await self._failed.wait()
        return self.failure

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # the loop had died of it (logged, and told to its requests, by _on_loop_exit)
                pass
            self._task = None
        for request_id in list(self._streams):
            self.abort(request_id)
        self.tokenizer_pool.shutdown()
        self._executor.shutdown(wait=True)
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- requests ---------------------------------------------------------------------------------------------

    def check_queue(self, num_seqs: int) -> None:
        """Raises EngineOverloadedError if `num_seqs` more waiting sequences would exceed `max_queue_len`, and
        ParamError if they never could fit. Synchronous, so a caller that adds its requests right after (without an
        await in between) cannot be overtaken."""
        if self._closed_reason is not None:
            raise EngineClosedError(self._closed_reason)
        limit = self.engine.config.args.max_queue_len
        if limit is None:
            return
        if num_seqs > limit:
            raise ParamError(
                "n",
                f"this request asks for {num_seqs} sequences (prompts x n), more than the server's queue "
                f"limit (--max-queue-len {limit}) could ever admit; send fewer prompts or a smaller n",
            )
        waiting = self.engine.core.scheduler.num_waiting
        if waiting + num_seqs > limit:
            raise EngineOverloadedError(
                f"the server is overloaded: {waiting} sequences are already waiting (limit {limit}); retry later",
                retry_after=1,
            )

    async def compile_grammar(self, params: SamplingParams | None) -> None:
        """Waits, off the event loop, for the grammar of the request's structured output to compile (cached: at once
        for a schema seen before); ParamError naming the problem if it does not. No await when it is ready."""
        future = self.engine.grammar_future(params)
        if future is None:
            return
        if not future.done():
            manager = self.engine.core.structured_output
            manager.hold(future)
            try:
                await asyncio.wait([asyncio.wrap_future(future)])
            finally:  # (a client that left: its compile, if still queued and no one else's, is cancelled)
                manager.release(future)
        error = compile_error(future)
        if error is not None:
            raise error

    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
        check_queue: bool = True,
        max_tokens_must_fit: bool = False,
        sink: OutputSink | None = None,
        tag: int = 0,
        grammar_after: int | None = None,
        output_kind: RequestOutputKind | None = RequestOutputKind.DELTA,
    ) -> RequestStream:
        """Validates and queues a request (ValueError for bad input, EngineOverloadedError when the waiting queue is
        full; both before anything is queued). The caller must iterate the returned stream to its end or aclose()
        it: closing early aborts the request. check_queue=False: the caller already called check_queue() for a
        group of requests it adds together. sink/tag: deliver the outputs, tagged, to a sink the caller shares
        between several requests (see OutputSink) instead of a sink of the stream's own. grammar_after: see
        LLMEngine.add_request. output_kind: what the stream's outputs hold; DELTA unless asked (what the server's
        handlers merge, slicing only new text per step), None for the params' own (generate())."""
        self.start()
        if not self.is_running:
            raise EngineDeadError("the engine's step loop is not running")
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = await self.tokenize(prompt)
            else:  # (the dict goes on to the engine: its text and cache salt)
                prompt_token_ids = self.engine.tokenize_prompt(prompt)[1]
        await self.compile_grammar(params)
        if check_queue:
            self.check_queue((params or SamplingParams()).n)
        elif self._closed_reason is not None:
            raise EngineClosedError(self._closed_reason)
        self.engine.add_request(
            request_id, prompt, params, prompt_token_ids=prompt_token_ids, max_tokens_must_fit=max_tokens_must_fit,
            grammar_after=grammar_after, output_kind=output_kind,
        )  # fmt: skip
        stream = RequestStream(self, request_id, sink, tag)
        self._streams[request_id] = stream
        self._wakeup.set()
        self._gate.arrival_ended()
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs as its params' output_kind asks, as vLLM's AsyncLLM.generate: the whole output
        so far each step (CUMULATIVE, the default), only what is new (DELTA), or just the final one (FINAL_ONLY).
        Leaving the loop early (a client that went away) aborts it."""
        stream = await self.add_request(prompt, params, request_id, prompt_token_ids, output_kind=None)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Ends a request now; its stream gets a final output with finish_reason "abort" (and `error`, if given)."""
        out = self.engine.abort_request(request_id, error)
        if out is not None:
            self._deliver([out])

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Pauses a request (it is left out of the steps, keeping its state) or resumes it: a server's flow control
        for a client that stopped reading."""
        self.engine.set_paused(request_id, paused)
        if not paused and self._wakeup is not None:
            self._wakeup.set()

    def abort_all(self, error: str) -> int:
        """Ends every live request with `error` and refuses new ones (the last step of a graceful shutdown).
        Returns how many were ended."""
        self._closed_reason = error
        request_ids = list(self._streams)
        for request_id in request_ids:
            self.abort(request_id, error)
        return len(request_ids)

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    def _release(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)  # no-op if it already finished

    def _deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Hands a step's outputs to their streams (one put each; a stream's consumer wakes once per step) -> []."""
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:
                if out.finished:
                    del streams[out.request_id]
                stream.deliver(out)
        return []

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (LLMEngine.reset_prefix_cache), on the event loop's thread, where steps are
        scheduled and their blocks cached; True."""
        return self.engine.reset_prefix_cache()

    # -- vLLM's profiler hooks (aserve/worker/profiler_hooks.py) ----------------------------------------------

    async def start_profile(self) -> None:
        """Starts the profiler in the step thread, between two steps; RuntimeError without one, or while it runs."""
        settings, runner = require(self.config.profiler), self.engine.core.runner
        await asyncio.get_running_loop().run_in_executor(self._executor, runner.start_profile, settings)

    async def stop_profile(self) -> None:
        """Ends the run (the traces are written when this returns); RuntimeError when none runs."""
        runner = self.engine.core.runner
        await asyncio.get_running_loop().run_in_executor(self._executor, runner.stop_profile)

    # -- the step loop ----------------------------------------------------------------------------------------

    async def intake_turn(self) -> None:
        """Returns when a new request's intake may run without holding up the step worker (intake_gate.py: not while
        the worker waits for the GIL to hand over a step's result, nor while that result waits for the step
        coroutine). The server's handlers call it before their intake."""
        if self.is_running:
            self._gate.arrival_began()
            await self._gate.wait()

    def intake_ended(self) -> None:
        """The server's handler of a request whose intake_turn came has returned."""
        if self._gate is not None:
            self._gate.arrival_ended()

    async def _step_loop(self) -> None:
        """EngineCore's step with its model work in the worker thread (see aserve/engine/core.py).

        A step's outputs reach their streams while the worker runs the next step: with async scheduling the launch of
        step N+1 comes first (the device must not wait for the host) unless it is long (eager layers for a prompt),
        then step N's outputs are handed out and the handlers write them while the worker waits for step N+1."""
        loop = asyncio.get_running_loop()
        engine, core, executor = self.engine, self.engine.core, self._executor
        held: list[RequestOutput] = []  # processed outputs not yet handed to their streams
        gate, launched = self._gate, threading.Event()
        while True:
            core.check_workers()
            if not engine.has_unfinished_requests() or core.all_paused():
                held = self._deliver(held)
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not core.scheduler.num_running and core.inflight is None:
                await gate.settle()  # a burst starting a batch afresh: the rest of it first (intake_gate.py)
            work = core.schedule()
            if work is None:
                held = self._deliver(held)
                await asyncio.sleep(0.001)
                continue
            if self.waits_for_launch and core.launches(work):
                # The loop's thread waits while the worker launches (intake_gate.py: the GIL to itself), for up to
                # LAUNCH_WAIT_S; the previous step's outputs go out after it, or before a long one (a prompt's chunk).
                held = self._deliver(held) if work.eager else held
                launched.clear()
                call = executor.submit(gate.in_worker, core.execute, work, launched.set)
                launched.wait(LAUNCH_WAIT_S)
                self._deliver(held)
                done = await asyncio.wrap_future(call)
            else:
                self._deliver(held)
                done = await loop.run_in_executor(executor, gate.in_worker, core.execute, work)
            gate.open()
            held = engine.process(core.update(work, done))
