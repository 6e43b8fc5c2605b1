"""tool_choice's modes without a model: "required"'s forced schema with the tools' `$defs` at its root (the
nested models of openai.pydantic_function_tool), its calls streamed as they are written (name first, then argument
pieces), `parallel_tool_calls: false` keeping the first call of "auto", and every mode's call ids in the server
parser's form."""

import json
import re

import jsonschema
import pytest

from aserve.entrypoints.openai.responses import ChoiceState
from aserve.entrypoints.openai.tool_output import ToolCallOutput
from aserve.entrypoints.openai.tool_parsers import get_tool_parser
from aserve.entrypoints.openai.tool_request import AUTO, NAMED, REQUIRED, forced_output
from aserve.outputs import CompletionOutput
from aserve.sampling_params import ParamError

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")


class Address(pydantic.BaseModel):
    city: str
    country: str


class ShipTo(pydantic.BaseModel):
    name: str
    address: Address


class Bill(pydantic.BaseModel):
    to: Address
    amount: int


def _tools(*models) -> list[dict]:
    return [openai.pydantic_function_tool(m) for m in models]


def test_required_schema_hoists_the_tools_definitions():
    tools = _tools(ShipTo, Bill)
    assert all("$defs" in t["function"]["parameters"] for t in tools)  # what the client sends: nested models
    schema = forced_output(tools, "required", True).json
    assert set(schema["$defs"]) == {"Address"}
    good = [{"name": "ShipTo", "parameters": {"name": "Bo", "address": {"city": "Paris", "country": "FR"}}},
            {"name": "Bill", "parameters": {"to": {"city": "Rome", "country": "IT"}, "amount": 3}}]  # fmt: skip
    jsonschema.validate(good, schema)  # every "#/$defs/Address" resolves
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "Bill", "parameters": {"to": {"city": 1}, "amount": 3}}], schema)
    assert "$defs" in tools[0]["function"]["parameters"]  # the request is unchanged


def test_one_definition_name_with_two_meanings_is_refused():
    tools = _tools(ShipTo)
    other = json.loads(json.dumps(tools[0]))
    other["function"]["name"] = "Other"
    other["function"]["parameters"]["$defs"]["Address"]["properties"]["zip"] = {"type": "string"}
    with pytest.raises(ParamError, match=r"\$defs/Address") as e:
        forced_output([tools[0], other], "required", True)
    assert e.value.param == "tools"


def test_a_forced_tool_with_a_keyword_the_grammar_ignores_is_refused_by_name():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}}]  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(ParamError, match=r"tools\[0\].function.parameters: .*`uniqueItems` \(at /properties/tags"):
            forced_output(tools, choice, True)
    assert forced_output(tools, "auto", True) is None  # auto forces nothing: the schema is the model's to read


def _feed(output: ToolCallOutput, pieces: list[str]) -> list[dict]:
    choice, sent = ChoiceState(0, None), []
    for i, piece in enumerate(pieces):
        choice.add(CompletionOutput(0, piece, [], finish_reason="stop" if i == len(pieces) - 1 else None), None)
        body = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice.finish_reason}
        if output.delta(body, choice):
            sent.append(body)
        choice.clear_delta()
    return sent


REQUIRED_TEXT = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                 '{"name": "get_time", "parameters": {"zone": "UTC"}}]')  # fmt: skip


def test_required_streams_each_call_as_it_is_written():
    sent = _feed(ToolCallOutput(REQUIRED), list(REQUIRED_TEXT))
    deltas = [(n, d) for n, c in enumerate(sent) for d in c["delta"].get("tool_calls", [])]
    for index, (name, arguments) in enumerate([("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                                               ("get_time", '{"zone": "UTC"}')]):  # fmt: skip
        (n_first, first), *rest = [(n, d) for n, d in deltas if d["index"] == index]
        assert first["function"] == {"name": name, "arguments": ""} and first["type"] == "function"
        assert re.fullmatch(r"call_[0-9a-f]{24}", first["id"]) and len(rest) >= 3
        assert all(d == {"index": index, "function": {"arguments": d["function"]["arguments"]}} for _, d in rest)
        assert "".join(d["function"]["arguments"] for _, d in rest) == arguments
    # the first call is out before the output ends, and nothing of it is content
    assert max(n for n, d in deltas if d["index"] == 0) < len(sent) - 1
    assert all("content" not in c["delta"] for c in sent) and sent[-1]["finish_reason"] == "tool_calls"


def test_required_cut_short_before_a_name_is_content():
    sent = _feed(ToolCallOutput(REQUIRED), ['[{"na', 'me": "get_ti'])
    assert "".join(c["delta"].get("content", "") for c in sent) == '[{"name": "get_ti'


TWO_CALLS = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')  # fmt: skip


def test_parallel_tool_calls_false_keeps_the_first_call():
    choice = ChoiceState(0, None)
    choice.add(CompletionOutput(0, TWO_CALLS, [], finish_reason="stop"), None)
    body = {"message": {"content": TWO_CALLS}, "finish_reason": "stop"}
    ToolCallOutput(AUTO, get_tool_parser("hermes"), parallel=False).message(body, choice)
    assert [c["function"]["name"] for c in body["message"]["tool_calls"]] == ["get_time"]
    assert body["finish_reason"] == "tool_calls"
    sent = _feed(
        ToolCallOutput(AUTO, get_tool_parser("hermes"), parallel=False),
        [TWO_CALLS[i : i + 5] for i in range(0, len(TWO_CALLS), 5)],
    )
    indexes = {d["index"] for c in sent for d in c["delta"].get("tool_calls", [])}
    assert indexes == {0} and sent[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("mode", [REQUIRED, NAMED])
def test_forced_calls_take_the_parsers_id_form(mode):
    """Mistral's templates take back only 9-character alphanumeric ids: "required" and a named function make them
    too (the server's parser makes the ids in every mode)."""
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]' if mode == REQUIRED else '{"zone": "UTC"}'
    output = ToolCallOutput(mode, get_tool_parser("mistral"), name="get_time")
    choice = ChoiceState(0, None)
    choice.add(CompletionOutput(0, text, [], finish_reason="stop"), None)
    body = {"message": {"content": text}, "finish_reason": "stop"}
    output.message(body, choice)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", body["message"]["tool_calls"][0]["id"])
    [first] = [d for c in _feed(ToolCallOutput(mode, get_tool_parser("mistral"), name="get_time"), list(text))
               for d in c["delta"].get("tool_calls", []) if "id" in d]  # fmt: skip
    assert re.fullmatch(r"[A-Za-z0-9]{9}", first["id"])
