"""Tool calling without a model: each parser's extraction from whole outputs, the same outputs streamed in pieces
through ToolCallOutput (the deltas put back together equal the whole), the forced schemas of tool_choice "required"
and a named function, and the request checks."""

import json
import random
import re
import sys

import jsonschema
import pytest

from aserve.entrypoints.openai.protocol import ChatCompletionRequest
from aserve.entrypoints.openai.responses import ChoiceState
from aserve.entrypoints.openai.tool_output import ToolCallOutput, tool_call_output
from aserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCall, get_tool_parser
from aserve.entrypoints.openai.tool_parsers.partial_json import object_members
from aserve.entrypoints.openai.tool_request import AUTO, NAMED, REQUIRED, forced_output, template_message
from aserve.outputs import CompletionOutput
from aserve.sampling_params import ParamError

WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ToolCall("get_time", '{"zone": "UTC"}')

# parser -> [(output text, expected content, expected calls)]
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
         "", [WEATHER]),
        ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
         '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
         "Let me check.\n", [WEATHER, TIME]),  # the text before the calls as written (vLLM's)
        ("No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>', "", [TIME]),
        ('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>', "", [TIME]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [WEATHER]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [WEATHER, TIME]),
        ("The weather is {sunny}.", "The weather is {sunny}.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', "", [WEATHER]),
        ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure. ", [WEATHER, TIME]),
        ("Just text [TOOL", "Just text [TOOL", []),
        # v11+ tokenizers (Mistral-Small-3.1/3.2, Devstral, Magistral): the name, then the arguments
        ('[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time{"zone": "UTC"}', "",
         [WEATHER, TIME]),
        ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "Sure. ", [WEATHER]),
        ('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "UTC"}', "", [TIME]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius"), get_time(zone="UTC")]', "", [WEATHER, TIME]),
        ("<|python_start|>[get_time(zone='UTC')]<|python_end|>", "", [TIME]),  # Llama 4's
        ("[1, 2] is a list", "[1, 2] is a list", []),
        ("Calling get_time(zone='UTC')", "Calling get_time(zone='UTC')", []),  # only at the start
    ],
    "qwen3_coder": [
        ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
         "celsius\n</parameter>\n</function>\n</tool_call>", "Sure.\n", [WEATHER]),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n"
         "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n"
         "</parameter>\n</function>\n</tool_call>", "", [WEATHER, TIME]),
        ("<tool_call> is the tag", "<tool_call> is the tag", []),
    ],
    "phi4_mini_json": [
        ('functools[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "get_time", "parameters": {"zone": "UTC"}}]', "", [WEATHER, TIME]),
        ("functools are handy", "functools are handy", []),
    ],
}  # fmt: skip
ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


def test_registry_has_vllm_names():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "llama4_pythonic", "qwen3_coder",
                                 "qwen3_xml", "phi4_mini_json"}  # fmt: skip
    assert TOOL_PARSERS["llama4_pythonic"] is TOOL_PARSERS["pythonic"]  # one format, two names
    assert TOOL_PARSERS["qwen3_xml"] is TOOL_PARSERS["qwen3_coder"]
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name,text,content,calls", ALL_CASES)
def test_extract_whole_output(name, text, content, calls):
    got_content, got_calls = get_tool_parser(name).extract(text)
    assert got_calls == calls
    assert got_content == content


@pytest.mark.parametrize("name, template", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": DEEP}}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": DEEP}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": DEEP}}]'),
    ("pythonic", "[f(a=DEEP)]"),
    ("phi4_mini_json", 'functools[{"name": "f", "arguments": {"a": DEEP}}]'),
])  # fmt: skip
def test_output_nested_past_the_json_parsers_depth_is_text(name, template):
    """The model's output, not the client's: a call the parser cannot read stays text (no exception), whole and
    streamed."""
    depth = sys.getrecursionlimit() + 100  # past Python's JSON parser's depth (libraries imported may raise it)
    text = template.replace("DEEP", "[" * depth + "]" * depth)
    assert get_tool_parser(name).extract(text) == (text, [])
    _stream(ToolCallOutput(AUTO, get_tool_parser(name)), text, 97)


def _stream(output: ToolCallOutput, text: str, piece: int, finish: str = "stop") -> list[dict]:
    """Feeds `text` in pieces of `piece` characters -> the chunks' choices that were sent."""
    return _feed(output, [text[start : start + piece] for start in range(0, len(text), piece)], finish)


def _feed(output: ToolCallOutput, pieces: list[str], finish: str | None = "stop") -> list[dict]:
    """Feeds the output text in `pieces`, one engine step each -> the chunks' choices that were sent."""
    choice, sent = ChoiceState(0, None), []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        choice.add(CompletionOutput(0, piece, [], finish_reason=finish if last else None), None)
        body_choice = {"index": 0, "delta": {"content": choice.delta_text}, "logprobs": None,
                       "finish_reason": choice.finish_reason}  # fmt: skip
        if output.delta(body_choice, choice):
            sent.append(body_choice)
        choice.clear_delta()
    return sent


def _joined(sent: list[dict]) -> tuple[str, list[ToolCall], str]:
    """Stream deltas put back together as a client does -> (content, calls, finish_reason)."""
    content, calls = "", {}
    for c in sent:
        content += c["delta"].get("content", "")
        for d in c["delta"].get("tool_calls", []):
            call = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or d.get("id")
            call["name"] += d.get("function", {}).get("name", "")
            call["arguments"] += d["function"]["arguments"]
    assert all(re.fullmatch(ID_FORMS, call["id"]) for call in calls.values())
    return content, [ToolCall(c["name"], c["arguments"]) for _, c in sorted(calls.items())], sent[-1]["finish_reason"]


ID_FORMS = r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}"  # OpenAI-style; Mistral's


def test_mistral_call_ids_are_what_its_templates_take_back():
    """Mistral's chat templates refuse a tool_call_id that is not 9 letters or digits."""
    text = '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]'
    for name, form in (("mistral", r"[A-Za-z0-9]{9}"), ("hermes", r"call_[0-9a-f]{24}")):
        output = ToolCallOutput(AUTO, get_tool_parser(name))
        choice = ChoiceState(0, None)
        choice.text = text if name == "mistral" else '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
        body = {"message": {"content": choice.text}, "finish_reason": "stop"}
        output.message(body, choice)
        assert re.fullmatch(form, body["message"]["tool_calls"][0]["id"])
        assert len({output.new_id() for _ in range(50)}) == 50


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
@pytest.mark.parametrize("name,text,content,calls", ALL_CASES)
def test_streamed_pieces_equal_the_whole(name, text, content, calls, piece):
    sent = _stream(ToolCallOutput(AUTO, get_tool_parser(name)), text, piece)
    got_content, got_calls, finish = _joined(sent)
    assert got_calls == calls
    assert got_content.strip() == (content if calls else text).strip()
    assert finish == ("tool_calls" if calls else "stop")


def test_stream_sends_plain_text_at_once_and_holds_a_forming_marker():
    output = ToolCallOutput(AUTO, get_tool_parser("hermes"))
    sent = _stream(output, "Hello <tool", 6, finish=None)  # never finishes: what is sent so far
    assert [c["delta"] for c in sent] == [{"content": "Hello "}]
    sent = _stream(ToolCallOutput(AUTO, get_tool_parser("hermes")), "Hello <tooth>", 6)
    assert "".join(c["delta"].get("content", "") for c in sent) == "Hello <tooth>"


def test_hermes_streams_a_call_piece_by_piece():
    output = ToolCallOutput(AUTO, get_tool_parser("hermes"))
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n<tool_call>{"na'
    sent = _stream(output, text, 5, finish=None)
    first, *rest = [d for c in sent for d in c["delta"].get("tool_calls", [])]
    # OpenAI's shape: the first delta has the index, id, type and name; the later ones only argument pieces
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_time"
    assert len(rest) >= 3 and all(d == {"index": 0, "function": {"arguments": d["function"]["arguments"]}}
                                  for d in rest)  # fmt: skip
    assert first["function"]["arguments"] + "".join(d["function"]["arguments"] for d in rest) == '{"zone": "UTC"}'
    # the second call's name is not written yet: nothing of it is sent
    assert "".join(c["delta"].get("content", "") for c in sent) == ""


# (parser, output with two calls (after text where the format allows it), the content outside the calls)
STREAMED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     "Let me check."),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {"zone": "UTC"}}', ""),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}\n'
     '{"name": "get_time", "arguments": {"zone": "UTC"}}', ""),
    ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]', "Let me check."),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
     '[{"name": "get_time", "arguments": {"zone": "UTC"}}]', ""),
    ("mistral", 'Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
     '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', "Let me check."),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time{"zone": "UTC"}',
     ""),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(zone="UTC")]', ""),
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
     "<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>", "Let me check."),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"zone": "UTC"}}]', ""),
]  # fmt: skip
# Formats whose arguments are not JSON as written: their JSON grows by whole arguments, not character by character
WHOLE_ARGUMENTS = {"pythonic", "qwen3_coder"}
STREAMED_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(STREAMED)]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from tiny_models import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def _chunks(text: str, chunking: str, tokenizer) -> list[str]:
    """The text as the engine's steps would add it: token by token (each token's text), a character at a time, or in
    seeded random pieces of 1-8 characters."""
    if chunking == "tokens":
        ids = tokenizer.encode(text, add_special_tokens=False)
        prefixes = [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]
        assert prefixes[-1] == text
        return [b[len(a) :] for a, b in zip(prefixes, prefixes[1:])]
    if chunking == "chars":
        return list(text)
    rng, pieces, pos = random.Random(int(chunking.removeprefix("random"))), [], 0
    while pos < len(text):
        size = rng.randint(1, 8)
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


@pytest.mark.parametrize("chunking", ["tokens", "chars", "random0", "random1", "random2"])
@pytest.mark.parametrize("name,text,content", STREAMED, ids=STREAMED_IDS)
def test_each_parser_streams_arguments_piece_by_piece(name, text, content, chunking, tiny_tokenizer):
    pieces = _chunks(text, chunking, tiny_tokenizer)
    sent = _feed(ToolCallOutput(AUTO, get_tool_parser(name)), pieces)
    calls = get_tool_parser(name).extract(text)[1]
    got_content, got_calls, finish = _joined(sent)
    assert got_calls == calls and len(calls) == 2 and finish == "tool_calls"
    assert got_content.strip() == content
    deltas = [(n, d) for n, c in enumerate(sent) for d in c["delta"].get("tool_calls", [])]
    assert [d["index"] for _, d in deltas] == sorted(d["index"] for _, d in deltas)  # calls in order
    for index, call in enumerate(calls):
        (n_first, first), *rest = [(n, d) for n, d in deltas if d["index"] == index]
        # OpenAI's shape: a first delta with the index, id, type and name, then only argument pieces
        assert re.fullmatch(ID_FORMS, first["id"]) and first["type"] == "function"
        assert first["function"]["name"] == call.name
        assert all(d == {"index": index, "function": {"arguments": d["function"]["arguments"]}} for _, d in rest)
        assert len({n for n, _ in rest}) == len(rest) and all(n > n_first for n, _ in rest)
        assert first["function"]["arguments"] + "".join(d["function"]["arguments"] for _, d in rest) == call.arguments
        if chunking in ("tokens", "chars"):  # the name is complete before the arguments begin
            # (where only the arguments' "{" ends the name, as in Mistral's [TOOL_CALLS]name{...}, it comes with it)
            assert first["function"]["arguments"] in ("", "{") and len(rest) >= (1 if name in WHOLE_ARGUMENTS else 3)
        else:
            assert len(rest) >= 1
    # the first call's arguments go out while it is written, not once the output is complete
    assert [n for n, d in deltas if d["index"] == 0][-1] < len(sent) - 1


@pytest.mark.parametrize("name,text,content", STREAMED, ids=STREAMED_IDS)
def test_a_call_cut_short_keeps_what_was_streamed(name, text, content):
    cut = text.index("Paris") + 3  # max_tokens ends the output inside the first call's arguments
    sent = _stream(ToolCallOutput(AUTO, get_tool_parser(name)), text[:cut], 1, finish="length")
    got_content, [call], finish = _joined(sent)
    assert got_content.strip() == content and finish == "length"
    # what was written of the arguments' JSON (of whole arguments only, where the format is not JSON)
    assert call.name == "get_weather" and call.arguments == {"pythonic": "", "qwen3_coder": "{"}.get(
        name, '{"city": "Par'
    )


def test_partial_json_members():
    text = '{"name": "f", "n": 12, "arguments": {"a": "}\\"", "b": [1, {"c": 2}]}}'
    members = object_members(text)
    assert [(k, text[s:e]) for k, s, e in members] == [
        ("name", '"f"'), ("n", "12"), ("arguments", '{"a": "}\\"", "b": [1, {"c": 2}]}')]  # fmt: skip
    for cut in range(len(text)):
        partial = object_members(text[:cut])
        assert all(e is None or (k, s, e) in members for k, s, e in partial)  # a finished member never changes
        assert all(e is not None for _, _, e in partial[:-1])


def test_named_streams_argument_pieces_after_a_first_delta_with_the_name():
    sent = _stream(ToolCallOutput(NAMED, name="get_time"), '{"zone": "UTC"}', 4)
    first = sent[0]["delta"]["tool_calls"][0]
    assert first["function"]["name"] == "get_time" and first["type"] == "function" and first["index"] == 0
    assert all("name" not in c["delta"]["tool_calls"][0]["function"] for c in sent[1:])
    assert _joined(sent) == ("", [TIME], "stop")  # a forced function finishes on "stop" (OpenAI's, vLLM's)


def test_required_output_is_a_list_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, ' \
           '{"name": "get_time", "parameters": {"zone": "UTC"}}]'  # fmt: skip
    output = ToolCallOutput(REQUIRED)
    assert output.calls(text) == ("", [WEATHER, TIME])
    assert _joined(_stream(ToolCallOutput(REQUIRED), text, 9)) == ("", [WEATHER, TIME], "tool_calls")
    assert output.calls('[{"name": "get_ti') == ('[{"name": "get_ti', [])  # cut short by max_tokens


def test_message_rewrite():
    choice = ChoiceState(0, None)
    text = 'Checking. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    choice.add(CompletionOutput(0, text, [], finish_reason="stop"), None)
    body_choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    ToolCallOutput(AUTO, get_tool_parser("hermes")).message(body_choice, choice)
    assert body_choice["finish_reason"] == "tool_calls"
    assert body_choice["message"]["content"] == "Checking. "  # as written before the call (vLLM keeps the space)
    [call] = body_choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]  # fmt: skip


def test_forced_schemas():
    named = forced_output(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True)
    assert named.json == TOOLS[1]["function"]["parameters"]
    required = forced_output(TOOLS, "required", False).json
    good = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]
    jsonschema.validate(good, required)
    for bad in ([], good * 2, [{"name": "get_time", "parameters": {"city": "Paris", "unit": "celsius"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    assert forced_output(TOOLS, "auto", True) is None


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_request_checks(kw, param):
    import msgspec

    req = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **kw}, ChatCompletionRequest)
    with pytest.raises(ParamError) as e:
        req.check_limits()
    assert e.value.param == param


def test_auto_needs_the_server_flags():
    req = _request(tools=TOOLS)
    with pytest.raises(ParamError, match="--enable-auto-tool-choice"):
        tool_call_output(req, None, False)
    assert tool_call_output(req, get_tool_parser("hermes"), True).mode == AUTO
    assert tool_call_output(_request(tools=TOOLS, tool_choice="none"), None, False) is None
    assert tool_call_output(_request(tools=TOOLS, tool_choice="required"), None, False).mode == REQUIRED
    assert _request(tools=TOOLS, chat_template_kwargs={"x": 1}).template_kwargs() == {"x": 1, "tools": TOOLS}


def test_sampling_params_carry_the_forced_schema():
    req = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    req.check_limits()
    assert req.to_sampling_params(8).structured_outputs.json == TOOLS[0]["function"]["parameters"]


def test_earlier_tool_calls_reach_the_template_with_object_arguments():
    msg = {"role": "assistant", "content": None,
           "tool_calls": [{"id": "call_1", "type": "function",
                           "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}  # fmt: skip
    assert template_message(msg)["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "12"}
    conv = ChatCompletionRequest(messages=[{"role": "user", "content": "time?"}, msg, result]).conversation()
    assert conv[1]["content"] == "" and conv[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    assert conv[2] == {"role": "tool", "tool_call_id": "call_1", "content": "12"}
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}  # the request is unchanged


# A Hermes-like template: the tools in the system turn, earlier calls as <tool_call> blocks, results as tool turns.
_TOOL_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_tools_and_earlier_calls_render_through_the_template(tmp_path):
    import asyncio

    from tiny_models import build_tokenizer

    from aserve.engine.llm_engine import TokenizerPool

    tokenizer = build_tokenizer(str(tmp_path))
    tokenizer.chat_template = _TOOL_TEMPLATE
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    req = _request(tools=TOOLS, chat_template_kwargs={"unused": 1})
    req.messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]  # fmt: skip
    pool = TokenizerPool(tokenizer)
    ids = asyncio.run(pool.render_chat(req.conversation(), True, req.template_kwargs(), 0, lambda n: None))
    pool.shutdown()
    assert tokenizer.decode(ids) == (
        "tools: get_weather get_timeuser: hi"
        'assistant: <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
        "tool: 12:00assistant:"
    )


def test_only_parsers_whose_markers_are_special_tokens_keep_them_in_the_text():
    """Mistral's [TOOL_CALLS] is a special token the parser must see, and so is <tool_call> in some Hermes-format
    checkpoints (vLLM's hermes parser keeps special tokens too); Llama 3's calls start with "{" once <|python_tag|>
    is skipped, so its requests keep skip_special_tokens (no stray special token in the content). Forced modes ask
    the same as auto (vLLM's rule: tools given and tool_choice not "none")."""
    from aserve import SamplingParams

    for name, keeps in (("mistral", True), ("llama3_json", False), ("hermes", True)):
        for mode in (AUTO, REQUIRED):
            params = SamplingParams()
            ToolCallOutput(mode, get_tool_parser(name)).adjust(params)
            assert params.skip_special_tokens is not keeps
    assert get_tool_parser("llama3_json").extract('{"name": "get_time", "parameters": {"zone": "UTC"}}')[1] == [TIME]
