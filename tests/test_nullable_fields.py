"""Null where OpenAI's API allows it, as the official openai client sends it for a field given as None: `n`, the
penalties, `stream` (the Responses API's too), chat's `logprobs` and `parallel_tool_calls`, completions' `echo` mean
their defaults (vLLM reads them so); vLLM's own fields take no null, as in vLLM. stream_options as vLLM reads it:
present, it asks for the usage chunk unless include_usage is false or null."""

import pytest
from test_responses_api import MODEL, client, clients, llm_engine  # noqa: F401  (the fixtures)
from test_server import assert_idle

openai = pytest.importorskip("openai")

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
        "extra_body": {"ignore_eos": True}}  # fmt: skip
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
NULLS = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None}


async def test_null_means_the_default(client, llm_engine):  # noqa: F811
    chat = await client.chat.completions.create(**CHAT)
    nulls = await client.chat.completions.create(**CHAT, **NULLS, logprobs=None, parallel_tool_calls=None)
    assert [c.message.content for c in nulls.choices] == [chat.choices[0].message.content]
    assert nulls.choices[0].logprobs is None and nulls.usage.completion_tokens == 4
    completion = await client.completions.create(**COMPLETION)
    nulls = await client.completions.create(**COMPLETION, **NULLS, echo=None)
    assert [c.text for c in nulls.choices] == [completion.choices[0].text]
    assert nulls.usage.completion_tokens == 4 and not nulls.choices[0].text.startswith("Hello")  # echo: off
    response = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, stream=None)
    assert response.status == "incomplete" and response.usage.output_tokens == 2
    for field in ("ignore_eos", "min_tokens", "skip_special_tokens"):  # vLLM's fields: null is a 400, as in vLLM
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(**{**COMPLETION, "extra_body": {field: None}})
        assert err.value.body["param"] == field
    assert_idle(llm_engine)


@pytest.mark.parametrize(
    "options,usage_on",
    [
        ({}, "last"),  # vLLM's include_usage default: true
        ({"include_usage": True}, "last"),
        ({"include_usage": None}, "none"),
        ({"include_usage": False}, "none"),
        ({"continuous_usage_stats": True}, "every"),
        ({"include_usage": None, "continuous_usage_stats": True}, "none"),
        ({"include_usage": True, "continuous_usage_stats": None}, "last"),
    ],
)
async def test_stream_options_as_vllm_reads_them(client, llm_engine, options, usage_on):  # noqa: F811
    for create, fields in ((client.chat.completions.create, CHAT), (client.completions.create, COMPLETION)):
        chunks = [c async for c in await create(**fields, stream=True, stream_options=options)]
        with_usage = [c.usage is not None for c in chunks]
        assert with_usage == {"none": [False] * len(chunks), "every": [True] * len(chunks),
                              "last": [False] * (len(chunks) - 1) + [True]}[usage_on]  # fmt: skip
        if usage_on != "none":
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert_idle(llm_engine)
