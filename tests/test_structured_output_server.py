"""Structured output as users ask for it: the official openai client against `aserve serve` with the embedded default
model (SmolLM2-135M-Instruct): response_format json_schema (valid against its schema every time, over a varied set
of schemas) and json_object, vLLM's structured_outputs (json, regex, choice, EBNF grammar) on both endpoints, n=2,
streaming, errors; and the offline LLM with StructuredOutputsParams."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from aserve_server import running_server

from aserve import SamplingParams, StructuredOutputsParams

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"

# Each bounded (maxLength, maxItems, enum, ranges) so that generation ends; together: nested objects, arrays of
# objects, enums, required and optional fields, integers, numbers, booleans, null, $defs / $ref, anyOf.
SCHEMAS = {
    "a person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "London", "Tokyo", "New York"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "a user account with an active flag": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                    "email": {"type": "string", "maxLength": 40},
                    "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]}, "maxItems": 3},
                },
                "required": ["id", "email", "roles"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "a shopping list with prices": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 20},
                        "price": {"type": "number", "minimum": 0, "maximum": 1000},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 10},
                    },
                    "required": ["name", "price", "quantity"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
    },
    "a t-shirt in stock": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "in_stock": {"type": "boolean"},
            "count": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["color", "size", "in_stock", "count"],
    },
    "a line from one point to another": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "a film, with its year if known": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"anyOf": [{"type": "integer", "minimum": 1900, "maximum": 2030}, {"type": "null"}]},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title", "year"],
    },
    "a few tags for a blog post": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "minItems": 2, "maxItems": 4}
        },  # fmt: skip
        "required": ["tags"],
    },
    "the weather": {
        "type": "object",
        "properties": {
            "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            "wind": {
                "type": "object",
                "properties": {
                    "speed_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
                    "direction": {"enum": ["N", "E", "S", "W"]},
                },  # fmt: skip
                "required": ["speed_kmh", "direction"],
            },
        },
        "required": ["temperature_c", "conditions", "wind"],
    },
}


@pytest.fixture(scope="module")
def client():
    with running_server() as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON describing {what}."}]


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def schema_outputs(client, temperature: float, n: int) -> list[tuple[dict, object]]:
    """(schema, choice) for every schema, asked concurrently (the requests run as one batch)."""

    def one(item):
        what, schema = item
        fmt = json_schema_format(schema)
        resp = client.chat.completions.create(model=MODEL, messages=ask(what), max_tokens=400, n=n, seed=7,
                                              temperature=temperature, response_format=fmt)  # fmt: skip
        return [(schema, choice) for choice in resp.choices]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        return [pair for pairs in pool.map(one, SCHEMAS.items()) for pair in pairs]


def assert_all_valid(outputs, expected: int) -> None:
    """Each output parses and validates against its schema, and ends there ("stop")."""
    assert len(outputs) == expected
    for schema, choice in outputs:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_output_is_valid_every_time(client):
    assert_all_valid(schema_outputs(client, temperature=0, n=1), len(SCHEMAS))


@pytest.mark.slow
def test_sampled_json_schema_output_is_valid_every_time(client):
    assert_all_valid(schema_outputs(client, temperature=0.8, n=4), 4 * len(SCHEMAS))


def test_streaming_json_object_and_guided_json(client):
    schema = SCHEMAS["a person"]
    stream = client.chat.completions.create(model=MODEL, messages=ask("a person"), max_tokens=200, temperature=0,
                                            response_format=json_schema_format(schema), stream=True)  # fmt: skip
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop" and len(chunks) > 3
    jsonschema.validate(json.loads(text), schema)
    # json_object: any JSON object (a small model may well go on nesting one: this prompt ends)
    question = [{"role": "user", "content": 'Reply with JSON: {"answer": <number>} for 3+4.'}]
    resp = client.chat.completions.create(model=MODEL, messages=question, max_tokens=300, temperature=0,
                                          response_format={"type": "json_object"})  # fmt: skip
    assert resp.choices[0].finish_reason == "stop" and isinstance(json.loads(resp.choices[0].message.content), dict)
    schema = SCHEMAS["a t-shirt in stock"]
    resp = client.chat.completions.create(model=MODEL, messages=ask("a t-shirt"), max_tokens=200, temperature=0,
                                          extra_body={"guided_json": schema})  # fmt: skip
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


def test_regex_choice_and_grammar_on_both_endpoints(client):
    iso_date = r"\d{4}-\d{2}-\d{2}"
    date = client.completions.create(model=MODEL, prompt="The date of the moon landing was", max_tokens=30,
                                     temperature=0, extra_body={"structured_outputs": {"regex": iso_date}})  # fmt: skip
    assert re.fullmatch(iso_date, date.choices[0].text) and date.choices[0].finish_reason == "stop"
    choices = ["Paris", "London", "Berlin"]
    capital = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=10,
        temperature=0, extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert capital.choices[0].message.content in choices and capital.choices[0].finish_reason == "stop"
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=20, temperature=0.7,
        n=2, seed=1, extra_body={"structured_outputs": {"grammar": grammar}},
    )  # fmt: skip
    assert {c.message.content for c in answer.choices} <= {"The answer is yes.", "The answer is no."}
    colours = {"structured_outputs": {"choice": ["red", "blue"]}}
    stream = client.completions.create(model=MODEL, prompt="Pick a colour:", max_tokens=10, temperature=0,
                                       stream=True, extra_body=colours)  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("red", "blue")


def test_bad_requests_get_400_naming_the_problem_and_the_server_goes_on(client):
    cases = [
        (dict(response_format=json_schema_format({"type": "object", "properties": {"a": {"type": "strin"}}})),
         "response_format", 'the JSON schema cannot be compiled: Unsupported type "strin"'),
        (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs",
         "the regex cannot be compiled: Regex parsing error at position 4: The parenthesis is not closed."),
        (dict(extra_body={"structured_outputs": {"grammar": "root ::= "}}), "structured_outputs",
         "the EBNF grammar cannot be compiled"),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs",
         "structured_outputs takes exactly one of json, regex, choice, grammar, json_object or structural_tag, got "
         "regex, choice"),
        (dict(extra_body={"structured_outputs": {"whitespace_pattern": " "}}), "structured_outputs",
         "structured_outputs.whitespace_pattern is not supported"),
        (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
         "structured_outputs", "give at most one of response_format, structured_outputs"),
        (dict(response_format={"type": "json_schema"}), "response_format",
         "response_format of type 'json_schema' needs json_schema.schema"),
        (dict(response_format={"type": "xml"}), "response_format", "response_format.type must be"),
    ]  # fmt: skip
    for kw, param, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=5, **kw)
        error = info.value.body
        assert error["param"] == param and message in error["message"] and "/project/" not in error["message"]
    resp = client.chat.completions.create(model=MODEL, messages=ask("a dog"), max_tokens=5, temperature=0,
                                          response_format={"type": "text"})  # fmt: skip
    assert resp.choices[0].finish_reason == "length"


def test_offline_llm_with_structured_outputs_params(smollm2):
    schema = SCHEMAS["a person"]
    word_regex = r"[A-Z][a-z]{2,9}"
    params = [
        SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=word_regex)),
    ]
    person, word = smollm2.chat([ask("a person"), [{"role": "user", "content": "Name a fruit."}]], params)
    jsonschema.validate(json.loads(person.outputs[0].text), schema)
    assert re.fullmatch(word_regex, word.outputs[0].text) and word.outputs[0].finish_reason == "stop"
