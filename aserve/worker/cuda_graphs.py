"""CUDA graphs of decode steps (one query token per request), one per batch-size bucket.

A decode step of n requests replays the graph of the smallest bucket B >= n. The graph reads the runner's static
device buffers; rows n..B-1 are padding: slot -1 (the cache write skips them), sequence length 0 and an empty query
range (attention returns at once), token 0 at position 0. Graphs are captured from the largest bucket down, sharing
one memory pool. The graph covers the model forward (hidden states); the final norm, lm_head and sampling run
eagerly on the rows that sample.

    host buffers --(H2D copy of [:B])--> device buffers --graph replay--> hidden[:B]
"""

from __future__ import annotations

import logging
import time

import torch

from aserve.layers.attention.backend import AttentionMetadata

logger = logging.getLogger("aserve")

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int) -> None:
        self.runner = runner
        limit = min(max_num_seqs, runner.max_num_batched_tokens)
        self.buckets = sorted({b for b in _BUCKETS if b <= limit} | {limit})
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket_for(self, layout) -> int | None:
        if not layout.decode_only or layout.num_reqs > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= layout.num_reqs)

    def _meta(self, bucket: int) -> AttentionMetadata:
        r = self.runner
        dev = r.buffers.device
        return AttentionMetadata(
            num_tokens=bucket,
            num_decodes=bucket,
            slot_mapping=dev["slot_mapping"][:bucket],
            query_start_loc=dev["query_start_loc"][: bucket + 1],
            seq_lens=dev["seq_lens"][:bucket],
            block_tables=dev["block_tables"][:bucket],
            query_start_loc_cpu=list(range(bucket + 1)),
            seq_lens_cpu=[1] * bucket,
            # The longest context a replay can see: the backend's per-step state (the Triton backend's split-KV
            # segments) is built for it, once per bucket, and fits every step the graph replays.
            max_seq_len=r.max_model_len,
            max_query_len=1,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        t0 = time.perf_counter()
        host = r.buffers.np
        biggest = self.buckets[-1]
        # Capture inputs: every row a 1-token sequence in block 0 that writes nothing.
        host["input_ids"][:biggest] = 0
        host["positions"][:biggest] = 0
        host["slot_mapping"][:biggest] = -1
        host["seq_lens"][:biggest] = 1
        host["query_start_loc"][: biggest + 1] = range(biggest + 1)
        host["block_tables"][:biggest] = 0
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            r.buffers.to_device(name, biggest)
        r.buffers.to_device("query_start_loc", biggest + 1)
        r.buffers.to_device("block_tables", biggest, r.max_blocks_per_seq)
        dev = r.buffers.device
        pool = None
        with torch.cuda.stream(r.stream):
            for bucket in reversed(self.buckets):
                meta = self._meta(bucket)
                r.backend.prepare(meta, r.block_size)
                args = (dev["input_ids"][:bucket], dev["positions"][:bucket], r.kv_caches, meta)
                r.model(*args)  # warm-up: kernel compilation and autotuning stay out of the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=r.stream):
                    hidden = r.model(*args)
                pool = graph.pool()
                self.graphs[bucket] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for decode batches %s in %.1f s", self.buckets, time.perf_counter() - t0)

    def replay(self, layout, bucket: int, patch=None) -> torch.Tensor:
        """Pads the step in the host buffers to `bucket` rows, copies, runs `patch` (device-side fix-ups of the
        inputs), replays. -> hidden states [bucket, hidden]."""
        r = self.runner
        host = r.buffers.np
        n = layout.num_reqs
        host["input_ids"][n:bucket] = 0
        host["positions"][n:bucket] = 0
        host["slot_mapping"][n:bucket] = -1
        host["seq_lens"][n:bucket] = 0
        host["query_start_loc"][n + 1 : bucket + 1] = n
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            r.buffers.to_device(name, bucket)
        r.buffers.to_device("query_start_loc", bucket + 1)
        r.buffers.to_device("block_tables", n, layout.max_blocks)
        if patch is not None:
            patch()
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden
