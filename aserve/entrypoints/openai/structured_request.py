"""Structured output on the wire: OpenAI's `response_format` and vLLM's `structured_outputs` (an object of
StructuredOutputsParams' fields; any other key is refused) and its older guided_* fields, read into
StructuredOutputsParams."""

from __future__ import annotations

import dataclasses
import json

import msgspec

from aserve.sampling_params import ParamError, StructuredOutputsParams

# The request fields that ask for structured output; a request may use one.
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")  # fmt: skip
_STRUCTURED_OUTPUTS_KEYS = frozenset(f.name for f in dataclasses.fields(StructuredOutputsParams))


class JSONSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's `response_format.json_schema`. The output follows `schema` whatever `strict` says (strictly)."""

    name: str | None = None
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}, and vLLM's
    {"type": "structural_tag", "format": {...}} (an xgrammar structural tag) or its older {"type":
    "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}."""

    type: str
    json_schema: JSONSchemaFormat | None = None
    format: dict | None = None
    structures: list | None = None
    triggers: list | None = None


def _given(req) -> list[str]:
    """The structured-output fields a request sets (response_format "text" asks for nothing)."""
    given = [name for name in STRUCTURED_FIELDS if getattr(req, name) is not None]
    if "response_format" in given and req.response_format.type == "text":
        given.remove("response_format")
    return given


def structured_outputs_field(req) -> str:
    """The field a request's structured output came in (what a 400 about it names)."""
    given = _given(req)
    return given[0] if given else "structured_outputs"


def structured_outputs_params(req) -> StructuredOutputsParams | None:
    """A request's response_format, structured_outputs or guided_* field (at most one) as StructuredOutputsParams;
    ParamError names the field at fault."""
    given = _given(req)
    if len(given) > 1:
        raise ParamError(given[1], f"give at most one of {', '.join(given)}: each constrains the whole output")
    if not given:
        return None
    try:
        return _params(req, given[0])
    except ParamError as e:
        e.param = given[0]
        raise


def _structural_tag(fmt: ResponseFormat) -> str:
    """A structural_tag response_format as the JSON text StructuredOutputsParams.structural_tag takes (as vLLM
    passes it on)."""
    if fmt.format is not None:
        if fmt.structures is not None or fmt.triggers is not None:
            raise ParamError("response_format", "a structural_tag response_format takes format, or structures and "
                             "triggers, not both")  # fmt: skip
        return json.dumps({"type": "structural_tag", "format": fmt.format}, ensure_ascii=False)
    if fmt.structures is None or fmt.triggers is None:
        raise ParamError("response_format", "a structural_tag response_format needs format, or structures and "
                         "triggers")  # fmt: skip
    return json.dumps({"type": "structural_tag", "structures": fmt.structures, "triggers": fmt.triggers},
                      ensure_ascii=False)  # fmt: skip


def _params(req, field: str) -> StructuredOutputsParams:
    if field == "response_format":
        fmt: ResponseFormat = req.response_format
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.type == "structural_tag":
            return StructuredOutputsParams(structural_tag=_structural_tag(fmt))
        if fmt.type != "json_schema":
            raise ParamError(field, "response_format.type must be 'text', 'json_object', 'json_schema' or "
                             f"'structural_tag', got {fmt.type!r}")  # fmt: skip
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise ParamError(field, "response_format of type 'json_schema' needs json_schema.schema")
        return StructuredOutputsParams(json=fmt.json_schema.schema)
    if field == "structured_outputs":
        unknown = sorted(set(req.structured_outputs) - _STRUCTURED_OUTPUTS_KEYS)
        if unknown:
            raise ParamError(field, f"structured_outputs.{unknown[0]} is not supported; it takes "
                             f"{', '.join(sorted(_STRUCTURED_OUTPUTS_KEYS))}")  # fmt: skip
        return StructuredOutputsParams(**req.structured_outputs)
    return StructuredOutputsParams(**{field.removeprefix("guided_"): getattr(req, field)})
