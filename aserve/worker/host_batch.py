"""A step's flat batch written into the model runner's host buffers (token ids, positions, slots, block tables,
lengths), with numpy over whole arrays: at a few hundred requests per step, per-request Python work shows up.

Two kinds of input token are not known on the host when the step is written, and are left as 0 placeholders for the
device to fill (ModelRunner): a request's last token when the step still running samples it (async scheduling:
`inflight`), and a model drafter's drafts that the step verifies while the device still computes them (`drafts`:
DraftTokens, whose values the step's inputs take on the device, so the verification is launched behind the drafting
without the host waiting for it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from aserve.core.scheduler import ScheduledRequest
from aserve.worker.draft_tokens import DraftTokens
from aserve.worker.step_plan import StepLayout


@dataclass(slots=True)
class HostBatch:
    layout: StepLayout
    # (index in the flat batch, request) of each token the previous step has yet to deliver
    inflight: list[tuple[int, ScheduledRequest]] = field(default_factory=list)
    # (index in the flat batch of the first draft, the drafts) of each request verifying drafts left to the device
    drafts: list[tuple[int, DraftTokens]] = field(default_factory=list)


def fill_host(buf: dict[str, np.ndarray], order: list[ScheduledRequest], block_size: int, num_groups: int,
              drafts_on_device: bool = False) -> HostBatch:  # fmt: skip
    """Writes `order`'s flat batch into `buf`. drafts_on_device: a model drafter's drafts are left to the device."""
    bs = block_size
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
    drafts = []
    if drafts_on_device:
        drafts = [(int(query_start[i + 1]) - len(s.spec_token_ids), s.spec_token_ids) for i, s in enumerate(order)
                  if s.spec_token_ids and isinstance(s.spec_token_ids, DraftTokens)]  # fmt: skip

    def draft_ids(spec):
        return (0,) * len(spec) if drafts_on_device and isinstance(spec, DraftTokens) else spec

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
                    draft_ids(s.spec_token_ids),
                )
                for s, m in zip(order, missing)
            )
        )
        req_of_token = np.repeat(np.arange(n), q_lens)
        positions = np.arange(num_tokens) - query_start[req_of_token] + starts[req_of_token]
    buf["positions"][:num_tokens] = positions
    # Block tables, per group of layers: all requests' block ids in one scatter. Entries past a request's own blocks
    # keep stale (valid) block ids; nothing reads them unmasked. Every group holds a request's blocks up to the same
    # length (a sliding group's first ones point at the null block).
    num_blocks = np.fromiter((len(s.block_ids[0]) for s in order), np.int64, n)
    block_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num_blocks, out=block_start[1:])
    rows = np.repeat(np.arange(n), num_blocks)
    cols = np.arange(int(block_start[-1])) - block_start[rows]
    req_of_token = np.arange(n) if num_tokens == n else np.repeat(np.arange(n), q_lens)
    for g in range(num_groups):
        table = buf["block_tables"][g]
        table[rows, cols] = np.fromiter(itertools.chain.from_iterable(s.block_ids[g] for s in order), np.int32,
                                        cols.shape[0])  # fmt: skip
        block_of_token = table[req_of_token, positions // bs].astype(np.int64)
        buf["slot_mapping"][g, :num_tokens] = block_of_token * bs + positions % bs
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
    return HostBatch(layout, inflight, drafts)
