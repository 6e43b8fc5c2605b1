"""Owns the model, the KV cache tensor and the step's input buffers; turns a SchedulerOutput into sampled tokens.

Inputs live in preallocated buffers of the largest size a step can have (max_num_batched_tokens tokens,
max_num_seqs requests): a step fills a prefix of them on the host and copies that prefix to the device, so the
device tensors have stable addresses (what CUDA graphs need).

Async scheduling (`launch(sched, prev)`): step N+1 is prepared and launched while step N still runs on the GPU. A
request decoding in both steps has, as its input in N+1, the token N samples: its slot in the input ids is filled on
the device from N's sampled-token tensor (`_patch_inflight`), so the host never waits for it. The host input
buffers alternate between two sets, so that filling N+1's does not overwrite what N's copies have not read yet.

Tensor parallelism (`tp`: aserve/distributed): every rank has a runner over its part of the model. Rank 0's runs the
engine's calls; before each method that runs the model (a step, profiling, warm-up, CUDA graph capture) it has the
other ranks (`workers`, aserve/worker/tp_workers.py) run the same, so that their forward passes meet in the
collectives. A step reaches them as a StepPlan: the host buffers rank 0 filled and what the device part needs beyond
them. Only rank 0 samples; with async scheduling it broadcasts the sampled tokens, which the workers' next step reads
its in-flight inputs from.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from aserve import envs
from aserve.core.kv_cache_groups import plan_kv_groups
from aserve.core.kv_cache_manager import cdiv
from aserve.core.outputs import RunnerOutput, SamplerOutput
from aserve.core.scheduler import ScheduledRequest, SchedulerOutput
from aserve.distributed.group import TensorParallelError, TensorParallelGroup
from aserve.distributed.sharding import TensorParallelSharding, rank_attention_config
from aserve.layers.attention import select_attention_backend
from aserve.layers.attention.backend import AttentionMetadata, split_groups
from aserve.layers.attention.backend import kv_cache_dtype as kv_cache_format
from aserve.models.loader import build_model
from aserve.worker import profiling
from aserve.worker.batch_invariant_sampler import BatchInvariantSampler
from aserve.worker.cuda_graphs import StepGraphs
from aserve.worker.draft_tokens import DraftTokens
from aserve.worker.host_batch import fill_host
from aserve.worker.input_buffers import InputBuffers
from aserve.worker.piecewise_graphs import PiecewiseGraphs
from aserve.worker.profiler_hooks import Profiler, ProfilerSettings
from aserve.worker.prompt_logprobs import compute_prompt_logprobs, prompt_logits_rows
from aserve.worker.sampler import PendingSample, Sampler, list_to_device
from aserve.worker.step_plan import StepLayout, StepPlan

logger = logging.getLogger("aserve")


class PendingStep:
    """A launched step whose sampled tokens may not have reached the host yet. With async scheduling `tokens`
    (device, one per sampling request, in `sampled` order) is what the next step's in-flight inputs are read from;
    wait() -> RunnerOutput."""

    __slots__ = ("sampled", "tokens", "_sample", "_result")

    def __init__(self, sampled, sample: PendingSample | None = None, result: RunnerOutput | None = None) -> None:
        self.sampled: list[ScheduledRequest] = sampled
        self.tokens: torch.Tensor | None = sample.tokens if sample is not None else None
        self._sample, self._result = sample, result

    @property
    def feeds_next(self) -> bool:
        """Can a step launched behind this one read its sampled tokens on the device (or does it sample none)?"""
        return self.tokens is not None or not self.sampled

    def finished(self) -> bool:
        """Has the device finished sampling it? (False where wait() waits for no device: nothing sampled, or a
        result computed at launch.)"""
        sample = self._sample  # (read once: the worker thread's wait() drops it)
        return sample is not None and sample.finished()

    def wait(self) -> RunnerOutput:
        if self._result is None:
            self._result = RunnerOutput(self.sampled, self._sample.result())
            self._sample = None
        return self._result


def _cache_dims(model, num_slots: int | None) -> tuple[int, int, int]:
    """(slots: `num_slots`, default one per layer; KV heads; head dim) of the model's KV cache."""
    attn = model.layers[0].self_attn
    return len(model.layers) if num_slots is None else num_slots, attn.num_kv_heads, attn.head_dim


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype, num_slots: int | None = None) -> int:
    """Bytes of one block id: its block in each of the cache's `num_slots` slots (default: one per layer)."""
    slots, heads, head_dim = _cache_dims(model, num_slots)
    return 2 * slots * block_size * heads * head_dim * dtype.itemsize


def allocate_kv_cache(model, num_blocks: int, block_size: int, dtype: torch.dtype, device,
                      num_slots: int | None = None) -> torch.Tensor:  # fmt: skip
    """[num_slots (default: one per layer), 2 (K/V), num_blocks, block_size, num_kv_heads, head_dim], zeroed: padded
    attention reads of never-written slots must see finite values."""
    slots, heads, head_dim = _cache_dims(model, num_slots)
    return torch.zeros((slots, 2, num_blocks, block_size, heads, head_dim), dtype=dtype, device=device)


class ModelRunner:
    def __init__(
        self,
        hf_config,
        model_dir: str,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_size: int,
        load_format: str,
        seed: int,
        compile_model: bool = False,
        attention_backend: str = "auto",
        quantization: str | None = None,
        tp: TensorParallelGroup | None = None,
        workers=None,
        deterministic: bool = False,
        quantize_lm_head: bool = False,
        kv_cache_dtype: str = "auto",
        release_windows: bool = True,
        hybrid_kv: bool = True,
        cuda_graph_sizes: list[int] | None = None,
    ) -> None:
        self.hf_config = hf_config
        self.dtype = dtype
        # The KV cache's element type (an FP8 cache: one byte per element), read and written by the backend
        self.kv_format = kv_format = kv_cache_format(kv_cache_dtype)
        self.kv_dtype = kv_format.cache_dtype(dtype)
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.cuda_graph_sizes = cuda_graph_sizes  # None: cuda_graphs.py's buckets
        # Tensor parallelism: this rank's group; on rank 0, the other ranks (TensorParallelWorkers)
        self.tp, self.workers = tp, workers
        self._shared_tokens: torch.Tensor | None = None  # a worker: the tokens rank 0 sampled in the last step
        rank_config = hf_config if tp is None else rank_attention_config(hf_config, tp.size)
        # Deterministic mode: batch-invariant attention, layers and sampling (aserve/layers/batch_invariant.py)
        self.deterministic = deterministic
        self.backend = select_attention_backend(attention_backend, rank_config, dtype, max_num_seqs, device,
                                                deterministic, max_model_len, kv_format)  # fmt: skip
        # GPU: every step runs on a dedicated stream (its host sync, reading the sampled tokens, happens in the
        # engine's worker thread, never on the event loop).
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.graphs: StepGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None  # mixed steps' graphs (aserve/worker/piecewise_graphs.py)
        self.drafter = None  # a model-based speculative proposer (aserve.worker.drafter), set by the engine

        t0 = time.perf_counter()
        self.model = model = build_model(
            hf_config, model_dir, dtype, device, max_model_len, self.backend, load_format, seed, compile_model,
            quantization, TensorParallelSharding(tp) if tp is not None else None, deterministic, quantize_lm_head,
        )  # fmt: skip
        self.compiled = model.ops.compiled
        self.attention_backend = attention_backend
        self.load_time = time.perf_counter() - t0
        self.num_params = sum(p.numel() for p in model.parameters())
        # Which layers share block tables (one group unless sliding and full layers interleave), chosen once here
        windows = [layer.self_attn.attn_params.sliding_window for layer in model.layers]
        self.kv_layout = plan_kv_groups(windows, release_windows, hybrid_kv and model.supports_kv_groups)
        if self.kv_layout.hybrid:
            model.set_kv_layout(self.kv_layout)
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.buffers = InputBuffers(max_num_batched_tokens, max_num_seqs, self.max_blocks_per_seq, device,
                                    self.kv_layout.num_groups)  # fmt: skip
        self.sampler = (BatchInvariantSampler if deterministic else Sampler)(device, seed)
        self.kv_caches: torch.Tensor | None = None
        self.profiler: Profiler | None = None  # a profiling run (start_profile .. stop_profile)

    def start_profile(self, settings: ProfilerSettings) -> None:
        """vLLM's profiler hooks (aserve/worker/profiler_hooks.py) on every rank, between two steps."""
        if self.profiler is not None:
            raise RuntimeError("the profiler is already running: stop_profile first")
        self._on_every_rank("start_profile", settings)
        self.profiler = Profiler(settings, self.tp.rank if self.tp is not None else 0)
        self.profiler.start()

    def stop_profile(self) -> None:
        """Ends every rank's run; their traces are written when this returns on rank 0."""
        if self.profiler is None:
            raise RuntimeError("the profiler is not running: start_profile first")
        self._on_every_rank("stop_profile")
        profiler, self.profiler = self.profiler, None
        profiler.stop()

    def _on_every_rank(self, method: str, *args) -> None:
        """Rank 0 of a tensor-parallel engine: the other ranks run `method` too (their runners' own)."""
        if self.workers is not None:
            self.workers.call(method, *args)

    def capture_cuda_graphs(self, max_query_len: int = 1) -> None:
        """Graphs of decode steps and, with max_query_len > 1 (speculative decoding: 1 + the most drafts), of
        verification steps; a model drafter's one-token steps join them (aserve/worker/cuda_graphs.py)."""
        self._on_every_rank("capture_cuda_graphs", max_query_len)
        if not self.backend.supports_cuda_graphs:
            logger.info("No CUDA graphs: the %s prepares every step on the host", type(self.backend).__name__)
            return

        def forward(input_ids, positions, meta):
            return self.model(input_ids, positions, self.kv_caches, meta)

        self.graphs = StepGraphs(self, forward, self.backend, self.max_num_seqs, max_query_len)
        pool = self.graphs.capture()
        # Mixed steps in pieces around attention; not where a drafter reads the forward's layers (layer_skip, a
        # draft model's mirror) or in deterministic mode (its batch-invariant layers stay eager there)
        if self.drafter is None and not self.deterministic and envs.ASERVE_PIECEWISE_GRAPHS:
            self.piecewise = PiecewiseGraphs(self, forward, self.backend, self.max_num_batched_tokens)
            self.piecewise.capture(pool, self.graphs.idle_inputs)
        if self.drafter is not None:
            self.drafter.capture_cuda_graphs(pool)

    # -- KV cache ---------------------------------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        own = kv_bytes_per_block(self.model, self.block_size, self.kv_dtype, self.kv_layout.num_slots)
        return own + (self.drafter.kv_bytes_per_block if self.drafter is not None else 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._on_every_rank("allocate_kv_cache", num_blocks)
        self.kv_caches = allocate_kv_cache(self.model, num_blocks, self.block_size, self.kv_dtype, self.device,
                                           self.kv_layout.num_slots)  # fmt: skip
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Triggers compilation so that the first requests do not wait for it (worker/profiling.py)."""
        self._on_every_rank("warmup")
        profiling.warmup(self)

    @torch.inference_mode()
    def warm_up_sampler(self, max_logits_rows: int = 1) -> None:
        """Compiles what sampling launches (a GPU: the greedy pick's Triton kernels) on the logits of made-up rows,
        and the head's kernels (a quantised head's Triton GEMV / GEMMs, a model drafter's int8 head) at every row
        count class up to `max_logits_rows` (profiling.warm_up_rows), so that no request waits for a compilation:
        a step's logits rows vary with its batch, outside the CUDA graphs."""
        self._on_every_rank("warm_up_sampler", max_logits_rows)
        hidden = torch.zeros(max_logits_rows, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        with self._stream():
            for rows in profiling.warm_up_rows(max_logits_rows):
                logits = self.model.compute_logits(hidden[:rows], None)
            if self.tp is None or self.tp.rank == 0:
                self.sampler.warm_up(logits[:1])
            if self.drafter is not None and self.drafter.lm_head is not None:  # its drafts: a row per request
                for rows in profiling.warm_up_rows(min(max_logits_rows, self.max_num_seqs)):
                    self.model.compute_logits(hidden[:rows], None, self.drafter.lm_head)

    @torch.inference_mode()
    def measure_step_times(self, reps: int = 3) -> dict[int, float]:
        """Seconds per step by number of tokens (worker/profiling.py)."""
        self._on_every_rank("measure_step_times", reps)
        return profiling.measure_step_times(self, reps)

    @torch.inference_mode()
    def profile_num_kv_blocks(self, utilization: float) -> int:
        """The KV cache's number of blocks at `utilization` of the GPU's memory (worker/profiling.py)."""
        self._on_every_rank("profile_num_kv_blocks", utilization)
        return profiling.profile_num_kv_blocks(self, utilization)

    # -- the step ---------------------------------------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.launch(sched).wait()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: PendingStep | None = None, overlap: bool = False) -> PendingStep:
        """Launches the step. overlap=True (async scheduling): nothing here waits for the device; the sampled tokens
        come back through PendingStep.wait(), and `prev` (the step still running) supplies the inputs of requests
        whose last token it samples. No drafts or penalties then (the engine makes sure): those need the host to
        know every earlier token."""
        # Shortest queries first (decodes, then speculative verification, then prompts): backends batch them.
        order = sorted(sched.scheduled, key=lambda s: s.num_new_tokens)
        # A model drafter's drafts still being computed: the verification's inputs take them on the device (one
        # rank: a tensor-parallel worker runs from the host buffers), so it is launched behind the drafting.
        drafts_on_device = self.workers is None and any(isinstance(s.spec_token_ids, DraftTokens) for s in order)
        if overlap or drafts_on_device:  # the drafting's input copies may not have read the host buffers yet
            self.buffers.flip()
        batch = fill_host(self.buffers.np, order, self.block_size, self.kv_layout.num_groups, drafts_on_device)
        layout, inflight = batch.layout, batch.inflight
        # layer_skip: a step verifying nothing but one drafting's drafts resumes the target from its hidden states
        resume = self.drafter.resume_sources(order) if drafts_on_device and self.drafter is not None else None
        sampled = [s for s in sched.scheduled if s.samples]
        # Logits rows, in scheduler order: each sampling request's last known token, then its drafts.
        where = {id(s): i for i, s in enumerate(order)}
        rows = []
        for s in sampled:
            end = layout.query_start[where[id(s)] + 1]
            rows.extend(range(end - 1 - len(s.spec_token_ids), end))
        self.buffers.np["logits_indices"][: len(rows)] = rows
        plan = StepPlan(layout, overlap, *self._inflight_rows(inflight, prev), len(rows),
                        share_tokens=overlap and bool(sampled) and self.tp is not None)  # fmt: skip
        if sched.scores_prompt:
            plan.prompt_logits_rows = prompt_logits_rows(order, layout.query_start)
        if self.workers is not None:
            self.workers.call("replay_step", plan.with_host(self.buffers.np))
        with self._stream():
            try:
                hidden, meta, key = self._forward(plan, prev.tokens if prev is not None else None, batch.drafts,
                                                  resume)  # fmt: skip
                if self.drafter is not None and self.drafter.needs_mirror:
                    self._mirror(layout, meta, key)
                # Requests asking for prompt logprobs run without overlap (the engine makes sure): scored here.
                scores = []
                if sched.scores_prompt:
                    scores = compute_prompt_logprobs(self.model, hidden, order, layout.query_start)
                if not sampled:
                    return PendingStep([], result=RunnerOutput([], SamplerOutput.empty(), prompt_logprobs=scores))
                # In the model's dtype: the sampler widens them to float32 unless a greedy batch needs only the maxima.
                logits = self.model.compute_logits(hidden[self.buffers.to_device("logits_indices", len(rows))], None)
            except Exception as e:
                if self.tp is None:
                    raise
                # The other ranks began this step: they wait in collectives this rank never reaches.
                raise TensorParallelError(f"a step failed on rank 0 after the other ranks began it: {e!r}") from e
            requests = [s.request for s in sampled]
            if overlap:
                pending = None
                try:
                    pending = self.sampler.launch(logits, requests)
                finally:
                    if plan.share_tokens:  # the workers' next step reads its in-flight inputs from them
                        tokens = pending.tokens if pending is not None else torch.zeros(len(rows), device=self.device)
                        self.tp.broadcast_(tokens.to(torch.int64))
                return PendingStep(sampled, pending)
            drafts = [s.spec_token_ids for s in sampled]
            draft_probs = None
            if any(s.request.spec_draft_probs is not None for s in sampled):
                draft_probs = [
                    None if s.request.spec_draft_probs is None else s.request.spec_draft_probs[: len(s.spec_token_ids)]
                    for s in sampled
                ]
            proposed = []  # the drafter's (drafts, draft distributions), launched inside the sampler's call

            def propose(accepted: torch.Tensor, last: torch.Tensor) -> None:
                proposed.append(self.drafter.propose(sampled, accepted, last))

            out = self.sampler(logits, requests, drafts if any(drafts) else None, draft_probs,
                               on_emitted=propose if self.drafter is not None else None)  # fmt: skip
            result = RunnerOutput(sampled, out, prompt_logprobs=scores)
            if proposed:
                result.next_drafts, result.next_draft_probs = proposed[0]
        return PendingStep(sampled, result=result)

    @torch.inference_mode()
    def replay_step(self, plan: StepPlan) -> None:
        """A tensor-parallel worker's part of a step rank 0 launched: the same forward and logits (gathered on rank
        0, which samples), and with async scheduling the sampled tokens rank 0 broadcasts."""
        if plan.overlap:
            self.buffers.flip()
        for name, values in plan.host.items():
            self.buffers.np[name][tuple(slice(0, n) for n in values.shape)] = values
        with self._stream():
            hidden, _, _ = self._forward(plan, self._shared_tokens)
            for row, n in plan.prompt_logits_rows:
                self.model.compute_logits(hidden[row : row + n])
            if plan.num_logits_rows:
                self.model.compute_logits(hidden[self.buffers.to_device("logits_indices", plan.num_logits_rows)], None)
            if plan.share_tokens:
                tokens = torch.empty(plan.num_logits_rows, dtype=torch.int64, device=self.device)
                self._shared_tokens = self.tp.broadcast_(tokens)

    def _forward(self, plan: StepPlan, prev_tokens: torch.Tensor | None, drafts: list | None = None, resume=None):
        """Host buffers -> device, in-flight inputs patched from `prev_tokens` and drafts from the drafter's device
        tensor (`drafts`: HostBatch.drafts), the model (a CUDA graph's replay for decode and verification steps it
        covers; `resume`: the drafter's resume_sources, from which it runs the layers after the draft's). ->
        (hidden states, the attention metadata of an eager forward or None, the graph's key or None)."""
        layout = plan.layout
        graphs = self.graphs if resume is None else self.drafter.resume_graphs
        key = None
        if graphs is not None:
            key = graphs.key_for(layout.num_reqs, layout.num_tokens, layout.max_query_len)
        patch = None
        if plan.inflight_dst or drafts or resume:

            def patch():
                if plan.inflight_dst:
                    self._patch_inflight(plan.inflight_dst, plan.inflight_src, prev_tokens)
                if drafts:
                    self._patch_drafts(drafts)
                if resume and key is not None:  # the graph's input hidden states
                    self.drafter.resume_rows(resume, graph=True)

        if key is not None:
            return graphs.replay(layout, key, patch), None, key
        bucket = self.piecewise.bucket_for(layout) if self.piecewise is not None and not resume else None
        if bucket is not None:  # the padding copies the step's tokens and request arrays
            self.piecewise.pad(layout.num_reqs, layout.num_tokens, bucket)
        meta = self._device_meta(layout, copied=bucket is not None)
        self.backend.prepare_groups(meta, self.block_size)
        if bucket is not None:
            if patch is not None:
                patch()
            return self.piecewise.run(bucket, layout.num_tokens, meta), meta, None
        input_ids = self.buffers.to_device("input_ids", layout.num_tokens)
        positions = self.buffers.to_device("positions", layout.num_tokens)
        if patch is not None:
            patch()
        resumed = {}
        if resume:  # layer_skip: the layers after the draft's, from the drafting's hidden states
            resumed = dict(start_layer=self.drafter.num_layers, start_hidden=self.drafter.resume_rows(resume, False))
        return self.model(input_ids, positions, self.kv_caches, meta, **resumed), meta, None

    def _mirror(self, layout: StepLayout, meta: AttentionMetadata | None, key: tuple[int, int] | None) -> None:
        """A draft model computes its own KV for every token the target just computed: the same CUDA graph shape
        where the target replayed one (its padded inputs are still in the device buffers), else eagerly."""
        if key is not None and self.drafter.mirror_graph(key):
            return
        if meta is None:
            meta = self._device_meta(layout)
        n = layout.num_tokens
        self.drafter.mirror(self.buffers.device["input_ids"][:n], self.buffers.device["positions"][:n], meta)

    @staticmethod
    def _inflight_rows(inflight: list[tuple[int, ScheduledRequest]], prev: PendingStep | None):
        """(flat-batch slots, rows of the previous step's sampled tokens) of the in-flight inputs."""
        if not inflight:
            return [], []
        if prev is None or prev.tokens is None:
            raise RuntimeError("a step has inputs in flight but no launched step supplies them")
        row_of = {id(s.request): i for i, s in enumerate(prev.sampled)}
        return [index for index, _ in inflight], [row_of[id(s.request)] for _, s in inflight]

    def _patch_inflight(self, dst: list[int], src: list[int], tokens: torch.Tensor) -> None:
        """Device input ids of the in-flight tokens <- the previous step's sampled tokens (stream-ordered after the
        input copy, before the forward)."""
        dst_t = list_to_device(dst, self.device, torch.int64)
        src_t = list_to_device(src, self.device, torch.int64)
        self.buffers.device["input_ids"].index_copy_(0, dst_t, tokens.index_select(0, src_t))

    def _patch_drafts(self, drafts: list) -> None:
        """Device input ids of the drafts being verified <- the drafter's device tensors, as _patch_inflight patches
        (stream-ordered after the drafting and the input copy, before the forward)."""
        by_source: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for first, spec in drafts:
            tokens, column, count = spec.device_source()
            _, dst, src = by_source.setdefault(id(tokens), (tokens, [], []))
            dst.extend(range(first, first + count))
            src.extend(j * tokens.shape[1] + column for j in range(count))  # tokens [k_max, requests]
        for tokens, dst, src in by_source.values():
            self._patch_inflight(dst, src, tokens.reshape(-1))

    def _stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _device_meta(self, layout: StepLayout, copied: bool = False) -> AttentionMetadata:
        """The step's attention metadata over the device buffers; copied: its slots and request arrays are already
        there (the pieces' padding copied them), only the block tables are copied."""
        n, t = layout.num_reqs, layout.num_tokens
        b = self.buffers
        view = (lambda name, k: b.device[name][..., :k]) if copied else b.to_device
        meta = AttentionMetadata(
            num_tokens=t,
            num_decodes=layout.num_decodes,
            slot_mapping=view("slot_mapping", t),
            query_start_loc=view("query_start_loc", n + 1),
            seq_lens=view("seq_lens", n),
            block_tables=b.to_device("block_tables", n, layout.max_blocks),
            query_start_loc_cpu=layout.query_start,
            seq_lens_cpu=layout.seq_lens,
            max_seq_len=max(layout.seq_lens),
            max_query_len=layout.max_query_len,
        )
        return split_groups(meta)
