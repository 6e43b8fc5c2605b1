"""Tool-call parsers, one per model family's format, by the names of vLLM's `--tool-call-parser` (a parser vLLM
has under two names for one format answers to both)."""

from __future__ import annotations

from aserve.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser
from aserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from aserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from aserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from aserve.entrypoints.openai.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from aserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from aserve.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

_PARSERS = (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser, Qwen3CoderToolParser,
            Phi4MiniJsonToolParser)  # fmt: skip
TOOL_PARSERS: dict[str, type[ToolParser]] = {name: p for p in _PARSERS for name in (p.name, *p.aliases)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser", "get_tool_parser"]
