"""Workloads: random, shared-prefix, chat, grounded, file. `make_workload` builds the one a RunConfig names."""

from __future__ import annotations

from loadgen.config import RunConfig
from loadgen.workloads.base import PromptMaker, RequestSpec, Session, Workload
from loadgen.workloads.chat import ChatWorkload
from loadgen.workloads.dataset import FileWorkload
from loadgen.workloads.grounded import GroundedWorkload
from loadgen.workloads.lengths import LengthDist, parse_length
from loadgen.workloads.synthetic import RandomWorkload, SharedPrefixWorkload

__all__ = ["LengthDist", "PromptMaker", "RequestSpec", "Session", "Workload", "make_workload", "parse_length"]

DEFAULT_OUTPUT_LEN = "128"


def make_workload(cfg: RunConfig, tokens_per_word: float = 1.0) -> Workload:
    maker = PromptMaker(cfg.prompt_format, cfg.vocab_size, tokens_per_word)
    input_len = parse_length(cfg.input_len)
    output_len = parse_length(cfg.output_len or DEFAULT_OUTPUT_LEN)
    if cfg.workload == "random":
        return RandomWorkload(maker, input_len, output_len)
    if cfg.workload == "shared-prefix":
        return SharedPrefixWorkload(maker, cfg.num_prefixes, cfg.prefix_len, input_len, output_len)
    if cfg.workload == "chat":
        return ChatWorkload(maker, cfg.num_turns, input_len, output_len)
    if cfg.workload == "grounded":
        return GroundedWorkload(maker, input_len, parse_length(cfg.output_len) if cfg.output_len else None)
    if cfg.workload == "file":
        return FileWorkload(cfg.dataset, maker, output_len)
    raise ValueError(f"unknown workload {cfg.workload!r}")
