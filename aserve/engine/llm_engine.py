"""The engine: requests in, RequestOutputs out. One step = schedule -> execute (model) -> process (tokens, stop
conditions, text).

`execute` touches only the model and the KV tensors, so AsyncEngine runs it in a worker thread while `schedule` and
`process` stay on the event loop; `step` does all three in a row for the offline API.

Async scheduling (`async_scheduling`, on by default on CUDA): the host work of a step (processing step N's tokens,
scheduling and preparing step N+1) overlaps the GPU's work instead of alternating with it:

    launch N+1 (its decodes' inputs = N's samples, read on the device) -> wait for N -> process N -> schedule N+2 ...

A request that step N finishes (EOS, a stop string) has been scheduled in N+1 already: that one extra token is
computed and dropped. Requests with repetition/presence/frequency penalties (which need every earlier token id on
the host before sampling the next) and speculative decoding turn the overlap off while they are live
(`can_overlap`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from dataclasses import dataclass, field

from aserve.config import EngineArgs, resolve_device, resolve_dtype, resolve_max_model_len
from aserve.core.block_hash import BlockHasher
from aserve.core.kv_cache_manager import InvariantError, KVCacheManager, cdiv
from aserve.core.request import Request, RequestStatus
from aserve.core.scheduler import Scheduler, SchedulerOutput
from aserve.engine.detokenizer import IncrementalDetokenizer
from aserve.engine.stats import EngineStats
from aserve.models.model_path import resolve_model
from aserve.outputs import CompletionOutput, Logprob, RequestOutput
from aserve.sampling_params import ParamError, SamplingParams
from aserve.spec.config import SpeculativeConfig
from aserve.spec.ngram import propose_ngram
from aserve.spec.policy import SpecPolicy, StepCostModel
from aserve.worker.drafter import ModelDrafter
from aserve.worker.host_memory import retain_freed_memory
from aserve.worker.model_runner import ModelRunner, PendingStep, RunnerOutput

logger = logging.getLogger("aserve")

PromptType = str | dict

_CPU_DEFAULT_KV_BYTES = 2 << 30

NON_FINITE_LOGITS = "the model produced non-finite logits (NaN or infinity) for this request"

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


@dataclass(eq=False)
class RequestState:
    """One client request: its `n` child Requests (one sequence each) and what has been reported so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    delta: bool  # stream deltas (AsyncEngine) or report once, cumulatively, when finished (LLM.generate)
    logprobs: list[list[dict[int, Logprob]]] = field(default_factory=list)
    sent_text: list[int] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    finish_sent: list[bool] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        from transformers import AutoConfig, AutoTokenizer

        args.validate()
        self.args = args
        t0 = time.perf_counter()
        model_dir, default_name = resolve_model(args.model)
        self.model_dir = model_dir
        self.served_model_name = args.served_model_name or default_name
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.hf_config, self.device)
        self.max_model_len = resolve_max_model_len(args.max_model_len, self.hf_config)
        self.block_size = args.block_size
        max_num_batched_tokens = args.max_num_batched_tokens or (8192 if self.device.type == "cuda" else 2048)
        self.eos_token_id = _eos_token_id(self.hf_config, self.tokenizer)
        self.vocab_size = self.hf_config.vocab_size

        if self.device.type == "cpu":
            retain_freed_memory()
        self.runner = ModelRunner(
            self.hf_config,
            model_dir,
            self.dtype,
            self.device,
            max_model_len=self.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=self.block_size,
            load_format=args.load_format,
            seed=args.seed,
            compile_model=self.device.type == "cpu" and not args.enforce_eager,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
        )
        self.spec_config = SpeculativeConfig.parse(args.speculative_config)
        if self.spec_config is not None and self.spec_config.needs_kv:
            self.runner.drafter = ModelDrafter(self.runner, self.spec_config, args.seed)
        num_blocks = self._num_kv_blocks()
        min_blocks = cdiv(self.max_model_len, self.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens, fewer than max_model_len "
                f"({self.max_model_len}): one long request could never run. Give the cache more memory "
                "(gpu_memory_utilization / kv_cache_memory_gb) or lower max_model_len."
            )
        self.runner.allocate_kv_cache(num_blocks)
        if self.runner.compiled:
            self.runner.warmup()
        if self.device.type == "cuda" and not args.enforce_eager:
            self.runner.capture_cuda_graphs()
        self.num_kv_blocks = num_blocks
        self.spec_policy = self._spec_policy()
        self.kv_manager = KVCacheManager(num_blocks, self.block_size)
        self.scheduler = Scheduler(
            self.kv_manager, args.max_num_seqs, max_num_batched_tokens, self.max_model_len, self.spec_policy
        )
        self.states: dict[str, RequestState] = {}
        self.child_to_state: dict[str, tuple[RequestState, int]] = {}
        self.async_scheduling = (
            args.async_scheduling if args.async_scheduling is not None else self.device.type == "cuda"
        ) and self.spec_config is None
        self.inflight: tuple[SchedulerOutput, PendingStep] | None = None  # the launched step not yet processed
        self._overlap_next = False  # the next launch samples on the device path (set by schedule_overlapped)
        self._sync_states: set[str] = set()  # live requests whose sampling needs every token on the host
        self.stats = EngineStats()
        self.startup_time = time.perf_counter() - t0
        logger.info(
            "Loaded %s (%s, %.1fM params, %s on %s) in %.1f s; KV cache: %d blocks x %d = %d tokens; "
            "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, prefix caching %s, async scheduling %s",
            self.served_model_name,
            (getattr(self.hf_config, "architectures", None) or ["LlamaForCausalLM"])[0],
            self.runner.num_params / 1e6,
            str(self.dtype).removeprefix("torch."),
            self.device,
            self.startup_time,
            num_blocks,
            self.block_size,
            self.kv_capacity_tokens,
            self.max_model_len,
            args.max_num_seqs,
            max_num_batched_tokens,
            "on" if args.enable_prefix_caching else "off",
            "on" if self.async_scheduling else "off",
        )

    def _spec_policy(self) -> SpecPolicy | None:
        cfg = self.spec_config
        if cfg is None:
            return None
        cost = None
        if cfg.adaptive:
            drafter = self.runner.drafter
            cost = StepCostModel(self.runner.measure_step_times(), drafter.cost_fraction if drafter else 0.0)
            logger.info("Speculation cost model (step seconds by tokens): %s", dict(zip(cost.sizes, cost.times)))
        return SpecPolicy(cfg, cost)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def _num_kv_blocks(self) -> int:
        args = self.args
        per_block = self.runner.kv_bytes_per_block
        if args.num_gpu_blocks_override is not None:
            return args.num_gpu_blocks_override
        if args.kv_cache_memory_gb is not None:
            return int(args.kv_cache_memory_gb * (1 << 30)) // per_block
        if self.device.type == "cuda":
            return self.runner.profile_num_kv_blocks(args.gpu_memory_utilization)
        # CPU: a fixed budget, but no more than every sequence at full length could use.
        useful = args.max_num_seqs * cdiv(self.max_model_len, self.block_size)
        return min(_CPU_DEFAULT_KV_BYTES // per_block, useful)

    # -- requests ---------------------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids' or 'prompt', got {type(prompt)}")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        delta: bool = False,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> RequestState:
        """Validates and queues a request. Raises ValueError (bad input) without changing any state."""
        params = params or SamplingParams()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if request_id in self.states or any(c in self.scheduler.requests for c in child_ids):
            raise ParamError("request_id", f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            prompt_text, prompt_token_ids = self.tokenize_prompt(prompt)
        else:
            prompt_text = prompt if isinstance(prompt, str) else None
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        if params.max_tokens is None:
            params = params.clone(max_tokens=max(1, self.max_model_len - len(prompt_token_ids)))

        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if self.args.enable_prefix_caching:
            hasher = BlockHasher(self.block_size, params.cache_salt)
        elif params.n > 1:  # siblings still share the prompt's blocks, with nobody else
            hasher = BlockHasher(self.block_size, f"group:{id(params)}:{request_id}")
        else:
            hasher = None
        children = []
        detokenizers = []
        for i in range(params.n):
            child_params = (
                params if params.n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            )
            children.append(
                Request(child_ids[i], prompt_token_ids, child_params, self.eos_token_id, hasher, arrival_time)
            )
            detokenizers.append(
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    params.stop_strings,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                )
            )
        state = RequestState(
            request_id,
            prompt_text,
            prompt_token_ids,
            params,
            children,
            detokenizers,
            delta,
            logprobs=[[] for _ in children],
            sent_text=[0] * params.n,
            sent_tokens=[0] * params.n,
            finish_sent=[False] * params.n,
        )
        self.states[request_id] = state
        if params.needs_penalties:
            self._sync_states.add(request_id)
        for i, child in enumerate(children):
            self.child_to_state[child.request_id] = (state, i)
            self.scheduler.add_request(child)
        return state

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ParamError("prompt", "the prompt is empty")
        if n > self.max_model_len:
            raise ParamError(
                "prompt",
                f"the prompt has {n} tokens, more than this model's maximum context length (max_model_len "
                f"{self.max_model_len}); shorten it",
            )
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ParamError("prompt", f"prompt token id {bad!r} is out of range [0, {self.vocab_size})")

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the model: values the step would fail on (which would end every
        request batched with this one)."""
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ParamError("logprobs", f"logprobs must be <= the vocabulary size ({self.vocab_size})")
        if params.seed is not None and not -(2**63) <= params.seed <= 2**63 - params.n:  # sibling i uses seed + i
            raise ParamError("seed", "seed must be a 64-bit signed integer")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ParamError("logit_bias", f"logit_bias token ids must be < the vocabulary size ({self.vocab_size})")

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Ends a request at once and frees its blocks. Returns its final output (finish_reason "abort", with
        `error` as its reason when the server, not the client, ended it)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        if error is not None:
            state.error = error
        now = time.monotonic()
        for child in state.children:
            if not child.is_finished:
                self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)
                self.stats.on_request_finished(child, now)
        self.stats.flush(self.scheduler, self.kv_manager)  # gauges reflect the abort even if no step follows
        out = self._finalize(state)
        if self.args.debug_invariants:
            self.check_invariants()
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.states) or self.inflight is not None

    # -- the step ---------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_overlapped()
        sched = self.schedule()
        if sched.is_empty:
            return []
        try:
            result = self.execute(sched)
        except Exception as e:
            outputs, retry = self.triage_failed_step(sched, e)
            return outputs + (self.process_each(self.execute_each(retry)) if retry is not None else [])
        return self.process(sched, result)

    def _step_overlapped(self) -> list[RequestOutput]:
        """One async-scheduling step, for the offline API: schedule and launch the next step, then wait for and
        process the one before it. AsyncEngine does the same with the waiting in its worker thread."""
        sched = self.schedule_overlapped()
        pending, prev_result, launch_error = self.launch_and_wait_prev(sched)
        outputs, retry = self.complete_overlapped(sched, pending, prev_result, launch_error)
        if retry is not None:
            outputs += self.process_each(self.execute_each(retry))
        return outputs

    def can_overlap(self) -> bool:
        """May the next step be scheduled before the one in flight is processed?"""
        return self.async_scheduling and not self._sync_states

    def schedule_overlapped(self) -> SchedulerOutput | None:
        """The next step to launch, or None: nothing to run, or the step in flight must be processed first (a
        request needs every token id on the host, or the step in flight sampled on the host path, so its tokens
        cannot feed the next step on the device). Decides how the step will sample (`_overlap_next`)."""
        self._overlap_next = self.can_overlap()
        if self.inflight is not None and not (self._overlap_next and self.inflight[1].feeds_next):
            return None
        sched = self.schedule()
        return None if sched.is_empty else sched

    def launch_and_wait_prev(self, sched: SchedulerOutput | None):
        """Launches `sched` (if any) behind the step in flight, then waits for that one's tokens. Touches only the
        model (a worker thread may run it). -> (the new PendingStep, the previous step's RunnerOutput or exception,
        the launch's exception)."""
        pending = launch_error = prev_result = None
        if sched is not None:
            prev = self.inflight[1] if self.inflight is not None else None
            try:
                pending = self.runner.launch(sched, prev, overlap=self._overlap_next)
            except Exception as e:
                launch_error = e
        if self.inflight is not None:
            try:
                prev_result = self.inflight[1].wait()
            except Exception as e:
                prev_result = e
        return pending, prev_result, launch_error

    def complete_overlapped(self, sched, pending, prev_result, launch_error):
        """After launch_and_wait_prev: processes the previous step and makes the new one the step in flight.
        -> (outputs, the step to re-run one request at a time, as triage_failed_step returns)."""
        prev, self.inflight = self.inflight, None
        outputs: list[RequestOutput] = []
        retry = None
        if isinstance(prev_result, Exception):
            # The device failed under step N; N+1 (launched on garbage inputs, or not at all) is rolled back.
            if pending is not None:
                try:
                    pending.wait()
                except Exception:
                    pass
            if sched is not None:
                self.scheduler.rollback_failed_step(sched)
            pending = launch_error = None
            outputs += self.fail_step(prev[0], prev_result)
        elif prev is not None:
            outputs += self.process_safely(prev[0], prev_result)
        if launch_error is not None:
            failed_outputs, retry = self.triage_failed_step(sched, launch_error)
            outputs += failed_outputs
        elif pending is not None:
            self.inflight = (sched, pending)
        return outputs, retry

    def triage_failed_step(self, sched: SchedulerOutput, error: Exception):
        """A step raised. With one request, that request ends (fail_step); with more, the caller re-runs them one at
        a time (execute_each, in the worker thread for AsyncEngine, then process_each) to find the one at fault.
        -> (outputs, the step to re-run or None)."""
        if len(sched.scheduled) == 1:
            return self.fail_step(sched, error), None
        logger.warning("a step of %d requests failed (%r); retrying them one by one", len(sched.scheduled), error)
        return [], sched

    def process_safely(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        try:
            return self.process(sched, result)
        except Exception as e:  # process() isolates per-request faults itself; this is a last resort
            return self.fail_step(sched, e)

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        result = self.runner.execute(sched)
        cost = self.spec_policy.cost if self.spec_policy is not None else None
        if cost is not None and all(s.num_new_tokens == 1 + len(s.spec_token_ids) for s in sched.scheduled):
            cost.observe(sched.num_tokens, time.perf_counter() - t0)  # a decode/verify step: what the policy prices
        return result

    def fail_step(self, sched: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """The model step raised: end the requests it carried with an error; everything else goes on."""
        logger.exception("model step failed; ending its %d requests", len(sched.scheduled), exc_info=error)
        self.scheduler.rollback_failed_step(sched)
        now = time.monotonic()
        touched = []
        for s in sched.scheduled:
            entry = self.child_to_state.get(s.request.request_id)
            if entry is None or entry[0] in touched:  # aborted while the step ran, or already handled
                continue
            state = entry[0]
            self._fail_request(state, f"internal error while running the model: {type(error).__name__}", now)
            touched.append(state)
        self.stats.flush(self.scheduler, self.kv_manager)
        return [out for st in touched if (out := self._finalize(st)) is not None]

    def execute_each(self, sched: SchedulerOutput) -> list[tuple[SchedulerOutput, RunnerOutput | Exception]]:
        """After `sched` failed as a batch: runs its requests one at a time (same inputs, same KV slots), so that a
        fault tied to one request (bad values, an edge case in a kernel) ends that request only. Touches only the
        model, like execute(); a transient fault simply succeeds on the retry."""
        results: list[tuple[SchedulerOutput, RunnerOutput | Exception]] = []
        for s in sched.scheduled:
            one = SchedulerOutput(scheduled=[s])
            try:
                results.append((one, self.execute(one)))
            except Exception as e:
                results.append((one, e))
        return results

    def process_each(self, results: list[tuple[SchedulerOutput, RunnerOutput | Exception]]) -> list[RequestOutput]:
        outputs = []
        for one, result in results:
            if isinstance(result, Exception):
                outputs += self.fail_step(one, result)
            else:
                outputs += self.process(one, result)
        return outputs

    def _fail_request(self, state: RequestState, message: str, now: float) -> None:
        """Ends every sequence of a request with finish_reason "error"; the next output reports `message`."""
        state.error = message
        for child in state.children:  # the whole request fails, siblings included
            if not child.is_finished:
                self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ERROR)
                self.stats.on_request_finished(child, now)

    def process(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        changed: list[RequestState] = []
        out = result.sampler_output
        next_drafts = result.next_drafts or [None] * len(result.sampled)
        next_probs = result.next_draft_probs or [None] * len(result.sampled)
        nonfinite = out.nonfinite or [False] * len(result.sampled)
        for s, token_ids, lps, drafts, probs, bad in zip(result.sampled, out.token_ids, out.logprobs, next_drafts,
                                                         next_probs, nonfinite):  # fmt: skip
            request = s.request
            request.num_inflight -= 1
            if request.is_finished:  # aborted while the step ran (or finished by the step before it)
                continue
            state, index = self.child_to_state[request.request_id]
            if bad:  # its tokens are argmaxes of garbage (in the vocabulary all the same): use none of them
                logger.error("request %s: %s; ending it", state.request_id, NON_FINITE_LOGITS)
                self.kv_manager.forget_uncomputed(request, 0)  # its KV may hold NaNs too: never share it by prefix
                self._fail_request(state, NON_FINITE_LOGITS, now)
                if not changed or changed[-1] is not state:
                    changed.append(state)
                continue
            try:
                self._process_one(s, state, index, token_ids, lps, drafts, probs, now)
            except Exception as e:  # a fault in one request's output (detokenizer, bad token) ends only that request
                logger.exception("processing the output of request %s failed; ending it", state.request_id)
                self._fail_request(state, f"internal error while processing the output: {type(e).__name__}", now)
            if not changed or changed[-1] is not state:
                changed.append(state)
        self.stats.on_step(sched.num_tokens, self.scheduler, self.kv_manager)
        if self.args.debug_invariants:
            self.check_invariants()

        outputs = []
        for state in dict.fromkeys(changed):
            out = self._finalize(state) if state.finished else (self._make_output(state) if state.delta else None)
            if out is not None:
                outputs.append(out)
        return outputs

    def _process_one(self, s, state: RequestState, index: int, token_ids, lps, drafts, probs, now: float) -> None:
        request = s.request
        if s.spec_token_ids:
            num_accepted = len(token_ids) - 1
            self.scheduler.accept_drafts(s, num_accepted)
            self.stats.on_drafts(len(s.spec_token_ids), num_accepted)
            if self.spec_policy is not None:
                self.spec_policy.observe(request, len(s.spec_token_ids), num_accepted)
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.vocab_size:  # e.g. NaN logits; feeding it back would fail the next step
                raise RuntimeError(f"the model produced token id {token_id}, outside the vocabulary")
            self._append_token(request, state, index, token_id, now, lps[i] if lps is not None else None)
            if request.is_finished:
                break
        if not request.is_finished and s.num_draft_next > 0:
            self._set_drafts(request, s.num_draft_next, drafts, probs)

    def _append_token(self, request: Request, state: RequestState, index: int, token_id: int, now: float, lp) -> None:
        self.stats.on_token(request, now)
        finished = self.scheduler.append_token(request, token_id)
        stop = state.detokenizers[index].add_token(token_id)
        if stop is not None:
            request.stop_reason = stop
            if finished:
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        if lp is not None:
            state.logprobs[index].append(self._logprob_dict(lp))
        if request.is_finished:
            self.stats.on_request_finished(request, now)

    def _set_drafts(self, request: Request, k: int, model_drafts, model_probs) -> None:
        """Drafts for the next step: from the model drafter (computed in the step), or n-gram lookup here."""
        if model_drafts is not None:
            request.spec_token_ids, request.spec_draft_probs = model_drafts[:k], model_probs
        else:
            cfg = self.spec_config
            request.spec_token_ids = propose_ngram(
                request.all_token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max
            )

    def _logprob_dict(self, lp) -> dict[int, Logprob]:
        texts = self.tokenizer.batch_decode([[t] for t in lp.token_ids])
        out = {lp.token_ids[0]: Logprob(lp.logprobs[0], lp.sampled_rank, texts[0])}
        for rank, (tid, value, text) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:], texts[1:]), start=1):
            out.setdefault(tid, Logprob(value, rank, text))
        return out

    def _finalize(self, state: RequestState) -> RequestOutput | None:
        if self.states.pop(state.request_id, None) is None:
            return None  # already reported
        self._sync_states.discard(state.request_id)
        for child in state.children:
            self.child_to_state.pop(child.request_id, None)
        return self._make_output(state)

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        completions = []
        for i, (child, detok) in enumerate(zip(state.children, state.detokenizers)):
            finished = child.is_finished
            text_end = detok.streamable_len(finished)
            n_tokens = child.num_output_tokens
            if state.delta:
                if (
                    text_end == state.sent_text[i]
                    and n_tokens == state.sent_tokens[i]
                    and (not finished or state.finish_sent[i])
                ):
                    continue
                text = detok.text[state.sent_text[i] : text_end]
                token_ids = child.output_token_ids[state.sent_tokens[i] :]
                logprobs = state.logprobs[i][state.sent_tokens[i] :] if state.params.logprobs is not None else None
            else:
                text, token_ids = detok.text[:text_end], child.output_token_ids
                logprobs = state.logprobs[i] if state.params.logprobs is not None else None
            state.sent_text[i], state.sent_tokens[i] = text_end, n_tokens
            state.finish_sent[i] = finished
            completions.append(
                CompletionOutput(i, text, token_ids, child.status.finish_reason, child.stop_reason, logprobs)
            )
        if not completions:
            return None
        first = state.children[0]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            num_cached_tokens=max(0, first.num_cached_tokens),
            error=state.error,
        )

    # -- misc -------------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """What `debug_invariants` checks after every step and abort (InvariantError if broken): the request table
        and the scheduler agree (every unfinished sequence of a live request is queued, every queued sequence
        belongs to one), then the scheduler's queues and the KV blocks' ref counts and free list."""
        queued = self.scheduler.requests
        for request_id, (state, index) in self.child_to_state.items():
            if self.states.get(state.request_id) is not state or state.children[index].request_id != request_id:
                raise InvariantError(f"sequence {request_id!r} maps to a request that is not live")
        for state in self.states.values():
            for child in state.children:
                if not child.is_finished and queued.get(child.request_id) is not child:
                    raise InvariantError(f"{child} of live request {state.request_id!r} is unfinished but not queued")
        for request_id in queued:
            if request_id not in self.child_to_state:
                raise InvariantError(f"queued sequence {request_id!r} belongs to no live request")
        self.scheduler.check_invariants()

    def reset_prefix_cache(self) -> None:
        self.kv_manager.reset_prefix_cache()


def _eos_token_id(hf_config, tokenizer) -> int | None:
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
    return eos
