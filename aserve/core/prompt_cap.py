"""How many prompt tokens a step that also decodes may take (`--max-decode-slowdown`).

A prompt chunk computed beside running decodes lengthens that step, and every decoding request waits that long for
its next token: with the whole token budget (8192 by default on GPU) a step of new prompts takes tens of decode
steps' time, which is what a stream's p99 inter-token latency shows. Capping the prompt tokens of such steps (the
stall-free batching of Sarathi-Serve) bounds that gap. A fixed cap cannot fit every batch: a decode step of 256
requests takes about twice as long as one of 64, so it can carry more prompt tokens for the same slowdown. The cap
is therefore a ratio of step times. Prompt tokens add their compute to the decode step they join (measured on an
H100, Llama-3-8B shape: 64 decodes 7.9 ms, with 512 prompt tokens 19.4 ms, ~22 us a token: the decodes' reads
hide none of it), so a step that decodes takes at most P = (ratio - 1) * T(B) / c prompt tokens, T the step-time
model (tokens -> seconds: aserve/spec/policy.py StepCostModel, from start-up timings, refined by measured decode
steps where adaptive speculation shares it), c its cost per token at its largest sizes, and B the batch the live
requests decode as once admitted (their number, at most max_num_seqs; at least the step's decode tokens). B is not
the step's own decodes: while prompts are being admitted only a few requests decode yet, and a cap that shrank with
them admitted prompts slower still (on a CPU, where a step's time is nearly proportional to its tokens, the 64-stream
command settled at a third less throughput that way). Steps without decodes are not capped (a prompt arriving at an
idle engine gets the whole budget).
"""

from __future__ import annotations

MIN_PROMPT_TOKENS = 16  # at least this many per step, so that prompts progress whatever the model says


class PromptCap:
    def __init__(self, cost, ratio: float, max_tokens: int, max_requests: int) -> None:
        """cost: `time(num_tokens) -> seconds`, its points (`sizes`, `times`: seconds at those token counts, sorted)
        and a `version` that changes with them; ratio > 1; max_tokens: the step's token budget (no cap above it);
        max_requests: the most requests a step holds (max_num_seqs)."""
        assert ratio > 1, ratio
        self.cost = cost
        self.ratio = ratio
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self._caps: dict[int, int] = {}  # decode tokens -> the cap, for the cost model's version _version
        self._version = None

    def step_budget(self, running, length_reached, num_requests: int) -> int | None:
        """The prompt tokens the next step may take beside the decodes of `running` (requests whose every known token
        but the last is computed, not paused, not at their length: `length_reached(request, in_flight)`), or None
        where none decodes. num_requests: the live requests, running and waiting."""
        decode = 0
        for request in running:
            pending = request.num_tokens + request.num_inflight - request.num_computed_tokens
            if pending <= 1 and not request.paused and not length_reached(request, request.num_inflight):
                decode += 1 + len(request.spec_token_ids)
        return self(max(decode, min(num_requests, self.max_requests))) if decode else None

    def __call__(self, num_decode_tokens: int) -> int:
        """The most prompt tokens a step beside a batch of `num_decode_tokens` decode (and draft) tokens may
        compute."""
        if self._version != self.cost.version:
            self._caps.clear()
            self._version = self.cost.version
        cap = self._caps.get(num_decode_tokens)
        if cap is None:
            cap = self._caps[num_decode_tokens] = self._solve(num_decode_tokens)
        return cap

    def _solve(self, d: int) -> int:
        """(ratio - 1) * T(d) / c in [MIN_PROMPT_TOKENS, max_tokens - d]."""
        sizes, times = self.cost.sizes, self.cost.times
        per_token = times[-1] / sizes[-1]
        if len(sizes) > 1 and times[-1] > times[-2]:  # the slope between the two largest sizes
            per_token = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
        cap = int((self.ratio - 1) * self.cost.time(max(d, 1)) / per_token)
        return max(MIN_PROMPT_TOKENS, min(cap, self.max_tokens - d))
