"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), driven by the official openai client as a user
drives it: against the app with a tiny random model (aiohttp test server) for the request and response shapes, the
stream's events, tool round trips, stored responses and errors; `aserve serve` with the embedded default model for
a real answer (slow)."""

import asyncio
import json
import pathlib
import re

import jsonschema
import pytest
from test_server import assert_idle, make_client, metric

from aserve.entrypoints.openai.request_fields import IGNORED_FIELDS
from aserve.entrypoints.openai.responses_protocol import RESPONSES_REFUSED, ResponsesRequest

openai = pytest.importorskip("openai")
from openai.types.responses import response_create_params  # noqa: E402

MODEL = "tiny"
TIME_TOOL = {"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}  # fmt: skip
TIME_SCHEMA = TIME_TOOL["parameters"]
GREEDY = {"model": MODEL, "temperature": 0}
# a bounded answer the random model completes well within its tokens
ANSWER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "ok": {"type": "boolean"}},
                 "required": ["city", "ok"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def llm_engine(tiny_model):
    from aserve import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=256,
                                served_model_name=MODEL, debug_invariants=True))  # fmt: skip


async def open_client(llm_engine, **api):
    """(the app's test client, an openai.AsyncOpenAI pointed at it)."""
    http = await make_client(llm_engine, **api)
    client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="unused", max_retries=0, timeout=120)
    return http, client


@pytest.fixture
async def clients(llm_engine):
    http, client = await open_client(llm_engine)
    yield http, client
    await client.close()
    await http.close()


@pytest.fixture
def client(clients):
    return clients[1]


async def stream_events(client, **kw) -> list:
    stream = await client.responses.create(stream=True, **kw)
    return [event async for event in stream]


def deltas(events, kind: str) -> str:
    return "".join(e.delta for e in events if e.type == kind)


async def test_text_response_runs_the_chat_path(client, llm_engine):
    """A string input is one user message: the same prompt, the same greedy text as the chat endpoint; the object
    carries OpenAI's fields, the parameters as they applied, usage with its details."""
    r = await client.responses.create(input="Hello", max_output_tokens=8, **GREEDY)
    chat = await client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                                **GREEDY)  # fmt: skip
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL and r.created_at > 0
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and r.output_text == chat.choices[0].message.content != ""
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.temperature, r.top_p, r.max_output_tokens, r.tool_choice, r.tools) == (0, 1, 8, "auto", [])
    assert r.text.format.type == "text" and r.store is True and r.metadata == {} and r.error is None
    assert_idle(llm_engine)


async def test_max_output_tokens_makes_an_incomplete_response(client):
    r = await client.responses.create(input="Hello", max_output_tokens=5, extra_body={"ignore_eos": True}, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


async def test_stream_events_join_to_the_whole_response(client, llm_engine):
    """The stream's events come in OpenAI's order with sequence numbers from 0; the text deltas join to the final
    text, which is the non-streamed greedy text; the client's own accumulator (responses.stream) agrees."""
    request = {"input": "The cache", "max_output_tokens": 12, **GREEDY}
    whole = await client.responses.create(**request)
    events = await stream_events(client, **request)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 9
    text = deltas(events, "response.output_text.delta")
    assert text == events[-4].text == events[-1].response.output_text == whole.output_text != ""
    assert events[0].response.status == "in_progress" and events[-1].response.status == whole.status
    usage = events[-1].response.usage
    assert events[-1].response.id == events[0].response.id
    assert (usage.input_tokens, usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert usage.input_tokens_details.cached_tokens > 0  # the prompt of the request before, from the prefix cache
    async with client.responses.stream(**request) as stream:
        final = await stream.get_final_response()
    assert final.output_text == whole.output_text
    assert_idle(llm_engine)


async def test_instructions_and_message_items_render_as_chat_messages(client):
    """instructions (a system message first), developer / user / assistant messages with string or text-part
    content: the prompt the chat endpoint renders for the same messages."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "And now?"},
    ]
    messages = [{"role": "system", "content": "You count."}, {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "And now?"}]  # fmt: skip
    r = await client.responses.create(instructions="You count.", input=items, max_output_tokens=6, **GREEDY)
    chat = await client.chat.completions.create(messages=messages, max_tokens=6, **GREEDY)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.output_text == chat.choices[0].message.content
    assert r.instructions == "You count."


@pytest.mark.parametrize("stream", [False, True])
async def test_json_schema_format_gives_valid_json(client, stream):
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    request = {"input": "Capital of France?", "text": text, "max_output_tokens": 60, **GREEDY}
    if stream:
        response = (await stream_events(client, **request))[-1].response
    else:
        response = await client.responses.create(**request)
    assert response.status == "completed" and response.text.format.name == "answer"
    jsonschema.validate(json.loads(response.output_text), ANSWER_SCHEMA)
    r = await client.responses.create(input="JSON", text={"format": {"type": "json_object"}}, max_output_tokens=60,
                                      extra_body={"structured_outputs": None}, **GREEDY)  # fmt: skip
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


async def test_forced_tool_call_round_trip(client, llm_engine):
    """A named tool_choice forces a function_call item with valid arguments; its output goes back as a
    function_call_output item, in the whole input or after previous_response_id, to the same prompt."""
    question = {"role": "user", "content": "What time is it in Paris?"}
    first = await client.responses.create(input=[question], tools=[TIME_TOOL], max_output_tokens=40,
                                          tool_choice={"type": "function", "name": "get_time"}, **GREEDY)  # fmt: skip
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
    assert first.status == "completed" and call.id.startswith("fc_") and first.output_text == ""
    jsonschema.validate(json.loads(call.arguments), TIME_SCHEMA)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
    whole = await client.responses.create(input=[question, *(i.model_dump(exclude_none=True) for i in first.output),
                                                 result], tools=[TIME_TOOL], tool_choice="none",
                                          max_output_tokens=4, **GREEDY)  # fmt: skip
    chained = await client.responses.create(previous_response_id=first.id, input=[result], tools=[TIME_TOOL],
                                            tool_choice="none", max_output_tokens=4, **GREEDY)  # fmt: skip
    assert whole.output[0].type == chained.output[0].type == "message"
    assert chained.previous_response_id == first.id and whole.output_text == chained.output_text
    assert whole.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens
    assert_idle(llm_engine)


async def test_streamed_tool_calls(client):
    """A named function's arguments stream as function_call_arguments deltas; "required" sends whole calls."""
    request = {"input": "Time?", "tools": [TIME_TOOL], "max_output_tokens": 40, **GREEDY}
    events = await stream_events(client, tool_choice={"type": "function", "name": "get_time"}, **request)
    added = next(e for e in events if e.type == "response.output_item.added")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert added.item.type == "function_call" and added.item.name == "get_time" and added.item.arguments == ""
    arguments = deltas(events, "response.function_call_arguments.delta")
    assert arguments == done.arguments and done.name == "get_time" and done.item_id == added.item.id
    [call] = events[-1].response.output
    assert call.arguments == arguments and call.call_id == added.item.call_id
    jsonschema.validate(json.loads(arguments), TIME_SCHEMA)
    request["max_output_tokens"] = 120  # a list of calls, forced, in the tiny model's many byte tokens
    events = await stream_events(client, tool_choice="required", parallel_tool_calls=False, **request)
    [call] = events[-1].response.output
    assert call.type == "function_call" and call.name == "get_time"
    assert deltas(events, "response.function_call_arguments.delta") == call.arguments


async def test_logprobs_are_included_when_asked_for(client):
    r = await client.responses.create(input="Hello", max_output_tokens=4, include=["message.output_text.logprobs"],
                                      top_logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens == 4 and r.top_logprobs == 2
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert logprobs[0].top_logprobs[0].logprob >= logprobs[0].top_logprobs[1].logprob
    events = await stream_events(client, input="Hello", max_output_tokens=4, include=["message.output_text.logprobs"],
                                 top_logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    final = events[-1].response.output[0].content[0].logprobs
    assert streamed == [lp.token for lp in logprobs] == [lp.token for lp in final]


async def test_stored_responses(client):
    """Responses, whole or streamed, are stored unless store is false: GET /v1/responses/{id} returns them;
    metadata is echoed; cancelling one is refused (it is complete), as is cancelling an id not stored."""
    r = await client.responses.create(input="Hi", max_output_tokens=3, metadata={"run": "7"}, **GREEDY)
    got = await client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"run": "7"}
    streamed = (await stream_events(client, input="Hi", max_output_tokens=3, **GREEDY))[-1].response
    assert (await client.responses.retrieve(streamed.id)).model_dump() == streamed.model_dump()
    unstored = await client.responses.create(input="Hi", max_output_tokens=3, store=False, **GREEDY)
    assert unstored.store is False
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(missing)
        with pytest.raises(openai.NotFoundError):
            await client.responses.cancel(missing)
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's answer for a response not made in the background
        await client.responses.cancel(r.id)
    assert e.value.body["message"] == "Cannot cancel a synchronous response." and e.value.body["param"] == "response_id"
    assert (await client.responses.retrieve(r.id)).model_dump() == r.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        await client.responses.create(input="Hi", previous_response_id=unstored.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "fields,status,param",
    [
        ({"frobnicate": 1}, 400, "frobnicate"),  # unrecognised: OpenAI's answer
        ({"background": True}, 400, "background"),
        ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
        ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
        ({"top_logprobs": 2}, 400, "top_logprobs"),  # without include
        ({"reasoning": {"summary": "auto"}}, 400, "reasoning.summary"),
        ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
        ({"text": {"verbosity": "low"}}, 400, "text.verbosity"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, 400, "text.format"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"tools": [TIME_TOOL]}, 400, "tool_choice"),  # "auto" needs --enable-auto-tool-choice
        ({"tools": [TIME_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
        ({"input": [{"type": "computer_call", "id": "c"}]}, 400, "input[0].type"),
        ({"input": [{"type": "reasoning", "content": 5}]}, 400, "input[0].content"),
        ({"input": [{"type": "reasoning", "summary": 5}]}, 400, "input[0].summary"),
        ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]}, 400,
         "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
         "input[0].content[0]"),
        ({"max_output_tokens": 10_000}, 400, "max_output_tokens"),
        ({"input": "x" * 100_000}, 400, "input"),
        ({"model": "gpt-5"}, 404, "model"),
        ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ],
)  # fmt: skip
async def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(clients, llm_engine, fields, status, param):
    http, _ = clients
    resp = await http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **fields})
    assert resp.status == status
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    if param == "frobnicate":
        assert error["message"] == "Unrecognized request argument supplied: frobnicate"
    ok = await http.post("/v1/responses", json={"input": "ok", "max_output_tokens": 2})
    assert ok.status == 200 and (await ok.json())["status"] in ("completed", "incomplete")
    assert_idle(llm_engine)


async def test_unknown_field_through_the_client(client):
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: frobnicate"):
        await client.responses.create(input="Hi", extra_body={"frobnicate": 1}, **GREEDY)


async def test_disconnect_mid_stream_aborts_and_frees_kv(clients, llm_engine):
    http, _ = clients
    resp = await http.post("/v1/responses", json={"input": "x" * 20, "max_output_tokens": 150, "stream": True,
                                                  "ignore_eos": True})  # fmt: skip
    assert resp.status == 200
    while b"response.output_text.delta" not in await resp.content.readuntil(b"\n\n"):
        pass
    scheduler = llm_engine.core.scheduler
    assert scheduler.has_unfinished()
    resp.close()  # the client goes away: its request ends before its 150 tokens
    await asyncio.wait_for(_until(lambda: not scheduler.has_unfinished()), 5)
    assert_idle(llm_engine)  # its KV blocks are free
    aborted = 'aserve:request_success_total{finished_reason="abort",model_name="tiny"}'
    assert metric(await (await http.get("/metrics")).text(), aborted) >= 1


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def test_a_fault_mid_stream_ends_with_error_and_failed_events(client, llm_engine, monkeypatch):
    """A request that fails while streaming (here its detokenizer) ends with OpenAI's `error` event and
    response.failed; unstreamed, it is a 500; the server goes on serving."""
    from aserve.engine.detokenizer import IncrementalDetokenizer

    real_add = IncrementalDetokenizer.add_token

    def add_token(self, token_id):
        self.seen = getattr(self, "seen", 0) + 1
        if self.seen == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real_add(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", add_token)
    request = {"input": "Hello", "max_output_tokens": 8, "extra_body": {"ignore_eos": True}, **GREEDY}
    events = await stream_events(client, **request)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    error, failed = events[-2:]
    assert error.type == "error" and error.code == "server_error" and error.message
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.message == error.message
    with pytest.raises(openai.InternalServerError):
        await client.responses.create(**request)
    monkeypatch.undo()
    assert (await client.responses.create(**request)).usage.output_tokens == 8
    assert_idle(llm_engine)


# The tiny model writes what the grammar lets it: a reply in a thinking model's shape
THINKING = "<think>[a-z]{2,6}</think>[a-z]{2,6}"


async def test_reasoning_items_with_a_reasoning_parser(llm_engine):
    """--reasoning-parser: the reasoning is an item of its own before the message, streamed as reasoning_text
    events, counted in usage; reasoning.effort "none" turns thinking off (all content, as chat's
    reasoning_effort)."""
    http, client = await open_client(llm_engine, reasoning_parser="qwen3")
    try:
        request = {"input": "Hi", "max_output_tokens": 40, "extra_body": {"structured_outputs": {"regex": THINKING}},
                   **GREEDY}  # fmt: skip
        r = await client.responses.create(**request)
        reasoning, message = r.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and message.type == "message"
        assert re.fullmatch("[a-z]{2,6}", reasoning.content[0].text) and re.fullmatch("[a-z]{2,6}", r.output_text)
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        events = await stream_events(client, **request)
        assert deltas(events, "response.reasoning_text.delta") == reasoning.content[0].text
        assert deltas(events, "response.output_text.delta") == r.output_text
        assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
        streamed_usage = events[-1].response.usage.output_tokens_details.reasoning_tokens
        thinking = await client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
                                                        extra_body=request["extra_body"], **GREEDY)  # fmt: skip
        counted = thinking.usage.completion_tokens_details.reasoning_tokens  # chat's count of the same reply
        assert r.usage.output_tokens_details.reasoning_tokens == streamed_usage == counted
        off = await client.responses.create(reasoning={"effort": "none"}, **request)
        assert [i.type for i in off.output] == ["message"] and off.output_text.startswith("<think>")
        assert off.reasoning.effort == "none" and off.usage.output_tokens_details.reasoning_tokens == 0
        chat = await client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=40,
                                                    reasoning_effort="none", extra_body=request["extra_body"],
                                                    **GREEDY)  # fmt: skip
        assert chat.choices[0].message.content == off.output_text  # the chat endpoint reads it the same way
        assert_idle(llm_engine)
    finally:
        await client.close()
        await http.close()


def test_every_openai_field_is_decided_and_documented():
    """Every field of the openai client's responses.create is a field of the request type (implemented, accepted
    without effect, or refused with a 400 naming it), never unrecognised; the README names each."""
    fields = set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert fields <= set(ResponsesRequest.__struct_fields__)
    assert set(RESPONSES_REFUSED) <= set(ResponsesRequest.__struct_fields__)
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("Responses API") :]
    missing = sorted(f for f in fields | set(RESPONSES_REFUSED) if f"`{f}`" not in section and f not in IGNORED_FIELDS)
    assert not missing, f"README.md's Responses API paragraph does not name {missing}"


@pytest.mark.slow
def test_the_default_model_answers():
    from aserve_server import running_server

    with running_server() as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        request = {"model": "SmolLM2-135M-Instruct", "input": "What is the capital of France?",
                   "instructions": "Answer in one sentence.", "temperature": 0, "max_output_tokens": 32}  # fmt: skip
        r = client.responses.create(**request)
        assert "Paris" in r.output_text and r.status == "completed"
        with client.responses.stream(**request) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            assert text == stream.get_final_response().output_text == r.output_text


async def test_truncation_auto_leaves_room_for_the_output(client, llm_engine):
    """truncation "auto" drops the start of an input longer than the context, keeping max_output_tokens of room for
    the reply; without it the same input is refused."""
    long_input = "the cache " * 200  # more tokens than max_model_len (256)
    r = await client.responses.create(input=long_input, max_output_tokens=5, truncation="auto",
                                      extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
    assert r.status == "incomplete" and r.truncation == "auto"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (256 - 5, 5)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(input=long_input, max_output_tokens=5, **GREEDY)
    assert_idle(llm_engine)
