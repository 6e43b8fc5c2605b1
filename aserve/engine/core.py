"""The engine core: one step = schedule -> execute (model) -> update (the scheduler applies the result).

    schedule()  the scheduler's next batch (or the retry of a failed one)              event loop / caller
    execute()   the model: forward, sampling, drafting; touches nothing else            worker thread (AsyncEngine)
    update()    Scheduler.update_from_output: tokens, finishes, drafts; stats           event loop / caller

`step()` runs the three in a row (the offline API); AsyncEngine runs `execute` in its worker thread and the other two
on the event loop. Requests are single sequences here (`n` fan-out, text and stop strings are the output processor's);
the core returns, per step, what changed for each sequence (EngineCoreOutput).

Async scheduling (`async_scheduling`, on by default on CUDA): the host work of a step (updating from step N's tokens,
scheduling and preparing step N+1) overlaps the GPU's work instead of alternating with it:

    launch N+1 (its decodes' inputs = N's samples, read on the device) -> wait for N -> update from N -> schedule N+2

A request that step N finishes (EOS, a stop string) has been scheduled in N+1 already: that one extra token is
computed and dropped. Requests with repetition/presence/frequency penalties or structured output (which need every
earlier token id on the host before sampling the next: a grammar's mask is its matcher's state after all of them) turn
the overlap off while they are live (`can_overlap`). With speculative decoding a step that verifies drafts, or after
which drafts are proposed, is updated from before the next one is scheduled; steps in which no request drafts
overlap as without speculation (the adaptive policy holds requests at k = 0 where drafting does not pay; n-gram
speculation asks for no drafts after a step whose token no n-gram can follow: aserve/spec/ngram.py FollowIndex).

Fault isolation: a step that raises ends its request if it carried one; with more, the next step re-runs them one at
a time (same inputs, same KV slots) so that only the request at fault ends. Non-finite logits end only their request
(the scheduler, from the sampler's flag).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from aserve.core.kv_cache_manager import KVCacheManager, cdiv
from aserve.core.metrics import EngineStats
from aserve.core.outputs import EngineCoreOutput, RunnerOutput
from aserve.core.prompt_cap import PromptCap
from aserve.core.request import Request, RequestStatus
from aserve.core.scheduler import Scheduler, SchedulerOutput
from aserve.core.structured_output import StructuredOutputManager
from aserve.distributed.group import TensorParallelError, check_devices
from aserve.distributed.sharding import check_shardable
from aserve.engine.config import EngineConfig
from aserve.kernels import cpu
from aserve.layers.quantization import get_quantization_config
from aserve.models.loader import resolve_quantization
from aserve.spec.policy import SpecPolicy, StepCostModel
from aserve.worker.drafter import ModelDrafter
from aserve.worker.host_memory import retain_freed_memory
from aserve.worker.model_runner import ModelRunner, PendingStep
from aserve.worker.tp_workers import TensorParallelWorkers

logger = logging.getLogger("aserve")

_CPU_DEFAULT_KV_BYTES = 2 << 30


@dataclass(slots=True)
class StepWork:
    """What `execute` is to run: a batch to launch (None with async scheduling when only the step in flight is awaited),
    or a failed batch to re-run one request at a time."""

    sched: SchedulerOutput | None
    overlap: bool = False  # async scheduling: launch without waiting, sampling on the device path
    retry: bool = False

    @property
    def eager(self) -> bool:
        """Does a request compute more than one token (a prompt's chunk, a recomputation, or drafts to verify)? A
        prompt's chunk runs the layers eagerly: a long launch, where a step of single tokens replays CUDA graphs. A
        verification step counts too, though with CUDA graphs it replays one (of up to 1 + drafts tokens a request)."""
        return self.sched is not None and any(s.num_new_tokens > 1 for s in self.sched.scheduled)


@dataclass(slots=True)
class StepResult:
    """What `execute` did. One step at a time: `result` or `error`. Async scheduling: the step it launched
    (`pending`, or the launch's `error`) and the result (or exception) of the step in flight it waited for. Retry:
    each request's result or exception."""

    result: RunnerOutput | None = None
    error: Exception | None = None
    pending: PendingStep | None = None
    prev: RunnerOutput | Exception | None = None
    each: list[tuple[SchedulerOutput, RunnerOutput | Exception]] | None = None


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        args = config.args
        if config.device.type == "cpu":
            retain_freed_memory()
            cpu.load()  # compiled (first start on this machine) or loaded now, never inside a request
        spec = config.spec_config
        runner_args = dict(
            hf_config=config.hf_config,
            model_dir=config.model_dir,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            cuda_graph_sizes=args.cuda_graph_sizes,
            block_size=config.block_size,
            load_format=args.load_format,
            seed=args.seed,
            compile_model=config.device.type == "cpu" and not args.enforce_eager,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
            deterministic=args.deterministic,
            quantize_lm_head=args.quantize_lm_head,
            kv_cache_dtype=args.kv_cache_dtype,
            # A draft model keeps its own cache over the same tables: no block goes back while a request lives. A
            # model drafter's forward reads one block table for all layers: no hybrid layout.
            release_windows=spec is None or spec.method != "draft_model",
            hybrid_kv=spec is None or not spec.needs_kv,
        )
        # Tensor parallelism: ranks 1..N-1 in worker processes, which build their runners alongside this one's
        self.workers = self._start_workers(runner_args) if args.tensor_parallel_size > 1 else None
        try:
            self._build(runner_args)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, runner_args: dict) -> None:
        config, args, workers = self.config, self.config.args, self.workers
        tp = workers.group if workers is not None else None
        self.runner = ModelRunner(**runner_args, device=config.device, tp=tp, workers=workers)
        if workers is not None:
            workers.wait_ready()
        spec = config.spec_config
        if spec is not None and spec.needs_kv:
            self.runner.drafter = ModelDrafter(self.runner, spec, args.seed)
        self.num_kv_blocks = num_blocks = self._num_kv_blocks()
        layout = self.runner.kv_layout
        if num_blocks < (needed := self._blocks_one_request_needs()):
            raise ValueError(
                f"the KV cache has {num_blocks} blocks of {config.block_size} tokens, fewer than the {needed} one "
                f"request of max_model_len ({config.max_model_len}) tokens may hold: it could never run. Give the "
                "cache more memory (gpu_memory_utilization / kv_cache_memory_gb) or lower max_model_len."
            )
        self.runner.allocate_kv_cache(num_blocks + int(layout.any_sliding))  # + the null block
        if self.runner.compiled:
            self.runner.warmup()
        if config.device.type == "cuda" and not args.enforce_eager:
            # Speculative decoding: verification steps (each request's last token and up to k drafts) too
            self.runner.capture_cuda_graphs(1 + spec.num_speculative_tokens if spec is not None else 1)
        if config.device.type == "cuda":  # a step's logits: a row per request, and one per draft it verifies
            self.runner.warm_up_sampler(args.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)))
        self.spec_policy = self._spec_policy()
        self.stats = EngineStats()
        self.structured_output = StructuredOutputManager(config.tokenizer, config.vocab_size, config.eos_token_id)
        if layout.hybrid:
            self.kv_manager = HybridKVCacheManager(num_blocks, config.block_size, layout.group_windows)
        else:
            self.kv_manager = KVCacheManager(num_blocks, config.block_size, layout.group_windows[0])
        self.scheduler = Scheduler(
            self.kv_manager,
            args.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            self.spec_policy,
            config.vocab_size,
            self.stats,
            args.long_prefill_token_threshold,
            self._prompt_cap(),
        )
        self.async_scheduling = config.async_scheduling
        self.inflight: tuple[SchedulerOutput, PendingStep] | None = None  # the launched step not yet updated from
        self._retry: SchedulerOutput | None = None  # a failed batch, re-run one request at a time next
        self._sync_requests: set[str] = set()  # live requests whose sampling needs every token on the host
        self._update_seconds: float | None = None  # host seconds of the last update, and of a launch (moving average)
        self._launch_seconds = 0.0

    def _blocks_one_request_needs(self) -> int:
        """The blocks one request may hold at once, summed over the groups of layers (aserve/core/kv_cache_groups.py):
        its whole length, or in a group that gives back blocks behind its sliding window, those of the window and
        of one step's tokens (drafts included), if fewer."""
        config = self.config
        needed = cdiv(config.max_model_len, config.block_size)
        spec = config.spec_config
        step_tokens = config.max_num_batched_tokens + (spec.num_speculative_tokens if spec is not None else 0)
        return sum(needed if window is None else min(needed, cdiv(window - 1 + step_tokens, config.block_size) + 1)
                   for window in self.runner.kv_layout.group_windows)  # fmt: skip

    def _start_workers(self, runner_args: dict) -> TensorParallelWorkers:
        config, size = self.config, self.config.args.tensor_parallel_size
        spec = config.spec_config
        if spec is not None and spec.needs_kv:
            raise ValueError(f"speculative decoding by {spec.method} cannot run with tensor_parallel_size > 1 yet "
                             "(n-gram speculation can)")  # fmt: skip
        quant = resolve_quantization(config.args.quantization, get_quantization_config(config.hf_config),
                                     config.model_dir)  # fmt: skip
        check_shardable(config.hf_config, size, quant)
        check_devices(config.device, size)
        return TensorParallelWorkers(size, config.device, runner_args)

    def check_workers(self, done: StepResult | None = None) -> None:
        """Tensor parallelism: TensorParallelError (the engine stops) once the ranks can no longer run together: a
        worker exited, or a step failed on rank 0 after the others began it. A failed step first waits briefly for
        a worker's exit to show (its collective may have failed before the process was gone)."""
        if self.workers is None:
            return
        errors = []
        if done is not None:
            errors = [done.error, done.prev, *(result for _, result in done.each or ())]
            errors = [e for e in errors if isinstance(e, Exception)]
        for e in errors:
            if isinstance(e, TensorParallelError):
                self.workers.health.fail(str(e))
        try:
            self.workers.check(grace=1.0 if errors else 0.0)
        except TensorParallelError:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (nothing to do with one rank)."""
        if self.workers is not None:
            self.workers.close()

    def _spec_policy(self) -> SpecPolicy | None:
        cfg = self.config.spec_config
        if cfg is None:
            return None
        cost = None
        if cfg.adaptive:
            drafter = self.runner.drafter
            cost = StepCostModel(self.runner.measure_step_times(), drafter.cost_fraction if drafter else 0.0)
            logger.info("Speculation cost model (step seconds by tokens): %s", dict(zip(cost.sizes, cost.times)))
        return SpecPolicy(cfg, cost, overlap=self.config.async_scheduling)

    def _prompt_cap(self) -> PromptCap | None:
        """--max-decode-slowdown: the prompt cap, on the speculation policy's step-time model if it has one."""
        ratio = self.config.args.max_decode_slowdown
        if not ratio:
            return None
        cost = self.spec_policy.cost if self.spec_policy is not None else None
        if cost is None:
            cost = StepCostModel(self.runner.measure_step_times())
            logger.info("Prompt cap's step-time model (seconds by tokens): %s", dict(zip(cost.sizes, cost.times)))
        cap = PromptCap(cost, ratio, self.config.max_num_batched_tokens, self.config.args.max_num_seqs)
        sizes = [b for b in (1, 16, 64, 256) if b <= self.config.args.max_num_seqs]
        logger.info("Prompt tokens a step that decodes may take, by the batch B of live requests: %s",
                    {b: cap(b) for b in sizes})  # fmt: skip
        return cap

    def _num_kv_blocks(self) -> int:
        args, config = self.config.args, self.config
        per_block = self.runner.kv_bytes_per_block
        if args.num_gpu_blocks_override is not None:
            return args.num_gpu_blocks_override
        if args.kv_cache_budget_bytes is not None:
            return args.kv_cache_budget_bytes // per_block
        if config.device.type == "cuda":
            return self.runner.profile_num_kv_blocks(args.gpu_memory_utilization)
        # CPU: a fixed budget, but no more than every sequence at full length could use.
        useful = args.max_num_seqs * cdiv(config.max_model_len, config.block_size) * self.runner.kv_layout.num_groups
        return min(_CPU_DEFAULT_KV_BYTES // per_block, useful)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the cache holds in every layer: with a hybrid layout, as many as the full-attention groups' share
        of the blocks holds (the sliding groups hold little beside them)."""
        windows = self.runner.kv_layout.group_windows
        return self.num_kv_blocks * self.config.block_size // max(1, sum(w is None for w in windows))

    # -- requests ---------------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if (params.needs_penalties or request.grammar is not None or params.prompt_logprobs is not None
                or request.bad_words_token_ids):  # fmt: skip
            self._sync_requests.add(request.request_id)
        self.scheduler.add_request(request)

    def finish_requests(self, request_ids, error: str | None = None, stopped: bool = False) -> list[EngineCoreOutput]:
        """Ends live requests now and frees their blocks: aborted (a client gone), stopped (a stop string the output
        processor found) or, with `error`, failed. Unknown or finished ids are ignored."""
        if error is not None:
            outputs = self.scheduler.fail_requests(request_ids, error)
        else:
            status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
            outputs = self.scheduler.abort_requests(request_ids, status)
        self._sync_requests.difference_update(request_ids)
        self.stats.flush(self.scheduler, self.kv_manager)  # gauges reflect it even if no step follows
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.inflight is not None or self._retry is not None

    def set_paused(self, request_ids, paused: bool) -> None:
        """Pauses (or resumes) live requests: the scheduler leaves paused ones out of its steps."""
        self.scheduler.set_paused(request_ids, paused)

    def all_paused(self) -> bool:
        """Is there nothing to run until a request is resumed (every live request paused, no step to finish)?"""
        return self.inflight is None and self._retry is None and self.scheduler.all_paused()

    def can_overlap(self) -> bool:
        """May the next step be scheduled before the one in flight is updated from?"""
        return self.async_scheduling and not self._sync_requests

    # -- the step ---------------------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        work = self.schedule()
        if work is None:
            # Nothing to run but grammars compiling: wait for one rather than spin (the offline API's loop).
            futures = [r.grammar.future for r in self.scheduler.waiting_for_grammars()]
            if futures:
                concurrent.futures.wait(futures, timeout=0.1, return_when=concurrent.futures.FIRST_COMPLETED)
            return self.scheduler.take_outputs()
        return self.update(work, self.execute(work))

    def schedule(self) -> StepWork | None:
        """The next work for `execute`, or None: nothing to run (with async scheduling: nothing to launch and no
        step in flight)."""
        self.check_workers()
        if self._retry is not None:
            sched, self._retry = self._retry, None
            live, aborted = [], []  # aborted since the failure: not re-run
            for s in sched.scheduled:
                (aborted if s.request.is_finished else live).append(s)
            self.scheduler.rollback_failed_step(SchedulerOutput(aborted))
            return StepWork(SchedulerOutput(live), retry=True) if live else None
        if not self.async_scheduling:
            sched = self.scheduler.schedule()
            return None if sched.is_empty else StepWork(sched)
        # The step in flight must be updated from first when a request needs every token id on the host, or when it
        # sampled on the host path (its tokens cannot feed the next step on the device).
        # Speculation: a step verifying drafts, or after which drafts are proposed, is updated from before the next
        # is scheduled (the drafts, and the tokens the next step starts from, follow its result).
        t0 = time.perf_counter()
        overlap = self.can_overlap()
        sched = None
        inflight = self.inflight
        if inflight is None or (overlap and inflight[1].feeds_next and not inflight[0].verifies
                                and not inflight[0].drafts_next):  # fmt: skip
            sched = self.scheduler.schedule()
            sched = None if sched.is_empty else sched
        if sched is None and inflight is None:
            return None
        if sched is not None:
            # Verification samples on the host path, and so do steps whose drafts a model proposes.
            overlap = overlap and not sched.verifies and not (sched.drafts_next and self.runner.drafter is not None)
            if inflight is None:
                self._observe_sync_overhead(time.perf_counter() - t0)
        return StepWork(sched, overlap=overlap)

    def _observe_sync_overhead(self, schedule_seconds: float) -> None:
        """A step launched with none in flight: the device idles for the host's update, schedule and launch
        preparation, which async scheduling hides otherwise. The adaptive speculation policy prices drafting with it
        (a step that drafts or verifies is followed by such a step)."""
        cost = self.spec_policy.cost if self.spec_policy is not None else None
        if cost is not None and self.async_scheduling and self._update_seconds is not None:
            cost.observe_sync_overhead(self._update_seconds + schedule_seconds + self._launch_seconds)

    def execute(self, work: StepWork, launched: Callable[[], None] | None = None) -> StepResult:
        """Runs `work` on the model. Touches only the model and the KV tensors (AsyncEngine's worker thread runs it);
        exceptions come back in the result. launched: called once a step is launched (see `launches`), before the
        wait for the step in flight."""
        if work.retry:
            each = []
            for s in work.sched.scheduled:
                one = SchedulerOutput(scheduled=[s])
                try:
                    each.append((one, self._execute_one_step(one)))
                except Exception as e:
                    each.append((one, e))
            return StepResult(each=each)
        if not self.async_scheduling:
            try:
                return StepResult(result=self._execute_one_step(work.sched))
            except Exception as e:
                return StepResult(error=e)
        try:
            done = self.launch(work)
        finally:
            if launched is not None:
                launched()
        return self.wait_inflight(done)

    def launches(self, work: StepWork) -> bool:
        """Does `execute(work)` launch a step without waiting for it (async scheduling, sampling on the device path),
        and then wait for the one in flight, if any? It calls its `launched` in between."""
        return self.async_scheduling and not work.retry and work.sched is not None and work.overlap

    def inflight_finished(self) -> bool:
        """Has the device finished the step in flight (its sampled tokens have reached the host)? False without one
        in flight, and for one whose wait() waits for no device (PendingStep.finished)."""
        return self.inflight is not None and self.inflight[1].finished()

    def launch(self, work: StepWork) -> StepResult:
        """Async scheduling, the first half of `execute`: launches `work.sched` behind the step in flight."""
        done = StepResult()
        if work.sched is not None:
            prev = self.inflight[1] if self.inflight is not None else None
            t0 = time.perf_counter()
            try:
                done.pending = self.runner.launch(work.sched, prev, overlap=work.overlap)
            except Exception as e:
                done.error = e
            if work.overlap:  # host time only: the launch queues the step without waiting for it
                self._launch_seconds += 0.2 * (time.perf_counter() - t0 - self._launch_seconds)
        return done

    def wait_inflight(self, done: StepResult) -> StepResult:
        """Async scheduling, the second half of `execute`: waits for the step in flight (if any)."""
        if self.inflight is not None:
            try:
                done.prev = self.inflight[1].wait()
            except Exception as e:
                done.prev = e
        return done

    def _execute_one_step(self, sched: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        result = self.runner.execute(sched)
        cost = self.spec_policy.cost if self.spec_policy is not None else None
        if cost is not None and all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in sched.scheduled):
            cost.observe(sched.num_tokens, time.perf_counter() - t0)  # a decode/verify step: what the policy prices
        return result

    def update(self, work: StepWork, done: StepResult) -> list[EngineCoreOutput]:
        """Applies what `execute` did (see StepResult) through the scheduler. -> what changed per sequence."""
        t0 = time.perf_counter()
        self.check_workers(done)
        if work.retry:
            outputs = []
            for one, result in done.each:
                outputs += self._fail_step(one, result) if isinstance(result, Exception) else self._update(one, result)
        elif not self.async_scheduling:
            outputs = self._triage(work.sched, done.error) if done.error else self._update(work.sched, done.result)
        else:
            outputs = self._update_overlapped(work, done)
        outputs += self.scheduler.take_outputs()
        self.stats.on_step(work.sched.num_tokens if work.sched is not None else 0, self.scheduler, self.kv_manager)
        if self._sync_requests:
            self._sync_requests.intersection_update(self.scheduler.requests)
        self._update_seconds = time.perf_counter() - t0
        return outputs

    def _update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        try:
            return self.scheduler.update_from_output(sched, result)
        except Exception as e:  # update_from_output isolates per-request faults itself; this is a last resort
            return self._fail_step(sched, e)

    def _update_overlapped(self, work: StepWork, done: StepResult) -> list[EngineCoreOutput]:
        prev, self.inflight = self.inflight, None
        outputs: list[EngineCoreOutput] = []
        launch_error, pending = done.error, done.pending
        if isinstance(done.prev, Exception):
            # The device failed under step N; N+1 (launched on garbage inputs, or not at all) is rolled back.
            if pending is not None:
                try:
                    pending.wait()
                except Exception:
                    pass
            if work.sched is not None:
                self.scheduler.rollback_failed_step(work.sched)
            pending = launch_error = None
            outputs += self._fail_step(prev[0], done.prev)
        elif prev is not None:
            outputs += self._update(prev[0], done.prev)
        if launch_error is not None:
            outputs += self._triage(work.sched, launch_error)
        elif pending is not None:
            self.inflight = (work.sched, pending)
        return outputs

    def _triage(self, sched: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """A step raised. With one request, that request ends; with more, the next step re-runs them one at a time
        to find the one at fault."""
        if len(sched.scheduled) == 1:
            return self._fail_step(sched, error)
        logger.warning("a step of %d requests failed (%r); retrying them one by one", len(sched.scheduled), error)
        self._retry = sched
        return []

    def _fail_step(self, sched: SchedulerOutput, error: BaseException) -> list[EngineCoreOutput]:
        """The model step raised: end the requests it carried with an error; everything else goes on."""
        logger.exception("model step failed; ending its %d requests", len(sched.scheduled), exc_info=error)
        self.scheduler.rollback_failed_step(sched)
        message = f"internal error while running the model: {type(error).__name__}"
        return self.scheduler.fail_requests([s.request.request_id for s in sched.scheduled], message)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def reset_prefix_cache(self) -> None:
        self.kv_manager.reset_prefix_cache()
