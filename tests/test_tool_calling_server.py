"""Tool calling as users ask for it: the official openai client against `aserve serve` with the embedded default model
(SmolLM2-135M-Instruct). tool_choice "required" and a named function are forced by the tools' schemas, so the parsed
arguments validate every time, streamed or not; tool_choice "auto" is parsed by each --tool-call-parser from output
that a regex (vLLM's structured_outputs) makes take that parser's format; an earlier call and its `role: "tool"`
result go back through the template; "auto" without --enable-auto-tool-choice is a 400 naming the flag."""

import json
import re

import jsonschema
import pytest
from aserve_server import running_server

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"

# Bounded (enums, maxLength) so that a forced call ends well within max_tokens.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 12},
         "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
     "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                    "required": ["zone"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time in UTC?"}]

# What each parser reads, forced with a regex so that the random-enough default model writes it.
FORMATS = {
    "hermes": r'Checking\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>',
    "llama3_json": r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}',
    "mistral": r'Checking\. \[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\]',
}
CONTENT = {"hermes": "Checking. ", "llama3_json": None, "mistral": "Checking. "}  # the text before a call as written


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def plain():
    """A server without tool-call flags."""
    with running_server() as url:
        yield _client(url)


@pytest.fixture(
    scope="module", params=["hermes", *(pytest.param(p, marks=pytest.mark.slow) for p in ("llama3_json", "mistral"))]
)
def auto(request):
    with running_server("--enable-auto-tool-choice", "--tool-call-parser", request.param) as url:
        yield request.param, _client(url)


def _check_calls(calls, names=None) -> None:
    assert calls
    for call in calls:
        # Mistral's templates take only 9-character alphanumeric ids back (as vLLM makes them for that parser)
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}", call.id)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert names is None or call.function.name in names


def _streamed(stream) -> tuple[str, list[dict], str]:
    """A stream's deltas put back together -> (content, calls as dicts, finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                if d.function.name:
                    assert not call["name"], "a call's name comes once, in its first delta"
                    call["name"] = d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_function_is_called_with_valid_arguments(plain, name):
    choice = {"type": "function", "function": {"name": name}}
    r = plain.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=60,
                                      temperature=0)  # fmt: skip
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == name and r.choices[0].finish_reason == "stop"  # forced: OpenAI's "stop"
    _check_calls([call])


def test_named_function_streams_argument_pieces(plain):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    stream = plain.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, stream=True,
                                           tool_choice=choice, temperature=0)  # fmt: skip
    content, [call], finish = _streamed(stream)
    assert content == "" and finish == "stop" and call["id"].startswith("call_")
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_one_of_the_tools(plain, parallel):
    r = plain.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=parallel, max_tokens=120, temperature=0)  # fmt: skip
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    _check_calls(message.tool_calls)
    assert parallel or len(message.tool_calls) == 1


def test_required_streams_calls_as_they_are_written(plain):
    stream = plain.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, stream=True,
                                           temperature=0)  # fmt: skip
    chunks = list(stream)
    content, [call], finish = _streamed(chunks)
    assert content == "" and finish == "tool_calls"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    pieces = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or []]
    assert len(pieces) > 3 and pieces[0].function.name == call["name"]  # the name first, then argument pieces


def test_tool_results_render_through_the_template(plain):
    choice = {"type": "function", "function": {"name": "get_time"}}
    first = plain.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                          tool_choice=choice, temperature=0)  # fmt: skip
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*MESSAGES, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]  # fmt: skip
    r = plain.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > first.usage.prompt_tokens


def test_auto_without_the_flag_is_refused(plain):
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as e:
        plain.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=5)
    assert e.value.body["param"] == "tool_choice"
    r = plain.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert r.choices[0].message.tool_calls is None


def test_auto_parses_each_format(auto):
    parser, client = auto
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                       extra_body={"structured_outputs": {"regex": FORMATS[parser]}})  # fmt: skip
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == CONTENT[parser]
    _check_calls(message.tool_calls, names={"get_time"})


def test_auto_streams_each_format(auto):
    parser, client = auto
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, stream=True,
                                            extra_body={"structured_outputs": {"regex": FORMATS[parser]}})  # fmt: skip
    content, [call], finish = _streamed(stream)
    assert finish == "tool_calls" and content == (CONTENT[parser] or "")  # as the whole message's content
    assert call["name"] == "get_time" and json.loads(call["arguments"])["zone"] in ("UTC", "CET")


def test_auto_streams_arguments_piece_by_piece(auto):
    parser, client = auto
    forced = {"structured_outputs": {"regex": FORMATS[parser]}}
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, stream=True,
                                            extra_body=forced)  # fmt: skip
    first, *rest = [d for chunk in stream for choice in chunk.choices for d in choice.delta.tool_calls or []]
    assert first.index == 0 and re.fullmatch(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}", first.id) and first.type == "function"
    assert first.function.name == "get_time"
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = first.function.arguments + "".join(d.function.arguments for d in rest)
    assert json.loads(arguments)["zone"] in ("UTC", "CET")


def test_auto_without_a_call_is_plain_text(auto):
    _, client = auto
    # max_tokens: room for the 11 characters one token each, and the end of text the finished regex leaves
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=16,
                                       extra_body={"structured_outputs": {"regex": "It is sunny"}})  # fmt: skip
    assert r.choices[0].message.content == "It is sunny" and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"


def test_a_tool_schema_that_does_not_compile_is_a_400_naming_tools(plain):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        plain.chat.completions.create(model=MODEL, messages=MESSAGES, tools=bad, max_tokens=5,
                                      tool_choice={"type": "function", "function": {"name": "f"}})  # fmt: skip
    assert e.value.body["param"] == "tools"
