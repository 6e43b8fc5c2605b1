"""The grammar's token mask, applied to a step's logits before sampling (structured output, see
aserve/core/structured_output.py).

A step's logits have one row per position to sample: each request's next token, after any drafts being verified.
For a constrained request, row j gets the bitmask of its matcher after drafts 1..j: the drafts are accepted into the
matcher one by one while filling, then rolled back (the scheduler advances it by what the step really emits). A draft
the grammar refuses is masked out of its own row, so verification rejects it there and the token emitted instead is
sampled from the masked row; the rows after it are never used and stay unmasked.

The mask is filled on the host (xgrammar's matchers are host objects), in the worker thread; rows of unconstrained
requests are all ones. It is applied in place: on a GPU by xgrammar's kernel after a copy, on the CPU by
`apply_bitmask_cpu`, which works on whole 32-token words (xgrammar's CPU kernel tests every bit: 3x slower on
[32, 49152] bf16 logits). A mask sets refused tokens to -inf, so the rows' finite check (non-finite logits are a
fault) is taken before it, on the logits as the model produced them. Greedy rows on the CPU are checked instead of
masked (`correct_greedy`): a row's argmax that the grammar accepts is kept; only the others are masked and picked again.

Filling needs the matcher to have seen every token before the row: the engine turns async scheduling's overlap off
while a constrained request is live (EngineCore.can_overlap), as it does for penalties.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

from aserve.core.request import Request

_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [rows, vocab] (a row's stride may exceed vocab) <- -inf where bit t % 32 of bitmask word t // 32 is 0,
    as xgrammar.apply_token_bitmask_inplace (its reference, in the tests). By words: an all-ones word (most of them
    inside a JSON string) is left alone, a zero word (most of them between JSON tokens) is -inf as a whole, and only
    the few mixed ones are unpacked bit by bit."""
    rows, vocab = logits.shape
    full = vocab // 32
    words = bitmask[:rows, :full]
    main = logits[:, : full * 32].view(rows, full, 32)
    main[words == 0] = float("-inf")
    mixed = ((words != 0) & (words != -1)).nonzero(as_tuple=True)
    if mixed[0].numel():
        refused = ((words[mixed].unsqueeze(1) >> _BITS) & 1) == 0
        main[mixed] = main[mixed].masked_fill(refused, float("-inf"))
    if full * 32 < vocab:  # the last, partial word
        refused = ((bitmask[:rows, full].unsqueeze(1) >> _BITS[: vocab - full * 32]) & 1) == 0
        logits[:, full * 32 :].masked_fill_(refused, float("-inf"))


class GrammarBitmask:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, grown to the largest step seen

    def _buffer(self, rows: int, vocab_size: int) -> torch.Tensor:
        words = (vocab_size + 31) // 32
        if self._host is None or self._host.shape[0] < rows or self._host.shape[1] != words:
            shape = (max(rows, 2 * self._host.shape[0] if self._host is not None else 0), words)
            self._host = torch.full(shape, -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        return self._host

    @staticmethod
    def constrained(requests: list[Request]) -> bool:
        return any(r.grammar is not None for r in requests)

    @staticmethod
    def _walk(requests: list[Request], drafts: list[list[int]], visit) -> None:
        """visit(matcher, row) for each logits row of each constrained request, the matcher in its state after the
        drafts before that row; a draft the grammar refuses (or its stop token) ends the request's rows. The drafts
        are rolled back after. A grammar still waiting for its start token (`GrammarState.after`) leaves free
        the rows up to the one whose draft is that token."""
        base = 0
        for request, request_drafts in zip(requests, drafts):
            grammar = request.grammar
            matcher = grammar.matcher if grammar is not None else None  # None: finished since it was scheduled
            if matcher is not None:
                after, accepted = grammar.after, 0
                try:
                    for j in range(len(request_drafts) + 1):
                        if after is not None:  # the grammar waits for `after`: rows up to it are free
                            if j < len(request_drafts) and request_drafts[j] == after:
                                after = None
                            continue
                        if matcher.is_terminated():
                            break  # a draft was the stop token: the sequence ends there
                        visit(matcher, base + j)
                        if j == len(request_drafts) or not matcher.accept_token(request_drafts[j]):
                            break
                        accepted += 1
                finally:
                    if accepted:
                        matcher.rollback(accepted)
            base += len(request_drafts) + 1

    def fill(self, requests: list[Request], drafts: list[list[int]], vocab_size: int):
        """-> (bitmask rows, the logits rows they belong to), or None when no request of the step is constrained."""
        if not self.constrained(requests):
            return None
        num_rows = sum(len(d) + 1 for d in drafts)
        bitmask = self._buffer(num_rows, vocab_size)
        bitmask[:num_rows].fill_(-1)  # every token allowed, unless a matcher fills the row
        rows: list[int] = []

        def visit(matcher, row: int) -> None:
            matcher.fill_next_token_bitmask(bitmask, row)
            rows.append(row)

        self._walk(requests, drafts, visit)
        return (bitmask, rows) if rows else None

    def correct_greedy(self, logits, requests, drafts, argmax: torch.Tensor, pick) -> None:
        """Greedy rows on the CPU, `argmax` (each row's first maximum, from the unmasked logits) corrected in place:
        a row's argmax the grammar accepts is its masked argmax as well, and it is checked by the matcher accepting
        (then rolling back) it, ~1 us; only the rows whose argmax it refuses get their mask filled and applied (to a
        copy) and `pick` (the greedy kernel) run again. The logits stay as they are."""
        chosen = argmax.tolist()
        bitmask = self._buffer(len(chosen), logits.shape[1])
        refused: list[int] = []

        def visit(matcher, row: int) -> None:
            if matcher.accept_token(chosen[row]):
                matcher.rollback(1)
            else:
                matcher.fill_next_token_bitmask(bitmask, row)
                refused.append(row)

        self._walk(requests, drafts, visit)
        if refused:
            masked = logits[refused]
            apply_bitmask_cpu(masked, bitmask[refused])
            argmax[refused] = pick(masked)

    def apply(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> torch.Tensor | None:
        """Masks the constrained rows of `logits` in place. -> each row's non-finite flag, taken before the mask, or
        None (nothing masked)."""
        filled = self.fill(requests, drafts, logits.shape[1])
        if filled is None:
            return None
        bitmask, rows = filled
        # float16 sums overflow (a row of -2s over 49k tokens already does); bfloat16 and float32 sums do not
        wide = torch.float32 if logits.dtype == torch.float16 else None
        nonfinite = ~torch.isfinite(logits.sum(dim=-1, dtype=wide))
        bitmask = bitmask[: logits.shape[0]]
        if logits.device.type == "cpu":
            apply_bitmask_cpu(logits, bitmask)
        else:
            bitmask = bitmask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
        return nonfinite
