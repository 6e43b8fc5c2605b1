"""Structural tags (vLLM's response_format type "structural_tag" and structured_outputs.structural_tag, compiled by
xgrammar): the official openai client against `aserve serve` with the embedded default model, the output held to a
tag around a JSON schema; the older structures / triggers form, where text is free until a trigger; errors."""

import json
import re

import pytest
import xgrammar as xgr
from aserve_server import running_server

from aserve import LLM, StructuredOutputsParams
from aserve.core.structured_output import StructuredOutputManager, grammar_key
from aserve.sampling_params import ParamError

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}, "population_millions": {"type": "integer",
                                                                                        "minimum": 0, "maximum": 50}},
    "required": ["city", "population_millions"],
    "additionalProperties": False,
}  # fmt: skip
TAG_FORMAT = {"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": SCHEMA},
              "end": "</answer>"}  # fmt: skip
QUESTION = [{"role": "user", "content": "Which city is the capital of France, and how many people live there?"}]


@pytest.fixture(scope="module")
def client():
    with running_server() as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def answer_of(text: str) -> dict:
    match = re.fullmatch(r"<answer>(.*)</answer>", text, re.DOTALL)
    assert match, text
    value = json.loads(match.group(1))
    assert set(value) == {"city", "population_millions"} and value["city"] in ("Paris", "Tokyo", "Lima"), value
    assert 0 <= value["population_millions"] <= 50
    return value


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_structural_tag_holds_the_output_to_the_tag(client, stream):
    fmt = {"type": "structural_tag", "format": TAG_FORMAT}
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=80, temperature=0.8, seed=3,
                                          n=2, response_format=fmt, stream=stream)  # fmt: skip
    if stream:
        texts = ["", ""]
        for chunk in resp:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    else:
        assert all(c.finish_reason == "stop" for c in resp.choices)
        texts = [c.message.content for c in resp.choices]
    for text in texts:
        answer_of(text)


def test_structured_outputs_structural_tag_on_completions(client):
    tag = json.dumps({"type": "structural_tag", "format": TAG_FORMAT})
    resp = client.completions.create(model=MODEL, prompt="The capital of France:", max_tokens=80, temperature=0,
                                     extra_body={"structured_outputs": {"structural_tag": tag}})  # fmt: skip
    assert resp.choices[0].finish_reason == "stop"
    assert answer_of(resp.choices[0].text)["city"] in ("Paris", "Tokyo", "Lima")


@pytest.mark.parametrize("fmt, message", [
    ({"type": "structural_tag"}, "needs format, or structures and triggers"),
    ({"type": "structural_tag", "format": TAG_FORMAT, "triggers": ["<a"]}, "not both"),
    ({"type": "structural_tag", "format": {"type": "no_such_format"}}, "the structural tag cannot be compiled"),
    ({"type": "structural_tag", "structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<f"]},
     "needs begin, schema and end"),
    ({"type": "xml"}, "'structural_tag', got 'xml'"),
])  # fmt: skip
def test_a_bad_structural_tag_is_a_400_naming_response_format(client, fmt, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, response_format=fmt)
    assert e.value.body["param"] == "response_format" and message in e.value.body["message"], e.value.body
    assert client.models.list().data  # still serving


def test_older_form_leaves_text_free_until_a_trigger_then_holds_the_structure():
    """{"structures": [{"begin", "schema", "end"}], "triggers"}: any text, until a trigger starts a structure, which
    must then be its schema's JSON and its end; free text again after."""
    config = (llm := LLM()).engine.config
    manager = StructuredOutputManager(llm.get_tokenizer(), config.vocab_size, config.eos_token_id)
    tag = {"structures": [{"begin": "<f=city>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}
    grammar = manager._compile(grammar_key(StructuredOutputsParams(structural_tag=json.dumps(tag))))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text)

    assert accepts("Some text, then <f=city>" + json.dumps({"city": "Lima", "population_millions": 11}) + "</f> more")
    assert accepts("no trigger at all")
    assert not accepts('text <f=city>{"city": "Rome", "population_millions": 3}</f>')  # not in the enum
    assert not accepts('<f=town>{"city": "Lima", "population_millions": 11}</f>')  # a trigger opens only a begin
    with pytest.raises(ParamError, match="triggers must be a list of strings"):
        manager._compile(grammar_key(StructuredOutputsParams(structural_tag=json.dumps({**tag, "triggers": "<f="}))))
