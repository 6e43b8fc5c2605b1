"""What the model runner measures at start-up, on made-up requests: a warm-up step (compilation), the time of steps
by size (the speculation policy's cost model) and, on a GPU, the peak activation memory that sizes the KV cache.
Tensor parallelism: the runner's methods of the same names have the other ranks run these too."""

from __future__ import annotations

import gc
import logging
import time

import torch

from aserve.core.kv_cache_manager import cdiv
from aserve.layers.attention.backend import AttentionMetadata, split_groups
from aserve.worker.step_plan import StepLayout

logger = logging.getLogger("aserve")


def synthetic_step(runner, q_lens: list[int]) -> torch.Tensor:
    """Runs the model on made-up requests (query lengths `q_lens`, no context, decodes first) whose KV goes to
    the first blocks of the cache. For profiling and warm-up only: those blocks hold garbage afterwards, which
    is fine while no request owns them."""
    bs, dev = runner.block_size, runner.device
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
    # Every group of layers (aserve/core/kv_cache_groups.py) writes and reads the same blocks
    num_groups = runner.kv_layout.num_groups
    meta = AttentionMetadata(
        num_tokens=qsl[-1],
        num_decodes=num_decodes,
        slot_mapping=torch.tensor([slots] * num_groups, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(
            [[t + [0] * (width - len(t)) for t in tables]] * num_groups, dtype=torch.int32, device=dev
        ),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(q_lens),
        max_seq_len=max(q_lens),
        max_query_len=max(q_lens),
    )
    meta = split_groups(meta)
    runner.backend.prepare_groups(meta, bs)
    # Inputs come from the same buffers as in execute(): compiled code is specialised on their kind.
    runner.buffers.np["input_ids"][: qsl[-1]] = 0
    runner.buffers.np["positions"][: qsl[-1]] = [i for n in q_lens for i in range(n)]
    input_ids = runner.buffers.to_device("input_ids", qsl[-1])
    positions = runner.buffers.to_device("positions", qsl[-1])
    hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
    return runner.model.compute_logits(hidden[torch.tensor(qsl[1:], device=dev) - 1])


def warmup(runner) -> None:
    """Triggers compilation (for steps of 32+ tokens, with and without a residual) so that the first requests
    do not wait for it."""
    n = runner.model.ops.min_tokens
    if n > min(runner.max_num_batched_tokens, runner.max_model_len):
        return  # steps never get big enough to use the compiled code
    t0 = time.perf_counter()
    synthetic_step(runner, [n])
    logger.info("Warm-up (compilation) took %.1f s", time.perf_counter() - t0)


def warm_up_rows(max_rows: int) -> list[int]:
    """Row counts that meet every launch specialisation of a kernel over up to `max_rows` rows whose configuration
    changes at powers of two (Triton specialises an integer argument on 1 and on multiples of 16): 1, 2, then each
    power of two from 16 and the count after it."""
    rows = {1, 2, max_rows}
    p = 16
    while p <= max_rows:
        rows.update((p, p + 1))
        p *= 2
    return sorted(r for r in rows if r <= max_rows)


def measure_step_times(runner, reps: int = 3) -> dict[int, float]:
    """Seconds per step by number of tokens (1, 2, 4, ... up to the budget): the seed of the speculation
    policy's cost model (which then learns from real steps). A step of n tokens is timed as one n-token request;
    the fastest of `reps` runs, after a warm-up run (kernel selection, compilation). Sizes that CUDA graphs cover
    are timed as the steps run them: a decode graph's replay and the logits of its rows, or a prompt's pieces
    (aserve/worker/piecewise_graphs.py) and its last row's logits."""
    sizes = [1 << i for i in range(12) if (1 << i) <= min(runner.max_num_batched_tokens, runner.max_model_len, 1024)]
    graphs = runner.graphs
    if graphs is not None:
        graphs.idle_inputs((graphs.buckets[-1], graphs.buckets[-1]))  # decode rows that write nothing
    out = {}
    pieces = runner.piecewise
    for n in sizes:
        key = graphs.key_for(n, n, 1) if graphs is not None else None
        bucket = pieces.bucket_for(StepLayout(1, n, max_query_len=n)) if pieces is not None else None
        if key is not None:
            step = lambda key=key, n=n: runner.model.compute_logits(graphs.run(key)[:n])  # noqa: E731
        elif bucket is not None:  # a prompt of n tokens replays its bucket's pieces (one request, writing nothing)
            meta = pieces.idle_meta(bucket, graphs.idle_inputs)
            runner.backend.prepare_groups(meta, runner.block_size)
            step = lambda b=bucket, m=meta: runner.model.compute_logits(pieces.run(b, b, m)[b - 1 :])  # noqa: E731
        else:
            step = lambda n=n: synthetic_step(runner, [n])  # noqa: E731
        step()
        _sync(runner)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            _sync(runner)
            best = min(best, time.perf_counter() - t0)
        out[n] = best
    return out


def _sync(runner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def profile_num_kv_blocks(runner, utilization: float) -> int:
    """GPU: run the largest step once (one prompt of max_num_batched_tokens tokens) to measure peak activation
    memory, then give the KV cache what `utilization` of the device leaves. Tensor parallelism: every rank measures
    its own device, and all take the smallest number of blocks."""
    gc.collect()  # engines dropped earlier in this process (runner <-> CUDA graphs is a cycle) free their memory
    n = min(runner.max_num_batched_tokens, runner.max_model_len)
    runner.allocate_kv_cache(cdiv(n, runner.block_size))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    synthetic_step(runner, [n])
    torch.cuda.synchronize()
    activation_peak = torch.cuda.max_memory_allocated() - baseline
    runner.kv_caches = None
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    budget = int(total * utilization) - (total - free) - activation_peak
    num_blocks = max(budget, 0) // runner.kv_bytes_per_block
    if runner.tp is not None:
        num_blocks = runner.tp.min_int(num_blocks)
    if num_blocks <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization={utilization} "
            f"({(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB, activations need "
            f"{activation_peak / 2**30:.1f} GiB); raise it or lower max_num_batched_tokens"
        )
    return num_blocks
