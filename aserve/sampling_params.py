"""Sampling parameters, in vLLM's shape (`SamplingParams(temperature=..., max_tokens=...)`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

_GREEDY_EPS = 1e-5
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# A JSON schema nested deeper than this (objects and arrays of the schema document itself; an object property is
# three levels) is refused: xgrammar's compile time grows steeply with nesting (SmolLM2's vocabulary, 480 nested
# objects: 12-30 s in the compile pool, holding up every other request's grammar)
MAX_SCHEMA_DEPTH = 100


def _nesting(value) -> int:
    """How deep dicts and lists nest in `value` (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                break
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class ParamError(ValueError):
    """An invalid request parameter; `param` names it (for OpenAI-style error bodies)."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI's error code where it has one (e.g. "context_length_exceeded")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrains a request's output to a grammar (vLLM's shape; compiled by xgrammar): exactly one of `json` (a JSON
    schema, as a dict or its JSON text), `regex`, `choice` (the output is one of these strings), `grammar` (EBNF, with
    a `root` rule) or `json_object` (any JSON object). disable_any_whitespace: JSON without whitespace between its
    tokens (otherwise any amount is allowed, as in JSON)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ParamError(
                "structured_outputs",
                "structured_outputs takes exactly one of json, regex, choice, grammar or json_object, got "
                + (", ".join(kinds) if kinds else "none"),
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ParamError("structured_outputs", "structured_outputs.json must be a JSON schema (an object)")
        if self.json is not None:
            too_deep = ParamError("structured_outputs", f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels")
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            except RecursionError:
                raise too_deep from None
            except ValueError:
                schema = None  # (not JSON: the compile says so)
            if _nesting(schema) > MAX_SCHEMA_DEPTH:
                raise too_deep
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ParamError("structured_outputs", f"structured_outputs.{name} must be a string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ParamError("structured_outputs", "structured_outputs.choice must be a non-empty list of strings")
        for name in ("json_object", "disable_any_whitespace"):
            if getattr(self, name) not in (None, True, False):
                raise ParamError("structured_outputs", f"structured_outputs.{name} must be a boolean")

    @property
    def kind(self) -> str:
        """Which constraint it is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always included)
    # number of top logprobs per prompt token (the prompt token's own is always included; the first token has none)
    prompt_logprobs: int | None = None
    # token id -> added to its logit before sampling (OpenAI's logit_bias; -100 / 100 ban / force the token)
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # Per-request salt isolating prefix-cache sharing (e.g. between tenants).
    cache_salt: str | None = None
    # The output follows a JSON schema, regex, choice or grammar (see StructuredOutputsParams).
    structured_outputs: StructuredOutputsParams | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids; logprobs stay those of the model's distribution)
    allowed_token_ids: list[int] | None = None
    # Keep only the last N prompt tokens (-1: the last max_model_len); more than max_model_len is an error
    truncate_prompt_tokens: int | None = None
    # False: token ids only, no text (and so no stop strings), as vLLM's
    detokenize: bool = True
    # Words never generated (vLLM's bad_words): each word's token sequence, with and without a leading space, cannot
    # be completed (its last token is masked where the output ends with the others)
    bad_words: list[str] | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif self.stop is None or isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop or [])
        else:
            raise ParamError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ParamError("stop_token_ids", f"stop_token_ids must be a list of token ids, got "
                             f"{self.stop_token_ids!r}")  # fmt: skip
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ParamError:
            return ParamError(name, f"{name} {why}, got {getattr(self, name)!r}")

        def real(name: str, low: float, high: float, low_open: bool = False) -> None:
            """A finite number in [low, high] ((low, high] with low_open)."""
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise bad(name, "must be a finite number")
            if x < low or (low_open and x == low) or x > high:
                raise bad(name, f"must be in {'(' if low_open else '['}{low:g}, {high:g}]")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        real("temperature", 0, math.inf)
        real("top_p", 0, 1, low_open=True)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        real("min_p", 0, 1)
        real("presence_penalty", -2, 2)
        real("frequency_penalty", -2, 2)
        real("repetition_penalty", 0, math.inf, low_open=True)
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer (or None)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise bad(name, "must be an integer >= 0 (-1: the whole vocabulary)")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):  # fmt: skip
            raise bad("bad_words", "must be a list of non-empty strings")
        if not self.detokenize and self.stop_strings:
            raise ParamError("stop", "stop strings need the text: they cannot be used with detokenize=False")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise ParamError("logit_bias", f"logit_bias keys must be non-negative token ids, got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                    raise ParamError("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {bias!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)
        ):
            raise ParamError("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids")
        n = self.truncate_prompt_tokens
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or (n < 1 and n != -1)):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 (the last max_model_len tokens)")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_logit_bias(self) -> bool:
        """The logits change before sampling: logit_bias, allowed_token_ids masking the others, bad_words."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def truncate_prompt(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (all of it without truncate_prompt_tokens)."""
        n = self.truncate_prompt_tokens
        if n is None:
            return prompt_token_ids
        if n > max_model_len:
            raise ParamError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens value ({n}) is greater than max_model_len ({max_model_len}). "
                "Please, select a smaller truncation size.",
            )
        return prompt_token_ids[-(max_model_len if n == -1 else n) :]

    def clone(self, **changes) -> SamplingParams:
        return replace(self, **changes)
