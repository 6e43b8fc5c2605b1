"""Sampling parameters, in vLLM's shape (`SamplingParams(temperature=..., max_tokens=...)`)."""

from __future__ import annotations

import enum
import functools
import json
import math
from dataclasses import dataclass, replace

_GREEDY_EPS = 1e-5
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
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
    a `root` rule), `json_object` (any JSON object) or `structural_tag` (the JSON text of an xgrammar structural tag:
    {"type": "structural_tag", "format": {...}}, or the older {"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}: text is free until a trigger, then the structure it starts). disable_any_whitespace: JSON
    without whitespace between its tokens (otherwise any amount is allowed, as in JSON). vLLM's backend options:
    disable_fallback (xgrammar is the only backend: nothing falls back), disable_additional_properties (xgrammar's
    strict mode already treats a schema object without additionalProperties as closed), whitespace_pattern
    (refused: xgrammar has no whitespace pattern; disable_any_whitespace removes whitespace)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.whitespace_pattern is not None:
            raise ParamError("structured_outputs", "structured_outputs.whitespace_pattern is not supported (xgrammar "
                             "has none); disable_any_whitespace removes whitespace")  # fmt: skip
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ParamError(
                "structured_outputs",
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object or "
                "structural_tag, got " + (", ".join(kinds) if kinds else "none"),
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
        for name in ("regex", "grammar", "structural_tag"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ParamError("structured_outputs", f"structured_outputs.{name} must be a string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ParamError("structured_outputs", "structured_outputs.choice must be a non-empty list of strings")
        for name in ("json_object", "disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
            if getattr(self, name) not in (None, True, False):
                raise ParamError("structured_outputs", f"structured_outputs.{name} must be a boolean")

    @property
    def kind(self) -> str:
        """Which constraint it is: "json", "regex", "choice", "grammar", "json_object" or "structural_tag"."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))


class RequestOutputKind(enum.Enum):
    """What a running request's outputs hold (vLLM's): CUMULATIVE, everything so far in each; DELTA, only what is new
    since the last; FINAL_ONLY, one output when it ends. LLM.generate runs FINAL_ONLY whatever is asked."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# vLLM's fields aserve does not implement: (the values that ask for nothing, why); such a value is accepted and
# dropped, any other refused, never taken and ignored
_UNSUPPORTED = {
    "best_of": ((None,), "aserve returns the n sequences it samples (keeping the best n of more is not implemented)"),
    "logits_processors": (
        (None, []),
        "aserve runs no custom logits processors; see logit_bias, allowed_token_ids, bad_words, structured_outputs",
    ),
    "thinking_token_budget": ((None, -1), "aserve does not cap reasoning tokens"),
    "logprob_token_ids": ((None,), "ask for top logprobs (logprobs=N) instead"),
    "prompt_logprob_token_ids": ((None,), "ask for top prompt logprobs (prompt_logprobs=N) instead"),
    "prompt_logprob_start": ((None, 0), "prompt logprobs cover the whole prompt"),
    "flat_logprobs": ((False,), "logprobs come as vLLM's list of dicts"),
    "skip_reading_prefix_cache": (
        (None, False),
        "requests read the prefix cache unless they ask for prompt_logprobs (those skip it, vLLM's default)",
    ),
    "repetition_detection": ((None,), "aserve does not stop on repeated n-grams"),
    "stream_interval": ((None, 1), "every step's output is reported (the server's --stream-interval batches)"),
    "skip_clone": ((False, True), "it is a boolean (vLLM's hint that the parameters need no copy)"),
    "routed_experts_prompt_start": ((0,), "aserve does not return routed experts"),
    "trace_decode_token_ids": ((None,), "aserve does not replay token traces"),
    "use_beam_search": ((False,), "use LLM.beam_search(prompts, BeamSearchParams(...))"),
}
_BOOLEAN_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                   "spaces_between_special_tokens")  # fmt: skip
# SamplingParams.from_optional's fields where None means the default (vLLM's)
_OPTIONAL_FIELDS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p")


def _refusing_unsupported(cls):
    """Wraps the dataclass's __init__: vLLM's fields aserve does not implement are refused by name (a ParamError)
    unless they ask for nothing; `guided_decoding` (vLLM's older name) is structured_outputs."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        for name in kwargs.keys() & _UNSUPPORTED.keys():
            value, (neutral, why) = kwargs.pop(name), _UNSUPPORTED[name]
            if name == "best_of" and value == kwargs.get("n", 1):
                continue  # as many samples as are returned: what n does
            if not any(value is v or (type(value) is type(v) and value == v) for v in neutral):
                raise ParamError(name, f"{name}={value!r} is not supported: {why}")
        guided = kwargs.pop("guided_decoding", None)
        if guided is not None:
            if kwargs.get("structured_outputs") is not None:
                raise ParamError("guided_decoding", "give structured_outputs or guided_decoding (its older name)")
            kwargs["structured_outputs"] = guided
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_refusing_unsupported
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
    stop: str | list[str] | None = None  # a list once made ([] for none)
    stop_token_ids: list[int] | None = None  # a list once made, without repeats
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always included)
    # number of top logprobs per prompt token (the prompt token's own is always included; the first token has none)
    prompt_logprobs: int | None = None
    # token id -> added to its logit before sampling (OpenAI's logit_bias; -100 / 100 ban / force the token)
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # False: no space between two special tokens next to each other in the text (vLLM's; only where the tokenizer's
    # decoder would put one there, and special tokens are kept)
    spaces_between_special_tokens: bool = True
    # What a running request's outputs hold (AsyncEngine, LLMEngine.step); see RequestOutputKind
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
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
    bad_words: list[str] | None = None  # a list once made ([] for none), without repeats
    # vLLM's arguments for custom sampling code; aserve runs none, so only an empty one is taken
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop or [])
        else:
            raise ParamError("stop", f"stop must be a string or a list of strings, got {self.stop!r}")
        for name in ("stop_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ParamError(name, f"{name} must be a list, got {value!r}")
            setattr(self, name, list(value or []))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM's: True asks for one
                setattr(self, name, 1)
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, bool):
            self.output_kind = RequestOutputKind(self.output_kind) if 0 <= self.output_kind <= 2 else None
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ParamError("output_kind", "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or "
                             "FINAL_ONLY)")  # fmt: skip
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ParamError("extra_args", f"extra_args must be a dict, got {self.extra_args!r}")
        if self.extra_args:
            raise ParamError("extra_args", f"extra_args {list(self.extra_args)!r} are not supported: aserve runs "
                             "no custom sampling code that would read them")  # fmt: skip
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        self._validate()
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))  # (as vLLM: repeats dropped)
        self.bad_words = list(dict.fromkeys(self.bad_words))

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
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        for name in _BOOLEAN_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be a list of non-empty strings")
        if not self.detokenize and self.stop:
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

    @classmethod
    def from_optional(cls, logit_bias: dict | None = None, **fields) -> SamplingParams:
        """vLLM's: None for n, the penalties, temperature or top_p means the default; logit_bias keys may be token
        ids written as strings, and biases are clamped to [-100, 100]."""
        for name in _OPTIONAL_FIELDS:
            if name in fields and fields[name] is None:
                del fields[name]
        if logit_bias is not None:
            try:
                logit_bias = {int(t): min(100.0, max(-100.0, b)) for t, b in logit_bias.items()}
            except (TypeError, ValueError):
                raise ParamError("logit_bias", "logit_bias takes token ids (or their strings) -> numbers, got "
                                 f"{logit_bias!r}") from None  # fmt: skip
        return cls(logit_bias=logit_bias, **fields)

    @property
    def guided_decoding(self) -> StructuredOutputsParams | None:
        """vLLM's older name of structured_outputs."""
        return self.structured_outputs

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


# vLLM's older name of the structured-output constraint
GuidedDecodingParams = StructuredOutputsParams


# |length_penalty| at most this: length ** penalty stays a finite float at any context length (2**17 ** 50 ~ 1e255)
MAX_LENGTH_PENALTY = 50.0


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's (here, as in vLLM's sampling_params): beams kept per prompt, the most tokens generated, and how
    candidates are ranked; aserve/beam_search.py runs the search."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # the one token each beam's step samples (an extra candidate beside the top ones)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # (the end-of-sequence token's text is never added to `text`)

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            raise ParamError("beam_width", f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:  # (NaN fails too)
            raise ParamError("length_penalty", f"length_penalty must be in [-{MAX_LENGTH_PENALTY}, "
                             f"{MAX_LENGTH_PENALTY}], got {self.length_penalty!r}")  # fmt: skip

    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
                              detokenize=False)  # fmt: skip
