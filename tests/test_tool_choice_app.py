"""tool_choice as a client drives it: the official openai client against the app with a tiny random model (its
output forced by the tools' schemas, or by a regex into a parser's format). "required" with nested pydantic models
(`$defs`), parsed into the models by the client; its calls streamed as they are written, so that the client's
stream helper reports each call's arguments done; `parallel_tool_calls: false` under "auto"; Mistral's ids in every
mode; and schemas with keywords the grammar cannot enforce refused with a 400 naming the keyword, in each field a
schema comes in."""

import json
import re
from typing import Literal

import pytest
from test_responses_api import open_client
from test_server import assert_idle

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Ship it"}]


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=6)
    country: Literal["FR", "DE"]


class ShipTo(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    address: Address


class Bill(pydantic.BaseModel):
    to: Address
    amount: int = pydantic.Field(ge=0, le=9)


TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def llm_engine(tiny_model):
    from aserve import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=512,
                                served_model_name=MODEL, debug_invariants=True))  # fmt: skip


async def _open(llm_engine, **api):
    http, client = await open_client(llm_engine, **api)
    return http, client


async def test_required_with_nested_models_parses_into_them(llm_engine):
    """openai.pydantic_function_tool writes the nested model under `$defs` in each tool: the forced list's schema
    takes the tools' definitions at its root, so "#/$defs/Address" resolves and each call parses into its model."""
    http, client = await _open(llm_engine)
    try:
        tools = [openai.pydantic_function_tool(ShipTo), openai.pydantic_function_tool(Bill)]
        r = await client.chat.completions.parse(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                                max_tokens=300, temperature=0)  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            assert isinstance(call.function.parsed_arguments, {"ShipTo": ShipTo, "Bill": Bill}[call.function.name])
        named = await client.chat.completions.parse(model=MODEL, messages=MESSAGES, tools=tools, max_tokens=200,
                                                    tool_choice={"type": "function", "function": {"name": "ShipTo"}},
                                                    temperature=0)  # fmt: skip
        assert isinstance(named.choices[0].message.tool_calls[0].function.parsed_arguments, ShipTo)
        assert_idle(llm_engine)
    finally:
        await client.close()
        await http.close()


async def test_required_streams_each_call_as_it_is_written(llm_engine):
    """The client's stream helper sees each call's name, then argument pieces, then its arguments done (it fires
    `done` only for calls that streamed before the end)."""
    http, client = await _open(llm_engine)
    try:
        tools = [openai.pydantic_function_tool(ShipTo)]
        async with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                                  parallel_tool_calls=False, max_tokens=300,
                                                  temperature=0) as stream:  # fmt: skip
            events = [event async for event in stream]
            final = await stream.get_final_completion()
        pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
        done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
        assert len(pieces) >= 5 and done and done[0].name == "ShipTo"
        assert isinstance(done[0].parsed_arguments, ShipTo)
        [call] = final.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == json.loads(done[0].arguments)
        assert final.choices[0].finish_reason == "tool_calls" and not final.choices[0].message.content
    finally:
        await client.close()
        await http.close()


TWO_CALLS = (r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>\n'
             r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "CET"\}\}</tool_call>')  # fmt: skip


async def test_parallel_tool_calls_false_keeps_the_first_auto_call(llm_engine):
    http, client = await _open(llm_engine, tool_call_parser="hermes", enable_auto_tool_choice=True)
    try:
        kw = {"model": MODEL, "messages": MESSAGES, "tools": [TIME_TOOL], "max_tokens": 250, "temperature": 0,
              "extra_body": {"structured_outputs": {"regex": TWO_CALLS}}}  # fmt: skip
        both = await client.chat.completions.create(**kw)
        assert [json.loads(c.function.arguments)["zone"] for c in both.choices[0].message.tool_calls] == ["UTC", "CET"]
        one = await client.chat.completions.create(parallel_tool_calls=False, **kw)
        assert [json.loads(c.function.arguments)["zone"] for c in one.choices[0].message.tool_calls] == ["UTC"]
        assert one.choices[0].finish_reason == "tool_calls"
        stream = await client.chat.completions.create(parallel_tool_calls=False, stream=True, **kw)
        deltas = [d async for chunk in stream for c in chunk.choices for d in c.delta.tool_calls or []]
        assert {d.index for d in deltas} == {0} and json.loads("".join(d.function.arguments for d in deltas)) == {
            "zone": "UTC"}  # fmt: skip
    finally:
        await client.close()
        await http.close()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_mistral_ids_in_forced_modes(llm_engine, choice):
    """With --tool-call-parser mistral every call id is 9 letters or digits (its templates refuse others)."""
    http, client = await _open(llm_engine, tool_call_parser="mistral", enable_auto_tool_choice=True)
    try:
        kw = {"model": MODEL, "messages": MESSAGES, "tools": [TIME_TOOL], "max_tokens": 150, "tool_choice": choice,
              "parallel_tool_calls": False, "temperature": 0}  # fmt: skip
        r = await client.chat.completions.create(**kw)
        assert re.fullmatch(r"[A-Za-z0-9]{9}", r.choices[0].message.tool_calls[0].id)
        stream = await client.chat.completions.create(stream=True, **kw)
        ids = [d.id async for chunk in stream for c in chunk.choices for d in c.delta.tool_calls or [] if d.id]
        assert len(ids) == 1 and re.fullmatch(r"[A-Za-z0-9]{9}", ids[0])
    finally:
        await client.close()
        await http.close()


UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "uniqueItems": True}}}  # fmt: skip


async def test_a_keyword_the_grammar_cannot_enforce_is_a_400_naming_it(llm_engine):
    http, client = await _open(llm_engine)
    tool = {"type": "function", "function": {"name": "tag", "parameters": UNIQUE}}
    cases = [  # (request, the field the 400 names, where the keyword is)
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": UNIQUE}}},
         "response_format", "/properties/tags"),
        ({"extra_body": {"structured_outputs": {"json": UNIQUE}}}, "structured_outputs", "/properties/tags"),
        ({"extra_body": {"guided_json": UNIQUE}}, "guided_json", "/properties/tags"),
        ({"tools": [TIME_TOOL, tool], "tool_choice": "required"}, "tools", "/properties/tags"),
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "tag"}}}, "tools",
         "/properties/tags"),
    ]  # fmt: skip
    try:
        for kw, param, pointer in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, **kw)
            assert e.value.body["param"] == param
            assert f"`uniqueItems` (at {pointer})" in e.value.body["message"]
        assert "tools[1].function.parameters" in e.value.body["message"] or "tools[0]" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError, match="`uniqueItems`"):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                            extra_body={"structured_outputs": {"json": UNIQUE}})  # fmt: skip
        assert_idle(llm_engine)
    finally:
        await client.close()
        await http.close()
