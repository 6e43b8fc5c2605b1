"""vLLM's `tokenization_kwargs` of LLM.generate and LLM.chat: how prompts become token ids.

    add_special_tokens       the tokenizer's own (e.g. BOS) around a text prompt: True for generate, False for chat
                             (the template writes them)
    max_length               the longest prompt allowed (default max_model_len); longer ones are refused unless
                             truncated
    truncation               True / "longest_first": keep the last max_length tokens; False / "do_not_truncate": none
    truncate_prompt_tokens   keep the last N tokens (-1: max_length)

Truncation applies to token-id prompts too, as in vLLM. Other keys (vLLM warns and drops them) are refused by name;
do_lower_case and needs_detokenization only as False, what aserve does.
"""

from __future__ import annotations

from dataclasses import dataclass

from aserve.sampling_params import ParamError

_NEUTRAL = {"do_lower_case": False, "needs_detokenization": False}
_KEYS = ("add_special_tokens", "max_length", "truncation", "truncate_prompt_tokens", *_NEUTRAL)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class TokenizeOptions:
    add_special_tokens: bool
    keep_last: int | None = None  # truncate to the last this many tokens
    max_length: int | None = None  # a limit asked for (max_model_len is the engine's own)

    @classmethod
    def from_kwargs(cls, kwargs: dict | None, max_model_len: int, add_special_tokens: bool = True) -> TokenizeOptions:
        """vLLM's tokenization_kwargs -> options; ParamError names a key or value aserve does not take."""
        kwargs = dict(kwargs or {})
        if unknown := sorted(set(kwargs) - set(_KEYS)):
            raise ParamError("tokenization_kwargs", f"tokenization_kwargs {unknown} are not supported (aserve takes "
                             f"{', '.join(_KEYS)})")  # fmt: skip
        for name, neutral in _NEUTRAL.items():
            if (value := kwargs.get(name, neutral)) is not neutral:
                raise ParamError("tokenization_kwargs", f"tokenization_kwargs {name}={value!r} is not supported "
                                 f"(only {neutral})")  # fmt: skip
        add_special_tokens = kwargs.get("add_special_tokens", add_special_tokens)
        if not isinstance(add_special_tokens, bool):
            raise ParamError("tokenization_kwargs", f"add_special_tokens must be a boolean, got {add_special_tokens!r}")
        max_length = kwargs.get("max_length", max_model_len)
        if not _is_int(max_length) or not 1 <= max_length <= max_model_len:
            raise ParamError("tokenization_kwargs", f"max_length must be an integer in [1, {max_model_len}] "
                             f"(max_model_len), got {max_length!r}")  # fmt: skip
        keep_last = kwargs.get("truncate_prompt_tokens")
        truncation = kwargs.get("truncation")
        if truncation in (True, "longest_first"):
            keep_last = max_length
        elif truncation not in (None, False, "do_not_truncate"):
            raise ParamError("tokenization_kwargs", f"truncation={truncation!r} is not supported (True, "
                             "'longest_first', False or 'do_not_truncate'; truncating keeps the end)")  # fmt: skip
        elif truncation is not None:
            keep_last = None
        if keep_last == -1:
            keep_last = max_length
        if keep_last is not None and (not _is_int(keep_last) or not 1 <= keep_last <= max_length):
            raise ParamError("tokenization_kwargs", f"truncate_prompt_tokens must be an integer in [1, {max_length}] "
                             f"(max_length) or -1, got {keep_last!r}")  # fmt: skip
        return cls(add_special_tokens, keep_last, kwargs.get("max_length"))

    def apply(self, token_ids: list[int]) -> list[int]:
        """A prompt's ids truncated as asked; longer than max_length without truncation is a ParamError."""
        if self.keep_last is not None:
            token_ids = token_ids[-self.keep_last :]
        if self.max_length is not None and len(token_ids) > self.max_length:
            raise ParamError("prompt", f"the prompt has {len(token_ids)} tokens, more than tokenization_kwargs' "
                             f"max_length ({self.max_length}); truncation=True keeps the last ones")  # fmt: skip
        return token_ids
