"""Tool-call parsers, one per model family's format, by the names of vLLM's `--tool-call-parser` (a parser vLLM
has under two names for one format answers to both), and `--tool-parser-plugin FILE.py`: a file of one's own
parsers, each a subclass of ToolParser (base.py has the contract: `name`, optional `aliases` and `start_markers`,
`extract(text) -> (content, calls)`, optionally `partial_calls`), registered under its names when the server
starts. vLLM's plugins subclass vLLM's parser class and do not load here."""

from __future__ import annotations

import importlib.util
import inspect
import os

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


def load_plugin(path: str) -> list[str]:
    """--tool-parser-plugin: imports the file and registers the ToolParser subclasses it defines -> their names;
    ValueError naming the file when it cannot be imported or defines none."""
    if not os.path.isfile(path):
        raise ValueError(f"--tool-parser-plugin {path}: no such file")
    name = "aserve_tool_parser_plugin_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"--tool-parser-plugin {path}: importing it failed ({type(e).__name__}: {e}); a plugin "
                         "subclasses aserve.entrypoints.openai.tool_parsers.ToolParser") from e  # fmt: skip
    parsers = [obj for _, obj in inspect.getmembers(module, inspect.isclass)
               if issubclass(obj, ToolParser) and obj.__module__ == name and getattr(obj, "name", "")]  # fmt: skip
    if not parsers:
        raise ValueError(f"--tool-parser-plugin {path}: it defines no ToolParser subclass with a name")
    names = []
    for parser in parsers:
        for alias in (parser.name, *parser.aliases):
            TOOL_PARSERS[alias] = parser
            names.append(alias)
    return names


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParser", "get_tool_parser", "load_plugin"]
