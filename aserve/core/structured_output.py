"""Structured output with xgrammar: a request's output follows a JSON schema, a regex, a choice or an EBNF grammar.

    StructuredOutputManager   one per engine: the tokenizer's xgrammar TokenizerInfo (built once, at the width of
                              the model's logits, which may exceed the tokenizer's vocabulary), a thread pool that
                              compiles grammars (xgrammar releases the GIL while it compiles: the event loop runs on)
                              and the compiled grammars, cached by (kind, spec, options)
    GrammarState              one per sequence (each of `n` has its own; it holds the compile: a queued compile no
                              request holds any more is cancelled): the compile's future, then, once the
                              request is admitted, a GrammarMatcher that every token appended to it advances; with
                              `after` (a reasoning model's end-of-thinking token) the grammar applies only to the
                              tokens after that token's first appearance: the reasoning before it is free

A waiting request is not admitted until its grammar is compiled (vLLM's WAITING_FOR_FSM); the scheduler skips it
meanwhile. The sampler masks each constrained row of a step with the matcher's bitmask
(aserve/worker/grammar_bitmask.py), so every sampled token is one the grammar allows; the matcher accepting the stop
token (or, on a model without one, the grammar completing) ends the sequence as "stop". A finished sequence drops its
matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from aserve.core.json_schema_support import unsupported_feature
from aserve.sampling_params import ParamError, StructuredOutputsParams

GrammarKey = tuple[str, str, bool]  # (kind, spec as text, any whitespace)

# JSON allows any whitespace between its tokens; a small model may then emit newlines or spaces without end (xgrammar
# warns of it). At most this many in a row still lets JSON be indented 2 spaces per level 9 levels deep.
MAX_JSON_WHITESPACE = 20

# xgrammar's messages start with where in its C++ sources they were raised: "[14:47:01] /project/cpp/x.cc:94: "
_SOURCE_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
# a lookaround group's opening, not escaped: "(?=", "(?!", "(?<=", "(?<!"
_LOOKAROUND = re.compile(r"(?<!\\)(?:\\\\)*\(\?(?:=|!|<=|<!)")
_WHAT = {
    "json": "the JSON schema",
    "json_object": "the JSON object grammar",
    "regex": "the regex",
    "choice": "the choice",
    "grammar": "the EBNF grammar",
    "structural_tag": "the structural tag",
}


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The cache key: the constraint's kind and its text (a schema keeps its key order: it orders the output)."""
    kind = params.kind
    if kind == "json":
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json, ensure_ascii=False)
    elif kind == "choice":
        spec = json.dumps(params.choice, ensure_ascii=False)
    elif kind == "json_object":
        spec = ""
    else:
        spec = getattr(params, kind)
    return kind, spec, kind in ("json", "json_object") and not params.disable_any_whitespace


def compile_structural_tag(compiler: xgr.GrammarCompiler, spec: str) -> xgr.CompiledGrammar:
    """An xgrammar structural tag's JSON text -> its grammar. The older form (vLLM's "structures" and "triggers":
    each structure a begin string, a JSON schema and an end string) goes through xgrammar's tag items."""
    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ParamError("structured_outputs", f"the structural tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ParamError("structured_outputs", "the structural tag must be a JSON object")
    if "structures" not in tag:
        return compiler.compile_structural_tag(spec)
    structures, triggers = tag["structures"], tag.get("triggers")
    if not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
        raise ParamError("structured_outputs", "the structural tag's triggers must be a list of strings")
    items = []
    for s in structures if isinstance(structures, list) else [None]:
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
            raise ParamError("structured_outputs", "each of the structural tag's structures needs begin, schema "
                             "and end")  # fmt: skip
        schema = s["schema"] if isinstance(s["schema"], str) else json.dumps(s["schema"])
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=schema, end=s["end"]))
    return compiler.compile_structural_tag(items, triggers)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (string literals take JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Keywords whose values are data, not schemas: left as they are by the rewrite below.
_DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples"))
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
_SAFE_CHARS = r'^[^\x00-\x1f"\\]'  # a JSON string's characters that need no escape


def json_strings_escaped(schema):
    """The schema with each length-bounded string (minLength / maxLength, no pattern or format) given as the
    equivalent pattern. xgrammar 0.2.9 lets the characters of such strings be raw control characters (U+0001-U+001F
    but CR and LF), which JSON requires escaped (Python's json.loads, strict, refuses them); the pattern excludes them
    (and, as xgrammar's length-bounded strings, backslash escapes)."""
    if isinstance(schema, list):
        return [json_strings_escaped(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema, whatever the names
            out[key] = {name: json_strings_escaped(sub) for name, sub in value.items()}
        else:
            out[key] = value if key in _DATA_KEYWORDS else json_strings_escaped(value)
    bounds = (out.get("minLength"), out.get("maxLength"))
    if out.get("type") == "string" and bounds != (None, None) and "pattern" not in out and "format" not in out:
        low, high = bounds
        if all(b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 0) for b in bounds):
            out.pop("minLength", None)
            out.pop("maxLength", None)
            out["pattern"] = _SAFE_CHARS + f"{{{low or 0},{'' if high is None else high}}}$"
    return out


def compile_error(future: Future) -> Exception | None:
    """A finished compile's error as a new exception (the future's own is shared by every request for that grammar:
    raising it again would grow its traceback, and callers rename a ParamError's field)."""
    error = future.exception()
    if error is None:
        return None
    if isinstance(error, ParamError):
        return ParamError(error.param, str(error), error.code)
    return RuntimeError(f"structured output is not available: {type(error).__name__}: {error}")


def _problem(error: Exception) -> str:
    lines = [_SOURCE_PREFIX.sub("", line).strip() for line in str(error).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(error).__name__


class GrammarState:
    """A sequence's grammar: compiled (`future`), then matched (`start()` makes the matcher)."""

    __slots__ = ("future", "matcher", "terminate_without_stop_token", "after", "_release")

    def __init__(self, future: Future, terminate_without_stop_token: bool = False, after: int | None = None,
                 release=None) -> None:  # fmt: skip
        self.future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.terminate_without_stop_token = terminate_without_stop_token
        self.after = after  # a token id the grammar waits for (None: it applies from the first token)
        self._release = release  # tells the manager the sequence no longer needs the compile (free)

    @property
    def error(self) -> str | None:
        """Why the grammar could not be compiled (once the compile is done)."""
        if not self.future.done() or self.future.exception() is None:
            return None
        return str(self.future.exception())

    def start(self) -> bool:
        """Makes the matcher once the grammar is compiled. -> whether the sequence may be scheduled."""
        if self.matcher is None:
            if not self.future.done() or self.future.exception() is not None:
                return False
            self.matcher = xgr.GrammarMatcher(
                self.future.result(), terminate_without_stop_token=self.terminate_without_stop_token
            )
        return True

    def accept(self, token_id: int) -> bool:
        """Advances the matcher by a token appended to the sequence; False if the grammar does not allow it."""
        if self.after is not None:  # before the grammar applies every token is allowed; `after` starts it
            if token_id == self.after:
                self.after = None
            return True
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.after is None and self.matcher.is_terminated()

    def free(self) -> None:
        """The sequence finished: its matcher goes (a step still filling its bitmask holds its own reference)."""
        self.matcher = None
        if self._release is not None:
            self._release, release = None, self._release
            release()


class StructuredOutputManager:
    def __init__(
        self, tokenizer, vocab_size: int, eos_token_id: int | None, max_workers: int = 2, cache_size: int = 256
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="aserve-grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()  # most recently used last
        self._holders: dict[Future, int] = {}  # compiles that requests need, and how many (hold / release)

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar, as a future: from the cache, or compiling in the pool. Its exception is a ParamError
        naming the problem. Called from one thread (the engine's caller, or the event loop)."""
        key = grammar_key(params)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, key)
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)  # sequences holding an evicted grammar keep their own reference
        return future

    def sequence_state(self, future: Future, after: int | None = None) -> GrammarState:
        # Without a stop token the grammar's completion ends the sequence (with one, the stop token must follow).
        self.hold(future)
        return GrammarState(future, terminate_without_stop_token=self.eos_token_id is None, after=after,
                            release=lambda: self.release(future))  # fmt: skip

    def hold(self, future: Future) -> None:
        """A request needs this compile (a sequence holding it, a server handler waiting for it)."""
        self._holders[future] = self._holders.get(future, 0) + 1

    def release(self, future: Future) -> None:
        """A request no longer needs it; a compile nobody needs that is still queued in the pool is cancelled and
        forgotten (a client that left with a costly grammar does not hold up the others' compiles)."""
        left = self._holders.get(future, 0) - 1
        if left > 0:
            self._holders[future] = left
            return
        self._holders.pop(future, None)
        if not future.done() and future.cancel():
            for key, cached in list(self._cache.items()):
                if cached is future:
                    del self._cache[key]

    def _compiler_for_pool(self) -> xgr.GrammarCompiler:
        """Built by the first compile (in the pool): tokenizer info for every vocabulary entry takes ~0.15 s."""
        with self._compiler_lock:
            if self._compiler is None:
                stop = [self.eos_token_id] if self.eos_token_id is not None else None
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        kind, spec, any_whitespace = key
        compiler = self._compiler_for_pool()
        try:
            if kind == "json":
                try:
                    schema = json.loads(spec)
                except json.JSONDecodeError as e:
                    raise ParamError("structured_outputs", f"the JSON schema is not valid JSON: {e}") from None
                if (problem := unsupported_feature(schema)) is not None:
                    raise ParamError("structured_outputs", problem)
                spec = json.dumps(json_strings_escaped(schema))
            elif kind == "json_object":
                spec = '{"type": "object"}'
            if kind in ("json", "json_object"):
                whitespace = MAX_JSON_WHITESPACE if any_whitespace else None
                return compiler.compile_json_schema(spec, any_whitespace=any_whitespace, max_whitespace_cnt=whitespace)
            if kind == "regex":
                if _LOOKAROUND.search(spec):  # xgrammar 0.2.9 compiles them and drops the assertion
                    raise ParamError("structured_outputs", "the regex cannot be compiled: lookahead and lookbehind "
                                     "assertions ((?=...), (?!...), (?<=...), (?<!...)) are not supported")  # fmt: skip
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "structural_tag":
                return compile_structural_tag(compiler, spec)
            return compiler.compile_grammar(spec)
        except ParamError:
            raise
        except Exception as e:  # xgrammar reports a bad schema / regex / grammar as a RuntimeError
            raise ParamError("structured_outputs", f"{_WHAT[kind]} cannot be compiled: {_problem(e)}") from None
