"""Tool-call parsers, one per model family's format, by the names of vLLM's `--tool-call-parser`."""

from __future__ import annotations

from aserve.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser
from aserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from aserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from aserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser", "get_tool_parser"]
