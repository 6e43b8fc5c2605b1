"""Owns the model, the KV cache tensor and the step's input buffers; turns a SchedulerOutput into sampled tokens.

Inputs live in preallocated buffers of the largest size a step can have (max_num_batched_tokens tokens,
max_num_seqs requests): a step fills a prefix of them on the host and copies that prefix to the device, so the
device tensors have stable addresses (what CUDA graphs need).

Async scheduling (`launch(sched, prev)`): step N+1 is prepared and launched while step N still runs on the GPU. A
request decoding in both steps has, as its input in N+1, the token N samples: its slot in the input ids is filled on
the device from N's sampled-token tensor (`_patch_inflight`), so the host never waits for it. The host input
buffers alternate between two sets, so that filling N+1's does not overwrite what N's copies have not read yet.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from aserve.core.kv_cache_manager import cdiv
from aserve.core.outputs import RunnerOutput, SamplerOutput
from aserve.core.scheduler import ScheduledRequest, SchedulerOutput
from aserve.layers.attention import select_attention_backend
from aserve.layers.attention.backend import AttentionMetadata
from aserve.models.loader import build_model
from aserve.worker.cuda_graphs import DecodeGraphs
from aserve.worker.prompt_logprobs import compute_prompt_logprobs
from aserve.worker.sampler import PendingSample, Sampler, list_to_device

logger = logging.getLogger("aserve")


@dataclass(slots=True)
class StepLayout:
    """Shape of a step's flat batch, as written into the host buffers."""

    num_reqs: int
    num_tokens: int = 0
    num_decodes: int = 0
    max_blocks: int = 1
    max_query_len: int = 0
    query_start: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return self.num_tokens == self.num_reqs


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

    def wait(self) -> RunnerOutput:
        if self._result is None:
            self._result = RunnerOutput(self.sampled, self._sample.result())
            self._sample = None
        return self._result


class InputBuffers:
    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"

        def host_set() -> dict[str, torch.Tensor]:
            def host(*shape, dtype):
                return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

            return {
                "input_ids": host(max_tokens, dtype=torch.int64),
                "positions": host(max_tokens, dtype=torch.int64),
                "slot_mapping": host(max_tokens, dtype=torch.int64),
                "query_start_loc": host(max_reqs + 1, dtype=torch.int32),
                "seq_lens": host(max_reqs, dtype=torch.int32),
                "block_tables": host(max_reqs, max_blocks, dtype=torch.int32),
                "logits_indices": host(max_tokens, dtype=torch.int64),
            }

        # Two host sets on a GPU (flip() between async steps); on the CPU the "device" tensors are the host ones.
        self._sets = [host_set(), host_set()] if pin else [host_set()]
        self._np = [{k: v.numpy() for k, v in hs.items()} for hs in self._sets]
        self._current = 0
        self.host, self.np = self._sets[0], self._np[0]
        self.device = {k: v.to(device) for k, v in self.host.items()} if device.type != "cpu" else self.host

    def flip(self) -> None:
        """Switches to the other host set: the copies of the step just launched may still read this one."""
        self._current = (self._current + 1) % len(self._sets)
        self.host, self.np = self._sets[self._current], self._np[self._current]

    def to_device(self, name: str, n: int, cols: int | None = None) -> torch.Tensor:
        src, dst = self.host[name], self.device[name]
        if cols is not None:
            src, dst = src[:n, :cols], dst[:n, :cols]
        else:
            src, dst = src[:n], dst[:n]
        if dst is not src:
            dst.copy_(src, non_blocking=True)
        return dst


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    attn = model.layers[0].self_attn
    return 2 * len(model.layers) * block_size * attn.num_kv_heads * attn.head_dim * dtype.itemsize


def allocate_kv_cache(model, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[num_layers, 2 (K/V), num_blocks, block_size, num_kv_heads, head_dim], zeroed: padded attention reads of
    never-written slots must see finite values."""
    attn = model.layers[0].self_attn
    shape = (len(model.layers), 2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


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
    ) -> None:
        self.hf_config = hf_config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.backend = select_attention_backend(attention_backend, hf_config, dtype, max_num_seqs, device)
        # GPU: every step runs on a dedicated stream (its host sync, reading the sampled tokens, happens in the
        # engine's worker thread, never on the event loop).
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.graphs: DecodeGraphs | None = None
        self.drafter = None  # a model-based speculative proposer (aserve.worker.drafter), set by the engine

        t0 = time.perf_counter()
        self.model = model = build_model(
            hf_config, model_dir, dtype, device, max_model_len, self.backend, load_format, seed, compile_model,
            quantization,
        )  # fmt: skip
        self.compiled = model.ops.compiled
        self.attention_backend = attention_backend
        self.load_time = time.perf_counter() - t0
        self.num_params = sum(p.numel() for p in model.parameters())
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.buffers = InputBuffers(max_num_batched_tokens, max_num_seqs, self.max_blocks_per_seq, device)
        self.sampler = Sampler(device, seed)
        self.kv_caches: torch.Tensor | None = None

    def capture_cuda_graphs(self) -> None:
        if not self.backend.supports_cuda_graphs:
            logger.info("No CUDA graphs: the %s prepares every step on the host", type(self.backend).__name__)
            return
        self.graphs = DecodeGraphs(self, self.max_num_seqs)
        self.graphs.capture()

    # -- KV cache ---------------------------------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        own = kv_bytes_per_block(self.model, self.block_size, self.dtype)
        return own + (self.drafter.kv_bytes_per_block if self.drafter is not None else 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.model, num_blocks, self.block_size, self.dtype, self.device)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)

    def _synthetic_step(self, q_lens: list[int]) -> torch.Tensor:
        """Runs the model on made-up requests (query lengths `q_lens`, no context, decodes first) whose KV goes to
        the first blocks of the cache. For profiling and warm-up only: those blocks hold garbage afterwards, which
        is fine while no request owns them."""
        bs, dev = self.block_size, self.device
        num_decodes = sum(1 for n in q_lens if n == 1)
        assert q_lens[:num_decodes] == [1] * num_decodes
        tables, slots, qsl, first_block = [], [], [0], 0
        for n in q_lens:
            nb = cdiv(n, bs)
            tables.append(list(range(first_block, first_block + nb)))
            slots.extend(first_block * bs + i for i in range(n))
            first_block += nb
            qsl.append(qsl[-1] + n)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            num_tokens=qsl[-1],
            num_decodes=num_decodes,
            slot_mapping=torch.tensor(slots, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(q_lens),
            max_seq_len=max(q_lens),
            max_query_len=max(q_lens),
        )
        self.backend.prepare(meta, bs)
        # Inputs come from the same buffers as in execute(): compiled code is specialised on their kind.
        self.buffers.np["input_ids"][: qsl[-1]] = 0
        self.buffers.np["positions"][: qsl[-1]] = [i for n in q_lens for i in range(n)]
        input_ids = self.buffers.to_device("input_ids", qsl[-1])
        positions = self.buffers.to_device("positions", qsl[-1])
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[torch.tensor(qsl[1:], device=dev) - 1])

    @torch.inference_mode()
    def warmup(self) -> None:
        """Triggers compilation (for steps of 32+ tokens, with and without a residual) so that the first requests
        do not wait for it."""
        n = self.model.ops.min_tokens
        if n > min(self.max_num_batched_tokens, self.max_model_len):
            return  # steps never get big enough to use the compiled code
        t0 = time.perf_counter()
        self._synthetic_step([n])
        logger.info("Warm-up (compilation) took %.1f s", time.perf_counter() - t0)

    @torch.inference_mode()
    def measure_step_times(self, reps: int = 3) -> dict[int, float]:
        """Seconds per step by number of tokens (1, 2, 4, ... up to the budget): the seed of the speculation
        policy's cost model (which then learns from real steps). A step of n tokens is timed as one n-token request;
        the fastest of `reps` runs, after a warm-up run (kernel selection, compilation)."""
        sizes = [1 << i for i in range(12) if (1 << i) <= min(self.max_num_batched_tokens, self.max_model_len, 1024)]
        out = {}
        for n in sizes:
            self._synthetic_step([n])
            self._sync()
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                self._synthetic_step([n])
                self._sync()
                best = min(best, time.perf_counter() - t0)
            out[n] = best
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def profile_num_kv_blocks(self, utilization: float) -> int:
        """GPU: run the largest step once (one prompt of max_num_batched_tokens tokens) to measure peak activation
        memory, then give the KV cache what `utilization` of the device leaves."""
        gc.collect()  # engines dropped earlier in this process (runner <-> CUDA graphs is a cycle) free their memory
        n = min(self.max_num_batched_tokens, self.max_model_len)
        self.allocate_kv_cache(cdiv(n, self.block_size))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        self._synthetic_step([n])
        torch.cuda.synchronize()
        activation_peak = torch.cuda.max_memory_allocated() - baseline
        self.kv_caches = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        budget = int(total * utilization) - (total - free) - activation_peak
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization} "
                f"({(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB, activations need "
                f"{activation_peak / 2**30:.1f} GiB); raise it or lower max_num_batched_tokens"
            )
        return budget // self.kv_bytes_per_block

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
        if overlap:
            self.buffers.flip()
        layout, inflight = self._fill_host(order)
        with self._stream():
            bucket = self.graphs.bucket_for(layout) if self.graphs is not None else None
            patch = (lambda: self._patch_inflight(inflight, prev)) if inflight else None
            meta = None
            if bucket is not None:
                hidden = self.graphs.replay(layout, bucket, patch)
            else:
                meta = self._device_meta(layout)
                self.backend.prepare(meta, self.block_size)
                input_ids = self.buffers.to_device("input_ids", layout.num_tokens)
                positions = self.buffers.to_device("positions", layout.num_tokens)
                if patch is not None:
                    patch()
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            if self.drafter is not None and self.drafter.needs_mirror:
                # A draft model computes its own KV for every token the target just computed.
                if meta is None:
                    meta = self._device_meta(layout)
                n = layout.num_tokens
                self.drafter.mirror(self.buffers.device["input_ids"][:n], self.buffers.device["positions"][:n], meta)
            # Requests asking for prompt logprobs run without overlap (the engine makes sure): scored here, eagerly.
            scores = []
            if sched.scores_prompt:
                scores = compute_prompt_logprobs(self.model, hidden, order, layout.query_start)
            sampled = [s for s in sched.scheduled if s.samples]
            if not sampled:
                return PendingStep([], result=RunnerOutput([], SamplerOutput.empty(), prompt_logprobs=scores))
            # Logits rows, in scheduler order: each sampling request's last known token, then its drafts.
            where = {id(s): i for i, s in enumerate(order)}
            rows = []
            for s in sampled:
                end = layout.query_start[where[id(s)] + 1]
                rows.extend(range(end - 1 - len(s.spec_token_ids), end))
            self.buffers.np["logits_indices"][: len(rows)] = rows
            # In the model's dtype: the sampler widens them to float32 unless a greedy batch needs only the maxima.
            logits = self.model.compute_logits(hidden[self.buffers.to_device("logits_indices", len(rows))], None)
            requests = [s.request for s in sampled]
            if overlap:
                return PendingStep(sampled, self.sampler.launch(logits, requests))
            drafts = [s.spec_token_ids for s in sampled]
            draft_probs = None
            if any(s.request.spec_draft_probs is not None for s in sampled):
                draft_probs = [
                    None if s.request.spec_draft_probs is None else s.request.spec_draft_probs[: len(s.spec_token_ids)]
                    for s in sampled
                ]
            out = self.sampler(logits, requests, drafts if any(drafts) else None, draft_probs)
            result = RunnerOutput(sampled, out, prompt_logprobs=scores)
            if self.drafter is not None:
                result.next_drafts, result.next_draft_probs = self.drafter.propose(sampled, out.token_ids)
        return PendingStep(sampled, result=result)

    def _patch_inflight(self, inflight: list[tuple[int, ScheduledRequest]], prev: PendingStep | None) -> None:
        """Device input ids of the in-flight tokens <- the previous step's sampled tokens (stream-ordered after the
        input copy, before the forward)."""
        if prev is None or prev.tokens is None:
            raise RuntimeError("a step has inputs in flight but no launched step supplies them")
        row_of = {id(s.request): i for i, s in enumerate(prev.sampled)}
        dst = list_to_device([index for index, _ in inflight], self.device, torch.int64)
        src = list_to_device([row_of[id(s.request)] for _, s in inflight], self.device, torch.int64)
        self.buffers.device["input_ids"].index_copy_(0, dst, prev.tokens.index_select(0, src))

    def _stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _fill_host(self, order: list[ScheduledRequest]) -> tuple[StepLayout, list[tuple[int, ScheduledRequest]]]:
        """Writes the flat batch into the host buffers (token ids, positions, slots, block tables, lengths), with
        numpy over whole arrays: at a few hundred requests per step, per-request Python work shows up. Also returns
        the in-flight inputs: (index in the flat batch, request) of each token the previous step has yet to
        deliver (its host value is a 0 placeholder)."""
        buf = self.buffers.np
        bs = self.block_size
        n = len(order)
        q_lens = np.fromiter((s.num_new_tokens for s in order), np.int64, n)
        starts = np.fromiter((s.num_computed_tokens for s in order), np.int64, n)
        query_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start[1:])
        num_tokens = int(query_start[-1])
        # A step's last known input token may still be in flight (async scheduling): the previous step samples it.
        missing = [s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids) > len(s.request.all_token_ids)
                   for s in order]  # fmt: skip
        inflight = [(int(query_start[i + 1]) - 1 - len(s.spec_token_ids), s) for i, s in enumerate(order) if missing[i]]
        if num_tokens == n:  # decode-only: one token each
            buf["input_ids"][:n] = [0 if m else s.request.all_token_ids[s.num_computed_tokens]
                                    for s, m in zip(order, missing)]  # fmt: skip
            positions = starts
        else:
            # Known tokens not yet computed (an in-flight one as a 0 placeholder), then any drafts being verified.
            buf["input_ids"][:num_tokens] = list(
                itertools.chain.from_iterable(
                    itertools.chain(
                        s.request.all_token_ids[
                            s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids)
                        ],
                        (0,) if m else (),
                        s.spec_token_ids,
                    )
                    for s, m in zip(order, missing)
                )
            )
            req_of_token = np.repeat(np.arange(n), q_lens)
            positions = np.arange(num_tokens) - query_start[req_of_token] + starts[req_of_token]
        buf["positions"][:num_tokens] = positions
        # Block tables: all requests' block ids in one scatter. Entries past a request's own blocks keep stale
        # (valid) block ids; nothing reads them unmasked.
        num_blocks = np.fromiter((len(s.block_ids) for s in order), np.int64, n)
        block_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_blocks, out=block_start[1:])
        flat = np.fromiter(itertools.chain.from_iterable(s.block_ids for s in order), np.int32, int(block_start[-1]))
        rows = np.repeat(np.arange(n), num_blocks)
        buf["block_tables"][rows, np.arange(flat.shape[0]) - block_start[rows]] = flat
        req_of_token = np.arange(n) if num_tokens == n else np.repeat(np.arange(n), q_lens)
        block_of_token = buf["block_tables"][req_of_token, positions // bs].astype(np.int64)
        buf["slot_mapping"][:num_tokens] = block_of_token * bs + positions % bs
        seq_lens = starts + q_lens
        buf["query_start_loc"][: n + 1] = query_start
        buf["seq_lens"][:n] = seq_lens

        layout = StepLayout(
            num_reqs=n,
            num_tokens=num_tokens,
            num_decodes=int((q_lens == 1).sum()),
            max_blocks=max(int(num_blocks.max()), 1),
            max_query_len=int(q_lens.max()),
            query_start=query_start.tolist(),
            seq_lens=seq_lens.tolist(),
        )
        return layout, inflight

    def _device_meta(self, layout: StepLayout) -> AttentionMetadata:
        n, t = layout.num_reqs, layout.num_tokens
        return AttentionMetadata(
            num_tokens=t,
            num_decodes=layout.num_decodes,
            slot_mapping=self.buffers.to_device("slot_mapping", t),
            query_start_loc=self.buffers.to_device("query_start_loc", n + 1),
            seq_lens=self.buffers.to_device("seq_lens", n),
            block_tables=self.buffers.to_device("block_tables", n, layout.max_blocks),
            query_start_loc_cpu=layout.query_start,
            seq_lens_cpu=layout.seq_lens,
            max_seq_len=max(layout.seq_lens),
            max_query_len=layout.max_query_len,
        )
