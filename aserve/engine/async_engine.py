"""AsyncEngine: the engine driven by a step coroutine on the event loop.

    event loop thread                          step worker thread
    ─────────────────                          ──────────────────
    schedule()  ──── SchedulerOutput ────────▶  execute(): model forward + sampling
       ▲                                              │
    process(): tokens, stop strings, text  ◀── RunnerOutput
    → per-request asyncio.Queue → generate() iterators → HTTP streams

Scheduler and request state are only touched on the loop thread, so they need no locks. An abort frees a
request's blocks at once even while a step that uses them is running: blocks are only handed out again by the next
schedule(), which waits for that step to end — or, with async scheduling, launches a step queued behind it on the
same CUDA stream, so the new owner's writes still come after the old step's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from aserve.config import EngineArgs
from aserve.engine.llm_engine import LLMEngine, PromptType
from aserve.outputs import RequestOutput
from aserve.sampling_params import ParamError, SamplingParams

logger = logging.getLogger("aserve")

_INLINE_TOKENIZE_CHARS = 20_000  # longer prompts are tokenised in a thread, off the event loop


class EngineDeadError(RuntimeError):
    pass


class EngineOverloadedError(RuntimeError):
    """More sequences would wait for a slot than `max_queue_len` allows (HTTP 429). Shedding load at the door keeps
    the latency of admitted requests bounded instead of letting the queue (and every client's wait) grow."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineClosedError(EngineDeadError):
    """The server is shutting down and takes no more requests (HTTP 503)."""


class RequestStream:
    """The outputs of one request, as an async iterator. aclose() before the end aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self.queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            await self.aclose()
            raise
        if isinstance(out, BaseException):
            await self.aclose()
            raise out
        if out.finished:
            self.finished = True
            self.engine._release(self.request_id)
        return out

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine._release(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aserve-step")
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed_reason: str | None = None  # set by abort_all(): no new requests after a forced shutdown

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncEngine:
        from aserve.engine.llm_engine import freeze_for_serving

        engine = LLMEngine(args)
        freeze_for_serving()
        return cls(engine)

    # -- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._step_loop(), name="aserve-step-loop")
            self._task.add_done_callback(self._on_loop_exit)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            logger.error("the engine step loop died", exc_info=error)
            for queue in self._queues.values():
                queue.put_nowait(EngineDeadError(f"the engine stopped: {type(error).__name__}"))

    @property
    def has_started(self) -> bool:
        return self._task is not None

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for request_id in list(self._queues):
            self.abort(request_id)
        self._executor.shutdown(wait=True)

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
        limit = self.engine.args.max_queue_len
        if limit is None:
            return
        if num_seqs > limit:
            raise ParamError(
                "n",
                f"this request asks for {num_seqs} sequences (prompts x n), more than the server's queue "
                f"limit (--max-queue-len {limit}) could ever admit; send fewer prompts or a smaller n",
            )
        waiting = self.engine.scheduler.num_waiting
        if waiting + num_seqs > limit:
            raise EngineOverloadedError(
                f"the server is overloaded: {waiting} sequences are already waiting (limit {limit}); retry later",
                retry_after=1,
            )

    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
        check_queue: bool = True,
    ) -> RequestStream:
        """Validates and queues a request (ValueError for bad input, EngineOverloadedError when the waiting queue is
        full; both before anything is queued). The caller must iterate the returned stream to its end or aclose()
        it: closing early aborts the request. check_queue=False: the caller already called check_queue() for a
        group of requests it adds together."""
        self.start()
        if not self.is_running:
            raise EngineDeadError("the engine's step loop is not running")
        if prompt_token_ids is None:
            if isinstance(prompt, str) and len(prompt) > _INLINE_TOKENIZE_CHARS:
                prompt, prompt_token_ids = await asyncio.to_thread(self.engine.tokenize_prompt, prompt)
            else:
                prompt, prompt_token_ids = self.engine.tokenize_prompt(prompt)
        if check_queue:
            self.check_queue((params or SamplingParams()).n)
        elif self._closed_reason is not None:
            raise EngineClosedError(self._closed_reason)
        self.engine.add_request(request_id, prompt, params, delta=True, prompt_token_ids=prompt_token_ids)
        stream = RequestStream(self, request_id)
        self._queues[request_id] = stream.queue
        self._wakeup.set()
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams deltas of one request. Leaving the loop early (a client that went away) aborts it."""
        stream = await self.add_request(prompt, params, request_id, prompt_token_ids)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Ends a request now; its stream gets a final output with finish_reason "abort" (and `error`, if given)."""
        out = self.engine.abort_request(request_id, error)
        queue = self._queues.get(request_id)
        if out is not None and queue is not None:
            queue.put_nowait(out)

    def abort_all(self, error: str) -> int:
        """Ends every live request with `error` and refuses new ones (the last step of a graceful shutdown).
        Returns how many were ended."""
        self._closed_reason = error
        request_ids = list(self._queues)
        for request_id in request_ids:
            self.abort(request_id, error)
        return len(request_ids)

    @property
    def num_live_requests(self) -> int:
        return len(self._queues)

    def _release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.engine.abort_request(request_id)  # no-op if it already finished

    # -- the step loop ----------------------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            step = self._overlapped_step if engine.async_scheduling else self._step
            outputs = await step(loop)
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)  # let handlers send what just arrived

    async def _step(self, loop) -> list[RequestOutput]:
        engine = self.engine
        sched = engine.schedule()
        if sched.is_empty:
            await asyncio.sleep(0.001)
            return []
        try:
            result = await loop.run_in_executor(self._executor, engine.execute, sched)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed step ends its requests, never the loop
            outputs, retry = engine.triage_failed_step(sched, e)
            return outputs + await self._retry_one_by_one(loop, retry)
        return engine.process_safely(sched, result)

    async def _overlapped_step(self, loop) -> list[RequestOutput]:
        """Async scheduling: the worker launches step N+1 and then waits for step N, whose tokens this thread
        processes while N+1 runs on the GPU (see LLMEngine)."""
        engine = self.engine
        sched = engine.schedule_overlapped()
        if sched is None and engine.inflight is None:
            await asyncio.sleep(0.001)
            return []
        pending, prev_result, launch_error = await loop.run_in_executor(
            self._executor, engine.launch_and_wait_prev, sched
        )
        outputs, retry = engine.complete_overlapped(sched, pending, prev_result, launch_error)
        return outputs + await self._retry_one_by_one(loop, retry)

    async def _retry_one_by_one(self, loop, sched) -> list[RequestOutput]:
        """A failed step's requests, each run alone in the worker thread (see LLMEngine.triage_failed_step)."""
        if sched is None:
            return []
        results = await loop.run_in_executor(self._executor, self.engine.execute_each, sched)
        return self.engine.process_each(results)
