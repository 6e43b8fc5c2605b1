"""CUDA graphs of mixed steps (prompt chunks, alone or beside decodes), in pieces between the attention calls.

An eager forward of a step that holds a prompt chunk costs the host ~0.35 ms a layer on an H100's host (the
linears' dispatch, the Triton launches: ~12 ms for a Llama-3-8B), more than the device needs for a few hundred
tokens: such steps were bound by the host, and every decode beside them waited that long. Attention is the only
part of the forward whose launch depends on the step's requests (their query ranges and contexts); everything else
depends only on the number of tokens. So, for each token bucket T, the forward is captured as graphs that end and
begin at every attention call (vLLM's piecewise CUDA graphs): a replay runs piece 0, attention of layer 0 eagerly
with the step's own metadata, piece 1, ... The pieces share one memory pool (with the decode graphs) and are
replayed in the order they were captured; the runner pads a step's inputs to its bucket (pad), patches them and
runs the pieces (run).

Padding: tokens past the step's are token 0 at position 0 with slot -1 (the cache write in the pieces skips them);
attention runs on the step's own tokens and writes their rows of its output buffer (the padding rows keep what they
held: the rows are independent until the logits, which read only real rows).

During capture the backend's `attend` / `forward` are replaced on the instance by a stand-in that copies q / k / v
into buffers shared by every layer and bucket (inside the piece), ends the graph being captured, records the call
(those buffers, the layer's cache and parameters, which group's metadata it read), begins the next graph and
returns the shared output buffer without computing attention. Holding no tensor of the graphs' own, the pieces
leave the pool's memory free for each other: its size is one bucket's activations, not one per layer and bucket.
The graphs capture rotary and the cache write as a step with multi-token queries does (the attention backend's
`reads_new_kv`), so only steps whose longest query has more than one token replay them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from aserve.layers.attention.backend import AttentionMetadata, split_groups
from aserve.worker.cuda_graphs import pad_inputs

logger = logging.getLogger("aserve")

# Steps of up to this many tokens replay pieces (beyond, the device's work hides the host's launches).
TOKEN_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024)


@dataclass(slots=True)
class _Call:
    """One attention call of a captured forward: the backend method's name and its static arguments."""

    method: str  # "attend" (q, k_new, v_new) or "forward" (q, k, v: it also writes the cache)
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    kv_cache: torch.Tensor
    group: int  # 0: the step's metadata, g > 0: meta.groups[g - 1]
    params: object
    out: torch.Tensor  # the output the next piece reads


@dataclass(slots=True)
class _Pieces:
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    calls: list[_Call] = field(default_factory=list)
    hidden: torch.Tensor | None = None


class PiecewiseGraphs:
    def __init__(self, runner, forward, backend, max_tokens: int) -> None:
        """forward(input_ids, positions, meta) -> hidden states, its attention through `backend`."""
        self.runner, self.forward, self.backend = runner, forward, backend
        self.buckets = [t for t in TOKEN_BUCKETS if t <= max_tokens]
        self.pieces: dict[int, _Pieces] = {}
        self._open: torch.cuda.CUDAGraph | None = None  # the graph being captured
        self._buffers: dict[tuple, torch.Tensor] = {}  # attention's inputs and output, shared (_static)

    def bucket_for(self, layout) -> int | None:
        """The token bucket a step (its StepLayout) replays, or None: it runs eagerly."""
        if layout.max_query_len <= 1 or not self.pieces or layout.num_tokens > self.buckets[-1]:
            return None
        return next(t for t in self.buckets if t >= layout.num_tokens)

    def capture_meta(self, t: int) -> AttentionMetadata:
        """One request of t tokens in block 0, every slot -1 (idle_inputs((1, t)) and pad(1, t, t) fill the
        buffers). Its request arrays span every request a step may hold, padded (pad): a model that reads
        them on the device outside attention (models/phi3.py's LongRoPE) sees each replay's own."""
        dev, n = self.runner.buffers.device, self.runner.max_num_seqs
        meta = AttentionMetadata(
            num_tokens=t, num_decodes=0, slot_mapping=dev["slot_mapping"][:, :t],
            query_start_loc=dev["query_start_loc"][: n + 1], seq_lens=dev["seq_lens"][:n],
            block_tables=dev["block_tables"][:, :1], query_start_loc_cpu=[0, t], seq_lens_cpu=[t], max_seq_len=t,
            max_query_len=t,
        )  # fmt: skip
        return split_groups(meta)

    def idle_meta(self, t: int, idle_inputs) -> AttentionMetadata:
        """The device buffers filled with one request of t tokens that writes nothing (idle_inputs, then padded to
        bucket t) -> its metadata (capture_meta): what a capture, or a timing of bucket t's pieces, runs on."""
        idle_inputs((1, t))
        self.pad(1, t, t)
        return self.capture_meta(t)

    def pad(self, num_reqs: int, num_tokens: int, t: int) -> None:
        """Pads a step to bucket t's tokens and to every request a step may hold (host buffers, copied)."""
        pad_inputs(self.runner.buffers, num_reqs, num_tokens, (self.runner.max_num_seqs, t))

    @torch.inference_mode()
    def capture(self, pool, idle_inputs) -> None:
        """Captures every bucket into `pool` (a graph pool handle), from the most tokens down; idle_inputs(key) fills
        the device buffers for (requests, tokens) = key with inputs that write nothing. A forward that cannot be
        captured leaves every mixed step eager (one warning says why)."""
        r = self.runner
        t0 = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with torch.cuda.stream(r.stream):
            try:
                for t in sorted(self.buckets, reverse=True):
                    self.pieces[t] = self._capture(t, pool, idle_inputs)
            except Exception as e:  # e.g. a layer that syncs with the host
                if torch.cuda.is_current_stream_capturing():
                    self._open.capture_end()
                self.pieces.clear()
                logger.warning("No piecewise CUDA graphs (steps with prompts run eagerly): %s", e)
                return
        torch.cuda.synchronize()
        logger.info("Captured piecewise CUDA graphs for steps of up to %d tokens (%d buckets, %d pieces each) in "
                    "%.1f s", self.buckets[-1], len(self.buckets), len(self.pieces[self.buckets[0]].graphs),
                    time.perf_counter() - t0)  # fmt: skip

    def _capture(self, t: int, pool, idle_inputs) -> _Pieces:
        dev = self.runner.buffers.device
        meta = self.idle_meta(t, idle_inputs)
        args = (dev["input_ids"][:t], dev["positions"][:t], meta)
        with self._stand_in(meta, None):
            self.forward(*args)  # warm-up: kernel compilation and autotuning stay out of the graphs
        torch.cuda.synchronize()
        pieces = _Pieces()
        with self._stand_in(meta, (pieces, pool)):
            self._begin(pieces, pool)
            hidden = self.forward(*args)
        self._open.capture_end()
        pieces.hidden = hidden
        torch.cuda.current_stream().synchronize()
        return pieces

    def _begin(self, pieces: _Pieces, pool) -> None:
        self._open = torch.cuda.CUDAGraph()
        pieces.graphs.append(self._open)
        self._open.capture_begin(pool=pool)

    def _static(self, name: str, x: torch.Tensor, t: int) -> torch.Tensor:
        """The first t rows of the buffer `name` of x's row shape and dtype, made on first use (the warm-up of the
        largest bucket: outside any graph) for the most tokens a bucket holds."""
        key = (name, tuple(x.shape[1:]), x.dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(self.buckets[-1], *x.shape[1:], dtype=x.dtype, device=x.device)
        return self._buffers[key][:t]

    @contextlib.contextmanager
    def _stand_in(self, meta: AttentionMetadata, capturing: tuple[_Pieces, object] | None):
        """The backend's attend / forward replaced, on the instance, by the capture's stand-in. Its q / k / v are
        copied, in the piece, into buffers every layer and bucket shares, and attention's output is such a buffer
        too: the graphs' own tensors are not held, so the pool's memory serves every piece and bucket (a replay runs
        one layer's attention between its two pieces, in stream order)."""
        backend = self.backend
        metas = [meta, *meta.groups]

        def stand_in(method):
            def call(q, k, v, kv_cache, step_meta, params=None):
                t = q.shape[0]
                args = [self._static(name, x, t).copy_(x) if x is not None else None
                        for name, x in (("q", q), ("k", k), ("v", v))]  # fmt: skip
                out = self._static("out", q, t)
                if capturing is not None:
                    pieces, pool = capturing
                    self._open.capture_end()
                    group = next(i for i, m in enumerate(metas) if m is step_meta)
                    pieces.calls.append(_Call(method, *args, kv_cache, group, params, out))
                    self._begin(pieces, pool)
                return out

            return call

        backend.attend, backend.forward = stand_in("attend"), stand_in("forward")
        try:
            yield
        finally:
            del backend.attend, backend.forward

    def run(self, t: int, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """The pieces of bucket t over the device buffers as they are (the step padded to t: pad), attention on
        `meta` (the step's own, prepared). -> hidden states [t, hidden]."""
        pieces = self.pieces[t]
        metas = [meta, *meta.groups]
        n = num_tokens
        for graph, c in zip(pieces.graphs, pieces.calls):
            graph.replay()
            k = c.k[:n] if c.k is not None else None
            v = c.v[:n] if c.v is not None else None
            method = getattr(self.backend, c.method)
            args = (c.q[:n], k, v, c.kv_cache, metas[c.group])
            c.out[:n].copy_(method(*args, c.params) if c.params is not None else method(*args))
        pieces.graphs[-1].replay()
        return pieces.hidden
