"""The tool-call parsers added for the families aserve loads, as a client meets them: the official openai client
against the app (`--enable-auto-tool-choice --tool-call-parser NAME`) with a tiny random model whose output a regex
forces into the format (vLLM's structured_outputs), whole and streamed (the name first, then argument pieces, put
back together equal to the whole); and a call sent back through a chat template of the family's shape, which writes
it in the format again."""

import json

import pytest
from test_responses_api import open_client
from test_server import assert_idle

openai = pytest.importorskip("openai")

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Time in UTC and CET?"}]
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "hours": {"type": "integer"}},
    "required": ["zone"]}}}  # fmt: skip

# parser -> (a regex whose language is two calls in its format, the content before them)
FORMATS = {
    "pythonic": (r"\[get_time\(zone='(UTC|CET)', hours=[1-9]\), get_time\(zone=\"CET\"\)\]", None),
    "llama4_pythonic": (r"<\|python_start\|>\[get_time\(zone='UTC', hours=[1-9]\), get_time\(zone=\"CET\"\)\]"
                        r"<\|python_end\|>", None),
    "qwen3_coder": (r"Sure\.\n<tool_call>\n<function=get_time>\n<parameter=zone>\n(UTC|CET)\n</parameter>\n"
                    r"<parameter=hours>\n[1-9]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    r"<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>", "Sure.\n"),
    "qwen3_xml": (r"<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n<parameter=hours>\n"
                  r"[1-9]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                  r"<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>", None),
    "phi4_mini_json": (r'functools\[\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)", "hours": [1-9]\}\}, '
                       r'\{"name": "get_time", "arguments": \{"zone": "CET"\}\}\]', None),
    "mistral": (r'Ok\. \[TOOL_CALLS\]get_time\[ARGS\]\{"zone": "(UTC|CET)", "hours": [1-9]\}'
                r'\[TOOL_CALLS\]get_time\{"zone": "CET"\}', "Ok. "),
}  # fmt: skip


@pytest.fixture(scope="module")
def llm_engine(tiny_model):
    from aserve import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=512,
                                served_model_name=MODEL, debug_invariants=True))  # fmt: skip


async def _streamed(stream) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": "", "pieces": 0})
                assert d.function.name is None or call["pieces"] == 0, "a call's name comes once, first"
                call["arguments"] += d.function.arguments or ""
                call["pieces"] += 1
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# vLLM's second names for a format (the same parser here) run in the slow set
ALIASES = ("llama4_pythonic", "qwen3_xml")


@pytest.mark.parametrize("parser", [pytest.param(p, marks=pytest.mark.slow) if p in ALIASES else p for p in FORMATS])
async def test_each_format_whole_and_streamed(llm_engine, parser):
    regex, content = FORMATS[parser]
    http, client = await open_client(llm_engine, tool_call_parser=parser, enable_auto_tool_choice=True)
    try:
        kw = {"model": MODEL, "messages": MESSAGES, "tools": [TIME_TOOL], "max_tokens": 300, "temperature": 0,
              "extra_body": {"structured_outputs": {"regex": regex}}}  # fmt: skip
        r = await client.chat.completions.create(**kw)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.content == content
        first, second = [json.loads(c.function.arguments) for c in message.tool_calls]
        assert [c.function.name for c in message.tool_calls] == ["get_time", "get_time"]
        assert first["zone"] in ("UTC", "CET") and first["hours"] in range(1, 10) and second == {"zone": "CET"}
        streamed_content, calls, finish = await _streamed(await client.chat.completions.create(stream=True, **kw))
        assert finish == "tool_calls" and streamed_content == (content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", first), ("get_time", second)]
        assert calls[0]["pieces"] >= 2  # the name first, the arguments after it
        assert_idle(llm_engine)
    finally:
        await client.close()
        await http.close()


# Chat templates in the shape of each family's: an earlier call written back in its format, its result a turn
TEMPLATES = {
    "pythonic": (
        "{% for m in messages %}{{ m['role'] }}: {% if m.get('tool_calls') %}[{% for c in m['tool_calls'] %}"
        "{{ c['function']['name'] }}({% for k, v in c['function']['arguments'].items() %}{{ k }}={{ v | tojson }}"
        "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]"
        "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}assistant:"
    ),
    "qwen3_coder": (
        "{% for m in messages %}{{ m['role'] }}: {% for c in m.get('tool_calls') or [] %}<tool_call>\n<function="
        "{{ c['function']['name'] }}>\n{% for k, v in c['function']['arguments'].items() %}<parameter={{ k }}>\n"
        "{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}{{ m['content'] or '' }}"
        "{{ '\\n' }}{% endfor %}assistant:"
    ),
}  # fmt: skip
WRITTEN_BACK = {
    "pythonic": 'assistant: [get_time(zone="UTC", hours=3)]\ntool: 12:00\nassistant:',
    "qwen3_coder": "assistant: <tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n<parameter=hours>"
                   "\n3\n</parameter>\n</function>\n</tool_call>\ntool: 12:00\nassistant:",
}  # fmt: skip


@pytest.mark.parametrize("parser", sorted(TEMPLATES))
async def test_a_call_goes_back_through_the_template_in_its_format(llm_engine, parser):
    regex = {"pythonic": r"\[get_time\(zone='UTC', hours=3\)\]",
             "qwen3_coder": r"<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
                            r"<parameter=hours>\n3\n</parameter>\n</function>\n</tool_call>"}[parser]  # fmt: skip
    http, client = await open_client(llm_engine, tool_call_parser=parser, enable_auto_tool_choice=True,
                                     trust_request_chat_template=True)  # fmt: skip
    try:
        r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[TIME_TOOL], max_tokens=200,
                                                 extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
        message = r.choices[0].message
        assert json.loads(message.tool_calls[0].function.arguments) == {"zone": "UTC", "hours": 3}
        history = [*MESSAGES, message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "12:00"}]  # fmt: skip
        resp = await http.post("/tokenize", json={"model": MODEL, "messages": history, "tools": [TIME_TOOL],
                                                  "chat_template": TEMPLATES[parser]})  # fmt: skip
        rendered = await (
            await http.post("/detokenize", json={"model": MODEL, "tokens": (await resp.json())["tokens"]})
        ).json()
        assert rendered["prompt"].endswith(WRITTEN_BACK[parser])
    finally:
        await client.close()
        await http.close()
