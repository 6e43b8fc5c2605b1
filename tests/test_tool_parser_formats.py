"""Each tool-call format's own rules, beyond what every parser shares (tests/test_tool_parsers.py): Mistral's v11+
named calls as they are written, pythonic calls' literal arguments, Qwen3-Coder's parameters typed by the tools'
schemas."""

import json

from aserve.entrypoints.openai.tool_parsers import ToolCall, get_tool_parser


def test_mistral_named_format_as_it_is_written():
    """v11+'s [TOOL_CALLS]name{...}: the name is reported once [ARGS] or "{" ends it; a call cut short is text when
    whole (streamed, what was sent of it stays a call, as for every parser)."""
    parser = get_tool_parser("mistral")
    assert parser.partial_calls("[TOOL_CALLS]get_wea") == []
    assert [(c.name, c.arguments, c.complete) for c in parser.partial_calls("[TOOL_CALLS]get_time[ARGS]")] == [
        ("get_time", "", False)]  # fmt: skip
    assert [(c.name, c.arguments) for c in parser.partial_calls('x[TOOL_CALLS]get_time{"zo')] == [
        ("get_time", '{"zo')]  # fmt: skip
    cut = '[TOOL_CALLS]get_time{"zone": '
    assert parser.extract(cut) == (cut, [])


def test_pythonic_arguments_are_literals():
    parser = get_tool_parser("pythonic")
    for text in ("[get_time(zone=now())]", "[get_time(zone=float('inf'))]", "[get_time(**zones)]"):
        assert parser.extract(text) == (text, [])
    assert parser.extract("[f(a=-1.5, b=[true, None], c={'k': null}), g()]")[1] == [
        ToolCall("f", '{"a": -1.5, "b": [true, null], "c": {"k": null}}'), ToolCall("g", "{}")]  # fmt: skip


def test_qwen3_coder_types_arguments_by_the_tools_schemas():
    """As vLLM: strings stay text, other types are read (a value that does not read as its type stays text), a
    parameter the schema does not name is text; a `</parameter>` inside a value does not end it."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "tags": {"type": "array"},
        "s": {"type": "string"}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "bad": {"type": "integer"}}}}}]  # fmt: skip
    params = {"n": "3", "x": "2.5", "ok": "True", "tags": '["a", 1]', "s": "007", "maybe": "None", "bad": "three",
              "other": "12", "code": "a</parameter>b"}  # fmt: skip
    text = "<tool_call>\n<function=f>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    text += "</function>\n</tool_call>"
    [call] = get_tool_parser("qwen3_coder").for_request(tools).extract(text)[1]
    assert json.loads(call.arguments) == {"n": 3, "x": 2.5, "ok": True, "tags": ["a", 1], "s": "007", "maybe": None,
                                          "bad": "three", "other": "12", "code": "a</parameter>b"}  # fmt: skip
    assert get_tool_parser("qwen3_coder").extract(text)[1][0].arguments.startswith('{"n": "3"')  # no tools: text
