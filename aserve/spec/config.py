"""`speculative_config`, in vLLM's shape:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}
    {"method": "layer_skip", "num_layers": L, "num_speculative_tokens": 4, "draft_head": "model" | "int8"}

"num_speculative_tokens": "auto" lets the adaptive policy choose k per request and step (up to `max_k`).
layer_skip's "draft_head": "int8" drafts through an int8 copy of the target's lm_head (one scale per vocabulary row):
half the bytes a 16-bit head reads per draft step, at the cost of holding the copy (vocabulary x hidden bytes);
verification still uses the model's own head, so outputs are unchanged."""

from __future__ import annotations

import json
from dataclasses import dataclass

_METHODS = ("ngram", "draft_model", "layer_skip")
_DRAFT_HEADS = ("model", "int8")
_AUTO_MAX_K = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # the most drafts per step
    adaptive: bool = False
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # draft_model
    num_layers: int | None = None  # layer_skip
    draft_head: str = "model"  # layer_skip: the target's head ("model") or an int8 copy of it ("int8")

    @property
    def needs_kv(self) -> bool:
        """Model drafters write KV for the positions they draft at (lookahead slots)."""
        return self.method != "ngram"

    def lookahead_slots(self, k: int) -> int:
        """KV slots past a step's tokens that drafting k tokens after it writes: a model drafter's at the k
        positions it drafts at, layer_skip's at its last draft's too (aserve/worker/drafter.py)."""
        return k + (self.method == "layer_skip") if self.needs_kv and k else 0

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        cfg = dict(value)
        method = cfg.pop("method", None)
        if method not in _METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(_METHODS)}, got {method!r}")
        k = cfg.pop("num_speculative_tokens", 4)
        adaptive = k == "auto"
        if adaptive:
            k = _AUTO_MAX_K
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f'num_speculative_tokens must be 1..16 or "auto", got {k!r}')
        out = cls(method=method, num_speculative_tokens=k, adaptive=adaptive)
        kwargs = {}
        if method == "ngram":
            lo, hi = cfg.pop("prompt_lookup_min", 2), cfg.pop("prompt_lookup_max", 5)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
            kwargs = dict(prompt_lookup_min=lo, prompt_lookup_max=hi)
        elif method == "draft_model":
            model = cfg.pop("model", None)
            if not isinstance(model, str):
                raise ValueError("speculative_config.model (the draft model's path) is required for draft_model")
            kwargs = dict(model=model)
        else:
            layers = cfg.pop("num_layers", None)
            if not isinstance(layers, int) or layers < 1:
                raise ValueError("speculative_config.num_layers (an integer >= 1) is required for layer_skip")
            head = cfg.pop("draft_head", "model")
            if head not in _DRAFT_HEADS:
                raise ValueError(
                    f"speculative_config.draft_head must be one of {', '.join(_DRAFT_HEADS)}, got {head!r}"
                )
            kwargs = dict(num_layers=layers, draft_head=head)
        if cfg:
            raise ValueError(f"unknown speculative_config keys for {method}: {', '.join(sorted(cfg))}")
        return cls(**{**out.__dict__, **kwargs})
