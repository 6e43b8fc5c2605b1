"""A step's flat batch as the model runner lays it out in its host buffers (StepLayout), and what the device part of
the step runs from besides those buffers (StepPlan): everything on rank 0, and with the buffers' filled prefixes what
a tensor-parallel worker receives to run the same step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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


@dataclass(slots=True)
class StepPlan:
    """What the device part of a step runs from, besides the host buffers: all of it on rank 0; a tensor-parallel
    worker gets it with `host`, the prefixes of the buffers rank 0 filled."""

    layout: StepLayout
    overlap: bool = False  # async scheduling: the host buffers flip first
    inflight_dst: list[int] = field(default_factory=list)  # flat-batch slots of tokens the step in flight samples
    inflight_src: list[int] = field(default_factory=list)  # ... and their rows in that step's sampled tokens
    num_logits_rows: int = 0  # rows that sample (logits_indices)
    prompt_logits_rows: list[tuple[int, int]] = field(default_factory=list)  # (first row, rows) of prompt scoring
    share_tokens: bool = False  # tensor parallelism, async scheduling: rank 0 broadcasts the sampled tokens
    host: dict[str, np.ndarray] | None = None

    def with_host(self, buffers: dict[str, np.ndarray]) -> StepPlan:
        n, t = self.layout.num_reqs, self.layout.num_tokens
        host = {name: buffers[name][..., :t] for name in ("input_ids", "positions", "slot_mapping")}
        host["query_start_loc"], host["seq_lens"] = buffers["query_start_loc"][: n + 1], buffers["seq_lens"][:n]
        host["block_tables"] = buffers["block_tables"][:, :n, : self.layout.max_blocks]
        host["logits_indices"] = buffers["logits_indices"][: self.num_logits_rows]
        return StepPlan(self.layout, self.overlap, self.inflight_dst, self.inflight_src, self.num_logits_rows,
                        self.prompt_logits_rows, self.share_tokens, host)  # fmt: skip
