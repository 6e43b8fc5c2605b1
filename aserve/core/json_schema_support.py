"""Which JSON-schema keywords structured output can enforce. xgrammar compiles a schema into a grammar but drops some
keywords without a word, so an output it allows may break the schema; a schema that uses one is refused instead (a
400 naming the keyword and where it is), as vLLM refuses them with its xgrammar backend
(`has_xgrammar_unsupported_json_features`).

The list is what xgrammar 0.2.9 was measured to ignore (a string that breaks the keyword accepted by the grammar):
numbers' `multipleOf` (integers' is enforced), `uniqueItems`, `contains` / `minContains` / `maxContains`, string
`format`s other than FORMATS, `minLength` / `maxLength` beside a `pattern` or `format`, `propertyNames` with a
pattern or format and length bounds, or beside `patternProperties`; `patternProperties` beside `properties` (the
patterns are dropped) or with more than one pattern (overlapping patterns reject valid names); and, wherever they
are, `if` / `then` / `else`, `not`, `dependentRequired`, `dependentSchemas`, `dependencies` and an `allOf` of more
than one schema. A type-specific keyword counts where the schema's `type` allows that type or names none (xgrammar
then infers it, or allows anything). Recursive `$ref`s (to "#" too), `patternProperties` alone, `propertyNames` with
`properties`, `oneOf` and `anyOf` are enforced.
"""

from __future__ import annotations

# String formats xgrammar turns into grammars (its json_schema_converter; vLLM's STRING_SUPPORTED_FORMATS).
FORMATS = frozenset(("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"))  # fmt: skip

# Keywords ignored whatever the type.
_IGNORED_ANYWHERE = ("if", "not", "dependentRequired", "dependentSchemas", "dependencies")
_CONTAINS = ("contains", "minContains", "maxContains")
_LENGTHS = ("minLength", "maxLength")

# Keywords whose values are data, not schemas; and those mapping names to schemas (the names are not keywords).
_DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples", "required"))
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))


def unsupported_feature(schema) -> str | None:
    """Why the schema cannot be enforced (its first keyword that xgrammar ignores, and where), or None."""
    found = _find(schema, "")
    if found is None:
        return None
    keyword, pointer, why = found
    return (f"the JSON schema's `{keyword}` (at {pointer or '/'}) is not supported: structured output (xgrammar) "
            f"cannot enforce {why}, so the output could break the schema; remove it")  # fmt: skip


def _find(schema, pointer: str) -> tuple[str, str, str] | None:
    if not isinstance(schema, dict):
        return None
    own = _own_keyword(schema)
    if own is not None:
        return own[0], pointer, own[1]
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            continue
        where = f"{pointer}/{_escape(key)}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            subschemas = [(f"{where}/{_escape(name)}", sub) for name, sub in value.items()]
        elif isinstance(value, list):
            subschemas = [(f"{where}/{i}", sub) for i, sub in enumerate(value)]
        else:
            subschemas = [(where, value)]
        for sub_pointer, sub in subschemas:
            found = _find(sub, sub_pointer)
            if found is not None:
                return found
    return None


def _own_keyword(schema: dict) -> tuple[str, str] | None:
    """The keyword of this schema object itself (not its subschemas) that xgrammar ignores, and what it means."""
    for keyword in _IGNORED_ANYWHERE:
        if keyword in schema:
            return keyword, keyword
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf", "an allOf of more than one schema"
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(t for t in types if isinstance(t, str)) if isinstance(
        types, list) else set()  # fmt: skip

    def may_be(kind: str) -> bool:
        return not types or kind in types

    step = schema.get("multipleOf")
    if step is not None and (may_be("number") or (not _integral(step) and "integer" in types)):
        return "multipleOf", "multipleOf on numbers (only on integers, by a whole number)"
    if may_be("array"):
        if schema.get("uniqueItems") is True:
            return "uniqueItems", "uniqueItems"
        for keyword in _CONTAINS:
            if keyword in schema:
                return keyword, keyword
    if may_be("string"):
        fmt = schema.get("format")
        if fmt is not None and fmt not in FORMATS:
            return "format", f"the format {fmt!r} (only {', '.join(sorted(FORMATS))})"
        if _pattern_and_length(schema):
            return next(k for k in _LENGTHS if k in schema), "a length bound beside a pattern or format"
    if may_be("object"):
        names, patterns = schema.get("propertyNames"), schema.get("patternProperties")
        if isinstance(names, dict) and _pattern_and_length(names):
            return "propertyNames", "a pattern or format with length bounds for property names"
        if names is not None and patterns is not None:
            return "propertyNames", "propertyNames beside patternProperties"
        if isinstance(patterns, dict) and ("properties" in schema or len(patterns) > 1):
            return "patternProperties", "patternProperties beside properties, or more than one pattern"
    return None


def _pattern_and_length(schema: dict) -> bool:
    return ("pattern" in schema or "format" in schema) and any(k in schema for k in _LENGTHS)


def _integral(value) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _escape(name: str) -> str:
    """A JSON pointer's reference token (RFC 6901)."""
    return str(name).replace("~", "~0").replace("/", "~1")
