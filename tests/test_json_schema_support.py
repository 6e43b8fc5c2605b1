"""The JSON-schema keywords structured output refuses are exactly those the installed xgrammar does not enforce: for
each refused schema its grammar and the schema disagree on an instance (the grammar accepts one that breaks the
schema, or, for the conflicts vLLM refuses as well, rejects a valid one); for each accepted schema they agree on the
same kind of instance. A refusal names the keyword and where it is."""

import json

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from aserve.core.json_schema_support import unsupported_feature

# (schema, an instance, the keyword refused and where, or None: the grammar enforces the schema on it)
CASES = [
    ({"type": "number", "multipleOf": 0.5}, "0.3", ("multipleOf", "/")),
    ({"type": "integer", "multipleOf": 7}, "15", None),
    ({"type": "object", "properties": {"l": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     '{"l": [1, 1]}', ("uniqueItems", "/properties/l")),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]", ("contains", "/")),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}, "maxContains": 1}, "[5, 5]",
     ("contains", "/")),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}}, "9", ("if", "/")),
    ({"type": "integer", "not": {"const": 3}}, "3", ("not", "/")),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}', ("dependentRequired", "/")),
    ({"allOf": [{"type": "integer", "minimum": 1}, {"type": "integer", "maximum": 5}]}, '"s"', ("allOf", "/")),
    ({"allOf": [{"type": "integer", "maximum": 5}]}, "7", None),
    ({"type": "string", "format": "regex"}, '"(("', ("format", "/")),
    ({"type": "string", "format": "email"}, '"x"', None),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, '"abc"', ("maxLength", "/")),
    ({"type": "string", "maxLength": 2}, '"abc"', None),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "patternProperties": {"^x": {"type": "integer"}}},
     '{"a": "s", "x1": 1}', ("patternProperties", "/")),  # valid, and refused by the grammar
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "integer"}}}, '{"ab": 1}',
     ("patternProperties", "/")),
    ({"type": "object", "patternProperties": {"^k[0-9]$": {"type": "integer"}}, "additionalProperties": False},
     '{"k1": "s"}', None),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 2}}, '{"abc": 1}',
     ("propertyNames", "/")),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, '{"A1": 1}', None),
    ({"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
      "required": ["v", "next"], "additionalProperties": False}, '{"v": 1, "next": {}}', None),
]  # fmt: skip


@pytest.mark.parametrize("schema, instance, refused", CASES)
def test_refused_exactly_where_grammar_and_schema_disagree(schema, instance, refused):
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
    agree = _is_grammar_accept_string(grammar, instance) == validator.is_valid(json.loads(instance))
    problem = unsupported_feature(schema)
    assert agree == (problem is None)
    if refused is not None:
        keyword, pointer = refused
        assert f"`{keyword}` (at {pointer})" in problem


def test_names_are_not_keywords_and_data_is_not_schema():
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}},
              "enum": [{"not": 1}], "$defs": {"a/b": {"type": "array", "uniqueItems": True}}}  # fmt: skip
    assert "`uniqueItems` (at /$defs/a~1b)" in unsupported_feature(schema)
    del schema["$defs"]
    assert unsupported_feature(schema) is None
