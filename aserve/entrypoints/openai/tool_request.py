"""Tool calling on the request side: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` checked, the tools
handed to the chat template, the conversation's earlier tool calls and results made into what templates expect, and
the JSON schema that `tool_choice` "required" or a named function imposes on the output (structured output, so the
arguments are valid for the function's parameters every time; vLLM builds the same schemas)."""

from __future__ import annotations

import json

from aserve.core.json_schema_support import unsupported_feature
from aserve.sampling_params import ParamError, StructuredOutputsParams

AUTO, REQUIRED, NAMED = "auto", "required", "named"


MAX_TOOLS = 128


def check_tools(tools: list | None, tool_choice) -> None:
    """The shapes OpenAI documents; a named tool_choice must name one of the tools; at most MAX_TOOLS tools (OpenAI's
    limit: a forced choice compiles one grammar over all of them)."""
    if tools is not None:
        if len(tools) > MAX_TOOLS:
            raise ParamError("tools", f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or tool.get("type") != "function":
                raise ParamError(f"tools[{i}]", 'each tool must be {"type": "function", "function": {...}}')
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise ParamError(f"tools[{i}].function.name", "each function needs a name")
            if not isinstance(function.get("parameters", {}), dict):
                raise ParamError(f"tools[{i}].function.parameters", "parameters must be a JSON schema object")
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise ParamError("tool_choice", "tool_choice 'required' needs tools")
        return
    if isinstance(tool_choice, str):
        raise ParamError("tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a function, got "
                         f"{tool_choice!r}")  # fmt: skip
    name = _named(tool_choice)
    if name is None:
        raise ParamError("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
    if _function(tools, name) is None:
        raise ParamError("tool_choice", f"tool_choice names {name!r}, which is not among the tools")


def tool_mode(tools: list | None, tool_choice) -> str | None:
    """None (no tool calls are parsed), AUTO (a parser finds them), REQUIRED or NAMED (the output is forced)."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice is None or tool_choice == "auto":
        return AUTO
    return REQUIRED if tool_choice == "required" else NAMED


def forces_tool_call(req) -> bool:
    """Whether a request's structured output is the tools' schemas (so a schema that fails to compile is a tool's)."""
    return tool_mode(getattr(req, "tools", None), getattr(req, "tool_choice", None)) in (REQUIRED, NAMED)


def named_function(tool_choice) -> str | None:
    return _named(tool_choice) if isinstance(tool_choice, dict) else None


def _named(tool_choice: dict) -> str | None:
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def _function(tools: list | None, name: str) -> dict | None:
    return next((t["function"] for t in tools or [] if t["function"]["name"] == name), None)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


# Where a schema keeps definitions that `$ref`s name from its root ("#/$defs/Address"): pydantic's `$defs`, and
# draft-07's `definitions`.
_DEFINITIONS = ("$defs", "definitions")


def forced_output(tools: list, tool_choice, parallel_tool_calls: bool) -> StructuredOutputsParams | None:
    """The structured output that tool_choice "required" or a named function imposes; None otherwise. Named: the
    output is that function's arguments. Required: a JSON list of {"name", "parameters"}, each one of the tools.
    Each forced tool's parameters are checked for keywords the grammar cannot enforce (a 400 naming the tool)."""
    mode = tool_mode(tools, tool_choice)
    if mode == NAMED:
        name = named_function(tool_choice)
        index = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
        return StructuredOutputsParams(json=_checked_parameters(tools, index))
    if mode != REQUIRED:
        return None
    parameters = [_checked_parameters(tools, i) for i in range(len(tools))]
    definitions = _hoisted_definitions(parameters)
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": {k: v for k, v in params.items() if k not in definitions},
            },  # fmt: skip
            "required": ["name", "parameters"],
        }
        for t, params in zip(tools, parameters)
    ]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": one_of}, **definitions}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _checked_parameters(tools: list, index: int) -> dict:
    parameters = _parameters(tools[index]["function"])
    problem = unsupported_feature(parameters)
    if problem is not None:
        raise ParamError("tools", f"tools[{index}].function.parameters: {problem}")
    return parameters


def _hoisted_definitions(parameters: list[dict]) -> dict:
    """The tools' `$defs` / `definitions`, merged for the root of the "required" schema: there each tool's
    parameters sit two levels down, where their "#/$defs/..." would no longer resolve (vLLM moves them up the same
    way). One name defined differently by two tools is refused."""
    merged: dict[str, dict] = {}
    for i, params in enumerate(parameters):
        for key in _DEFINITIONS:
            defs = params.get(key)
            if not isinstance(defs, dict):
                continue
            into = merged.setdefault(key, {})
            for name, definition in defs.items():
                if name in into and into[name] != definition:
                    raise ParamError("tools", f"tools[{i}].function.parameters defines {key}/{name} unlike an "
                                     f"earlier tool; with tool_choice 'required' the tools' {key} share one "
                                     "namespace: rename one of them")  # fmt: skip
                into[name] = definition
    return merged


def template_message(msg: dict) -> dict:
    """An assistant message's tool_calls with their arguments as objects (templates write them with `tojson` or
    iterate over them; the API carries them as JSON text)."""
    calls = msg.get("tool_calls")
    if not calls:
        return msg
    if not isinstance(calls, list):
        raise ParamError("messages", "tool_calls must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ParamError("messages", "each tool call needs a function")
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:  # (nesting past the parser's depth: RecursionError)
                raise ParamError("messages", f"a tool call's arguments are not JSON: {e}") from e
        out.append({**call, "function": {**function, "arguments": args}})
    return {**msg, "tool_calls": out}
