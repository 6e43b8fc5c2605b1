"""The engine as the offline API and the server's AsyncEngine use it: requests in, RequestOutputs out.

    add_request:  InputProcessor (tokenise, validate, n sequences)  -> EngineCore.add_request, OutputProcessor
    step:         EngineCore.step (schedule -> execute -> update)   -> OutputProcessor.process -> RequestOutputs
    abort:        EngineCore.finish_requests                        -> OutputProcessor.process

Endings the output processor finds (stop strings, faults in a request's output, a sequence whose siblings failed)
go back to the core in `_process`, before anything else is scheduled.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

from aserve.config import EngineArgs
from aserve.core.kv_cache_manager import InvariantError
from aserve.core.outputs import EngineCoreOutput
from aserve.engine.config import EngineConfig
from aserve.engine.core import EngineCore
from aserve.engine.input_processor import InputProcessor, PromptType
from aserve.engine.output_processor import OutputProcessor
from aserve.outputs import RequestOutput
from aserve.sampling_params import ParamError, SamplingParams

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
        self.input_processor = InputProcessor(config)
        self.output_processor = OutputProcessor(config.tokenizer)
        self.startup_time = time.perf_counter() - t0
        runner = self.core.runner
        logger.info(
            "Loaded %s (%s, %.1fM params, %s on %s) in %.1f s; KV cache: %d blocks x %d = %d tokens; "
            "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, prefix caching %s, async scheduling %s",
            config.served_model_name,
            config.architecture,
            runner.num_params / 1e6,
            str(config.dtype).removeprefix("torch."),
            config.device,
            self.startup_time,
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

    # -- requests ---------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        delta: bool = False,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        max_tokens_must_fit: bool = False,
    ) -> None:
        """Validates and queues a request. Raises ValueError (bad input) without changing any state.
        max_tokens_must_fit: see InputProcessor.process."""
        params = params or SamplingParams()
        if self.output_processor.has_request(request_id):
            raise ParamError("request_id", f"request id {request_id!r} is already in use")
        if prompt_token_ids is None:
            prompt_text, prompt_token_ids = self.input_processor.tokenize_prompt(prompt)
        else:
            prompt_text = prompt if isinstance(prompt, str) else None
        params, sequences = self.input_processor.process(
            request_id, prompt_token_ids, params, arrival_time, max_tokens_must_fit
        )
        if any(s.request_id in self.core.scheduler.requests for s in sequences):
            raise ParamError("request_id", f"request id {request_id!r} is already in use")
        sequence_ids = [s.request_id for s in sequences]
        self.output_processor.add_request(request_id, prompt_text, prompt_token_ids, params, sequence_ids, delta)
        for sequence in sequences:
            self.core.add_request(sequence)

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Ends a request at once and frees its blocks. Returns its final output (finish_reason "abort", with
        `error` as its reason when the server, not the client, ended it), or None for an unknown or finished one."""
        sequence_ids = self.output_processor.live_sequence_ids(request_id, error)
        outputs = self._process(self.core.finish_requests(sequence_ids))
        if self.config.args.debug_invariants:
            self.check_invariants()
        return next((out for out in outputs if out.request_id == request_id), None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states) or self.core.has_unfinished()

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

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()
