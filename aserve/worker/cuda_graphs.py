"""CUDA graphs of decode and verification steps, one per (requests, tokens) bucket.

A decode step of n requests (one query token each) replays the graph of (B, B), B the smallest request bucket >= n.
With speculative decoding of up to k drafts, a step whose queries are all at most k + 1 tokens long (each request's
last token and its drafts: verification) replays the graph of (B, B * Q), Q = ceil(tokens / B) in 2..k+1. Its
attention tiles fit queries of up to k + 1 tokens and each request's query range is read from query_start_loc, so
any mix of draft counts fits one graph.

Padding: tokens past the step's are token 0 at position 0 with slot -1 (the cache write skips them); requests past
the step's have sequence length 0 and an empty query range (attention returns at once). Graphs are captured from
the most tokens down, sharing one memory pool (a model drafter's graphs join it). A graph covers the model forward
(hidden states); the final norm, lm_head and sampling run eagerly on the rows that sample.

    host buffers --(H2D copy of [:T])--> device buffers --graph replay--> hidden[:T]
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from aserve.layers.attention.backend import AttentionMetadata, split_groups

logger = logging.getLogger("aserve")

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Verification graphs cover steps of up to this many requests: beyond it a verification step's GPU work hides the
# host's launches (and drafting seldom pays there).
VERIFY_MAX_REQUESTS = 64

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(cuda_graph_sizes: list[int] | None, limit: int) -> list[int]:
    """The request buckets of the decode graphs, none past `limit` (the most requests a step holds): vLLM's
    cuda_graph_sizes (one value N: 1, 2, 4 and each multiple of 8 up to N; several: those), else _BUCKETS; a size
    past the limit becomes the limit, the limit one where no size is given."""
    if cuda_graph_sizes is None:
        sizes = [*_BUCKETS, limit]
    elif len(cuda_graph_sizes) == 1:
        sizes = [b for b in (1, 2, 4, *range(8, cuda_graph_sizes[0] + 1, 8)) if b <= cuda_graph_sizes[0]]
    else:
        sizes = cuda_graph_sizes
    return sorted({min(b, limit) for b in sizes})


def pad_inputs(buffers, num_reqs: int, num_tokens: int, key: tuple[int, int]) -> None:
    """Pads a step in the host buffers (InputBuffers) to (requests, tokens) = key and copies it to the device: tokens
    past the step's are token 0 at position 0 with slot -1, requests past its own are empty, at the end of its
    tokens."""
    host = buffers.np
    b, t = key
    host["input_ids"][num_tokens:t] = 0
    host["positions"][num_tokens:t] = 0
    host["slot_mapping"][:, num_tokens:t] = -1
    host["seq_lens"][num_reqs:b] = 0
    host["query_start_loc"][num_reqs + 1 : b + 1] = num_tokens
    for name in ("input_ids", "positions", "slot_mapping"):
        buffers.to_device(name, t)
    buffers.to_device("seq_lens", b)
    buffers.to_device("query_start_loc", b + 1)


class StepGraphs:
    """The graphs of one model forward (`forward(input_ids, positions, meta) -> hidden`, attention through
    `backend`) over the runner's device buffers. max_query_len > 1: verification graphs too, for queries of up to
    that many tokens; decode=False: those only."""

    def __init__(self, runner, forward: Forward, backend, max_requests: int, max_query_len: int = 1,
                 decode: bool = True) -> None:  # fmt: skip
        self.runner, self.forward, self.backend = runner, forward, backend
        self.max_query_len = max_query_len
        limit = min(max_requests, runner.max_num_batched_tokens)
        self.buckets = capture_sizes(runner.cuda_graph_sizes, limit)
        keys = [(b, b) for b in self.buckets] if decode else []
        self.verify_buckets = [b for b in self.buckets if b <= VERIFY_MAX_REQUESTS] if max_query_len > 1 else []
        for b in self.verify_buckets:
            keys += [(b, b * q) for q in range(2, max_query_len + 1) if b * q <= runner.max_num_batched_tokens]
        self.keys = set(keys)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def key_for(self, num_reqs: int, num_tokens: int, max_query_len: int) -> tuple[int, int] | None:
        """The graph (requests, tokens) a step replays, or None: it runs eagerly."""
        if max_query_len == 1:
            if num_reqs > self.buckets[-1]:
                return None
            b = next(b for b in self.buckets if b >= num_reqs)
            return (b, b) if (b, b) in self.keys else None
        if max_query_len > self.max_query_len or not self.verify_buckets or num_reqs > self.verify_buckets[-1]:
            return None
        b = next(b for b in self.verify_buckets if b >= num_reqs)
        key = (b, b * max(2, math.ceil(num_tokens / b)))
        return key if key in self.keys else None

    def _meta(self, key: tuple[int, int]) -> AttentionMetadata:
        dev = self.runner.buffers.device
        b, t = key
        q = t // b
        meta = AttentionMetadata(
            num_tokens=t,
            num_decodes=b if q == 1 else 0,
            slot_mapping=dev["slot_mapping"][:, :t],
            query_start_loc=dev["query_start_loc"][: b + 1],
            seq_lens=dev["seq_lens"][:b],
            block_tables=dev["block_tables"][:, :b],
            query_start_loc_cpu=list(range(0, t + 1, q)),
            seq_lens_cpu=[q] * b,
            # The longest context a replay can see: the backend's per-step state (the Triton backend's split-KV
            # segments) is built for it, once per graph, and fits every step the graph replays.
            max_seq_len=self.runner.max_model_len,
            # Decode graphs: one token per request; verification graphs: tiles for the longest query they take.
            max_query_len=1 if q == 1 else self.max_query_len,
        )
        return split_groups(meta)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Captures every graph (into `pool` if given) -> the pool."""
        r = self.runner
        t0 = time.perf_counter()
        dev = r.buffers.device
        self.pool = pool
        with torch.cuda.stream(r.stream):
            for b, t in sorted(self.keys, key=lambda key: (-key[1], -key[0])):
                self.idle_inputs((b, t))
                meta = self._meta((b, t))
                self.backend.prepare_groups(meta, r.block_size)
                args = (dev["input_ids"][:t], dev["positions"][:t], meta)
                self.forward(*args)  # warm-up: kernel compilation and autotuning stay out of the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=r.stream):
                    hidden = self.forward(*args)
                self.pool = graph.pool()
                self.graphs[(b, t)] = (graph, hidden)
                torch.cuda.current_stream().synchronize()  # the host buffers are rewritten for the next capture
        torch.cuda.synchronize()
        verify = sorted(key for key in self.keys if key[1] > key[0])
        logger.info("Captured CUDA graphs for decode batches %s%s in %.1f s", self.buckets,
                    f" and verification (requests, tokens) {verify}" if verify else "",
                    time.perf_counter() - t0)  # fmt: skip
        return self.pool

    def idle_inputs(self, key: tuple[int, int]) -> None:
        """Device buffers for graph `key` that write nothing: every request a (tokens / requests)-token sequence in
        block 0 with slot -1 (what capture runs, and what a replay for timing only may read)."""
        r = self.runner
        host = r.buffers.np
        b, t = key
        q = t // b
        host["input_ids"][:t] = 0
        host["positions"][:t] = [i % q for i in range(t)]
        host["slot_mapping"][:, :t] = -1
        host["seq_lens"][:b] = q
        host["query_start_loc"][: b + 1] = range(0, t + 1, q)
        host["block_tables"][:, :b] = 0
        for name in ("input_ids", "positions", "slot_mapping"):
            r.buffers.to_device(name, t)
        r.buffers.to_device("seq_lens", b)
        r.buffers.to_device("query_start_loc", b + 1)
        r.buffers.to_device("block_tables", b, r.max_blocks_per_seq)

    def replay(self, layout, key: tuple[int, int], patch=None) -> torch.Tensor:
        """Pads the step (host buffers) to the graph's shape, copies, runs `patch` (device-side fix-ups of the
        inputs), replays. -> hidden states [tokens of the graph, hidden]."""
        pad_inputs(self.runner.buffers, layout.num_reqs, layout.num_tokens, key)
        self.runner.buffers.to_device("block_tables", layout.num_reqs, layout.max_blocks)
        if patch is not None:
            patch()
        return self.run(key)

    def run(self, key: tuple[int, int]) -> torch.Tensor:
        """Replays the graph over the device buffers as they are."""
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden
