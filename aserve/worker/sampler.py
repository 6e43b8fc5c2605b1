"""Turns logits into tokens, and verifies speculative drafts.

A logits row is one position to sample at: a request, plus (when verifying) the draft tokens assumed before that
position, which count as generated tokens for penalties and min_tokens. Order of processing (as vLLM v1): raw
logprobs (if asked) -> min_tokens masking -> logit_bias -> allowed_token_ids -> repetition/presence/frequency
penalties -> greedy argmax, or temperature -> min-p -> top-k -> top-p -> probabilities.

Verification of k drafts d_1..d_k of one request (rows 0..k) is lossless rejection sampling: accept d_j with
probability min(1, p_j(d_j) / q_j(d_j)) while they are accepted; at the first rejection emit a token drawn from
normalize(max(0, p_j - q_j)); if all are accepted emit a bonus token drawn from p_k. q is the draft distribution
(one-hot for n-gram drafts). Greedy requests accept while d_j is the argmax. Every row's candidate token is drawn in
one vectorised pass and the host picks the one after the accepted prefix: one host sync per step.

Rows whose raw logits are not all finite (NaN, or an overflow to infinity) are flagged, in the same host copy as the
tokens: argmax over a NaN row still returns an in-vocabulary id, so without the flag a broken row would pass as a
valid, garbage token.

Draws use inverse-CDF sampling with one uniform per draw; a seeded request draws from its own generator, so its
samples do not depend on what else is in the batch.

Structured output: the rows of constrained requests are masked to what their grammar allows before anything else
(aserve/worker/grammar_bitmask.py), drafts included; their finite check is taken before the mask, their logprobs
after it (as vLLM's: of the distribution sampled from). A greedy batch on the CPU keeps each row's argmax where the
grammar accepts it and masks only the others (the same tokens, without writing most of the logits). Where min_tokens
would mask the last tokens a row's grammar or allowed_token_ids leave (a stop token), min_tokens gives way: the
output ends complete rather than broken.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from aserve.core.outputs import SampledLogprobs, SamplerOutput
from aserve.core.request import Request
from aserve.kernels import cpu
from aserve.worker.grammar_bitmask import GrammarBitmask


def list_to_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on `device`, without a blocking copy (which would wait for the whole stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def copy_to_host(*tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Starts copying `tensors` (on one device) to the host without waiting -> (their host copies, the event to wait
    for before reading them; None where they are on the host already)."""
    if not tensors[0].is_cuda:
        return list(tensors), None
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for host, t in zip(hosts, tensors):
        host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return hosts, event


class SampleRow:
    """A request at the position after `prefix` (draft tokens not yet accepted) and `pending` more tokens that
    earlier, still running steps sample (async scheduling: counted, their ids unknown on the host)."""

    __slots__ = ("request", "prefix", "pending")

    def __init__(self, request: Request, prefix: list[int], pending: int = 0) -> None:
        self.request = request
        self.prefix = prefix
        self.pending = pending

    @property
    def params(self):
        return self.request.sampling_params

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.prefix) + self.pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.prefix


class PendingSample:
    """One token per request, sampled on the device (Sampler.launch): `tokens` stays there for the next step's
    inputs; result() waits for the host copies (tokens, non-finite flags, logprobs) -> SamplerOutput."""

    __slots__ = ("tokens", "_requests", "_host", "_event")

    def __init__(self, tokens: torch.Tensor, requests: list[Request], host: dict, event) -> None:
        self.tokens = tokens
        self._requests, self._host, self._event = requests, host, event

    def finished(self) -> bool:
        """Have the host copies landed? (False without a device to wait for: on the CPU they are made at launch.)"""
        return self._event is not None and self._event.query()

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
        h = {k: v.tolist() for k, v in self._host.items()}
        n = len(self._requests)
        token_ids = h["tokens"]
        logprobs: list[list[SampledLogprobs] | None] = [None] * n
        if "chosen" in h:
            for i, r in enumerate(self._requests):
                k = r.sampling_params.logprobs
                if k is not None:
                    top_ids, top_lp = h["top_ids"][i], h["top_lp"][i]
                    logprobs[i] = [SampledLogprobs.of(token_ids[i], h["chosen"][i], h["ranks"][i], top_ids, top_lp, k)]
        return SamplerOutput([[t] for t in token_ids], logprobs, [0] * n, [bool(x) for x in h["nonfinite"]])


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.grammar_bitmask = GrammarBitmask(device)
        # The greedy first-maximum kernel of the device, chosen once: (supports(logits), greedy_pick(logits)).
        if device.type == "cuda":
            from aserve.kernels import greedy  # Triton: imported only where a GPU needs it

            self._greedy_kernel = (greedy.supports, greedy.greedy_pick)
        elif device.type == "cpu":
            self._greedy_kernel = (cpu.sample_supports, cpu.greedy_pick)
        else:
            self._greedy_kernel = None

    def warm_up(self, logits: torch.Tensor) -> None:
        """Runs the greedy pick once on logits of the kind steps produce (the model's dtype): its Triton kernels
        compile at start-up rather than on the first request."""
        self.first_max(logits)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        drafts: list[list[int]] | None = None,
        draft_probs: list[torch.Tensor | None] | None = None,
        on_emitted: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> SamplerOutput:
        """logits: len(drafts[i]) + 1 rows per request, in request order. draft_probs[i] (optional) holds the draft
        distributions [k, vocab] the drafts were sampled from; None means one-hot (n-gram). on_emitted(accepted,
        last): each request's number of accepted drafts and the last token it emits, on the device, as soon as they
        are computed: before the host waits for them where no logprobs are asked for (a model drafter launches the
        next drafts from them while the host takes this step's results)."""
        drafts = [list(d) for d in drafts] if drafts else [[] for _ in requests]  # (a model drafter's DraftTokens)
        rows = [SampleRow(r, d[:j]) for r, d in zip(requests, drafts) for j in range(len(d) + 1)]
        want_logprobs = any(r.sampling_params.logprobs is not None for r in requests)
        raw_logprobs = None
        grammar, grammar_nonfinite = self.grammar_bitmask, None
        constrained = any(r.grammar is not None for r in requests)  # structured output: its rows are masked
        check_greedy = constrained and logits.device.type == "cpu"  # greedy: check the argmax, mask only if refused
        if constrained and not check_greedy:
            grammar_nonfinite = grammar.apply(logits, requests, drafts)
        if not want_logprobs and (picked := self._greedy_pick(logits, rows)) is not None:
            argmax, nonfinite = picked
            if check_greedy:
                grammar.correct_greedy(logits, requests, drafts, argmax, self.first_max)
            candidates, accepted = self._candidates(logits, rows, drafts, draft_probs, argmax)
        else:
            if check_greedy:
                grammar_nonfinite = grammar.apply(logits, requests, drafts)
            logits, nonfinite, raw_logprobs = self._widen(logits, rows, want_logprobs)
            if any(row.params.needs_penalties for row in rows):
                logits = self._apply_penalties(logits, rows)
            candidates, accepted = self._candidates(logits, rows, drafts, draft_probs)
        if grammar_nonfinite is not None:
            nonfinite = grammar_nonfinite  # the masked rows' -inf are no fault

        # One sync: per row, the token to emit if the run stops there, whether its logits were finite, and whether
        # its draft is accepted.
        packed = [candidates, nonfinite.long()] + ([accepted.long()] if accepted is not None else [])
        early = on_emitted is not None and raw_logprobs is None
        if early:
            (host,), event = copy_to_host(torch.stack(packed))
            on_emitted(*self._last_emitted(candidates, accepted, drafts))
            if event is not None:
                event.synchronize()
            host = host.tolist()
        else:
            host = torch.stack(packed).tolist()
        candidate_list, nonfinite_list = host[0], host[1]
        accepted_list = host[2] if accepted is not None else None
        token_ids: list[list[int]] = []
        emitted_rows: list[list[int]] = []
        request_nonfinite: list[bool] = []
        base = 0
        for d in drafts:
            n = 0
            while n < len(d) and accepted_list[base + n]:
                n += 1
            token_ids.append(list(d[:n]) + [candidate_list[base + n]])
            emitted_rows.append(list(range(base, base + n + 1)))
            request_nonfinite.append(any(nonfinite_list[base : base + len(d) + 1]))
            base += len(d) + 1
        logprobs: list[list[SampledLogprobs] | None] = [None] * len(requests)
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(raw_logprobs, requests, token_ids, emitted_rows)
        if on_emitted is not None and not early:
            on_emitted(*self._last_emitted(candidates, accepted, drafts))
        return SamplerOutput(token_ids, logprobs, [len(d) for d in drafts], request_nonfinite)

    def _last_emitted(self, candidates: torch.Tensor, accepted: torch.Tensor | None, drafts: list[list[int]]):
        """-> per request, on the device: its number of accepted drafts (the leading run of accepted rows) and the
        token it emits last (the candidate of the row after that run). One host-to-device copy of the rows' layout."""
        lens = [len(d) for d in drafts]
        starts = np.cumsum([0, *(n + 1 for n in lens[:-1])])
        k = max(lens)
        if accepted is None or not k:
            last = candidates[self._tensor(starts.tolist(), torch.long)]
            return torch.zeros(len(lens), dtype=torch.long, device=candidates.device), last
        # Per request: its draft rows (-1 past its own count), then its first row.
        layout = np.full((len(lens), k + 1), -1, dtype=np.int64)
        for i, (start, n) in enumerate(zip(starts, lens)):
            layout[i, :n] = np.arange(start, start + n)
        layout[:, k] = starts
        layout = list_to_device(layout, candidates.device)
        rows = layout[:, :k]
        run = (accepted[rows.clamp(min=0)] & (rows >= 0)).long().cumprod(dim=1).sum(dim=1)
        return run, candidates[layout[:, k] + run]

    def launch(self, logits: torch.Tensor, requests: list[Request]) -> PendingSample:
        """One token per request without waiting for the device (async scheduling): min_tokens (counting the
        tokens still in flight), temperature/top-k/top-p/min-p, seeds and logprobs as in __call__; no drafts, no
        penalties and no grammars (those need every earlier token id on the host)."""
        # A request's own token in this step is in flight already (the scheduler counted it), and so is the
        # previous step's when that one is still running.
        rows = [SampleRow(r, [], max(r.num_inflight - 1, 0)) for r in requests]
        want_logprobs = any(r.sampling_params.logprobs is not None for r in requests)
        raw_logprobs = None
        if not want_logprobs and (picked := self._greedy_pick(logits, rows)) is not None:
            candidates, nonfinite = picked
        else:
            logits, nonfinite, raw_logprobs = self._widen(logits, rows, want_logprobs)
            candidates, _ = self._candidates(logits, rows, [[] for _ in requests], None)
        device = {"tokens": candidates, "nonfinite": nonfinite}
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, candidates.unsqueeze(1))
            device["chosen"] = chosen.squeeze(1)
            device["ranks"] = (raw_logprobs > chosen).sum(dim=1) + 1
            max_n = max(r.sampling_params.logprobs or 0 for r in requests)
            device["top_lp"], device["top_ids"] = raw_logprobs.topk(max(max_n, 1), dim=-1)
        hosts, event = copy_to_host(*device.values())
        return PendingSample(candidates, requests, dict(zip(device, hosts)), event)

    def _tensor(self, values: list, dtype: torch.dtype | None = None) -> torch.Tensor:
        return list_to_device(values, self.device, dtype)

    # -- logits processing ------------------------------------------------------------------------------------

    def _mask_min_tokens(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        row_idx, cols = [], []
        for i, row in enumerate(rows):
            p = row.params
            if row.num_output_tokens < p.min_tokens:
                stop_ids = list(p.stop_token_ids)
                if row.request.eos_token_id is not None and not p.ignore_eos:
                    stop_ids.append(row.request.eos_token_id)
                row_idx += [i] * len(stop_ids)
                cols += stop_ids
        return self._mask_tokens(logits, row_idx, cols)

    def _mask_tokens(self, logits: torch.Tensor, row_idx: list[int], cols: list[int]) -> torch.Tensor:
        """logits[row_idx[j], cols[j]] to -inf (a copy; the logits as they are when there is nothing to mask)."""
        if not row_idx:
            return logits
        logits = logits.clone()
        logits[self._tensor(row_idx), self._tensor(cols)] = float("-inf")
        return logits

    def _apply_logit_bias(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        row_idx, cols, biases = [], [], []
        for i, row in enumerate(rows):
            if row.params.logit_bias:
                row_idx += [i] * len(row.params.logit_bias)
                cols += list(row.params.logit_bias)
                biases += [float(b) for b in row.params.logit_bias.values()]
        if row_idx:
            logits = logits.clone()
            logits.index_put_((self._tensor(row_idx), self._tensor(cols)), self._tensor(biases, logits.dtype),
                              accumulate=True)  # fmt: skip
        return self._mask_allowed(self._mask_bad_words(logits, rows), rows)

    def _mask_allowed(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """allowed_token_ids: every other token of the row to -inf."""
        masked = [(i, row.params.allowed_token_ids) for i, row in enumerate(rows) if row.params.allowed_token_ids]
        if not masked:
            return logits
        keep = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
        for i, allowed in masked:
            keep[i] = False
            keep[i, self._tensor(allowed, torch.long)] = True
        return logits.masked_fill(~keep, float("-inf"))

    def _mask_bad_words(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """bad_words: a word's last token to -inf where the row's output ends with its other tokens (always, for a
        one-token word). Its requests run without overlap (EngineCore), so every output token is on the host."""
        row_idx, cols = [], []
        for i, row in enumerate(rows):
            if not row.params.bad_words:
                continue
            words, out = row.request.bad_words_token_ids, row.output_token_ids
            for ids in words:
                if len(ids) == 1 or (len(out) >= len(ids) - 1 and out[len(out) - len(ids) + 1 :] == ids[:-1]):
                    row_idx.append(i)
                    cols.append(ids[-1])
        return self._mask_tokens(logits, row_idx, cols)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        logits = logits.clone()
        vocab = logits.shape[1]
        for i, row_spec in enumerate(rows):
            p = row_spec.params
            if not p.needs_penalties:
                continue
            row = logits[i]
            output_ids = list_to_device(row_spec.output_token_ids, logits.device, torch.long)
            counts = torch.bincount(output_ids, minlength=vocab)[:vocab].to(row.dtype)
            if p.repetition_penalty != 1:
                seen = counts > 0
                prompt_ids = row_spec.request.prompt_token_ids
                seen[list_to_device(prompt_ids, logits.device, torch.long)] = True
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, penalised, row))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def probs(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p -> the distribution each (non-greedy) row samples from."""
        params = [row.params for row in rows]
        temperature = self._tensor([1.0 if p.greedy else p.temperature for p in params])
        logits = logits / temperature.unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            min_p = self._tensor([p.min_p for p in params])
            probs = logits.softmax(dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(p.top_k > 0 for p in params):
            vocab = logits.shape[1]
            k = self._tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p.top_p < 1 for p in params):
            top_p = self._tensor([p.top_p for p in params])
            sorted_logits, order = logits.sort(dim=-1, descending=False)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1 - top_p).unsqueeze(1)
            drop[:, -1] = False  # always keep the most likely token
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.softmax(dim=-1)

    def uniforms(self, rows: list[SampleRow], per_row: int = 1) -> torch.Tensor:
        """[len(rows), per_row] uniforms in [0, 1); seeded requests draw theirs from their own generator."""
        u = torch.rand(len(rows), per_row, generator=self.generator, device=self.device)
        for i, row in enumerate(rows):
            request = row.request
            if request.sampling_params.seed is not None:
                if request.generator is None:
                    request.generator = torch.Generator(device=self.device)
                    request.generator.manual_seed(request.sampling_params.seed)
                u[i] = torch.rand(per_row, generator=request.generator, device=self.device)
        return u

    @staticmethod
    def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF: one token per row of probs (need not be normalised) for uniforms u [rows]."""
        cdf = probs.cumsum(dim=-1)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        return idx.clamp_(max=probs.shape[1] - 1)

    def _widen(self, logits: torch.Tensor, rows: list[SampleRow], want_logprobs: bool):
        """The general path's start: float32 logits with min_tokens masked, each row's non-finite flag and (if
        asked) the raw logprobs, both of the logits as they came."""
        logits = logits.float()
        # One reduction: the sum of a row is finite iff every logit in it is (a quarter of an argmax's cost on CPU).
        nonfinite = ~torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        masked = self._mask_min_tokens(logits, rows)
        out = self._apply_logit_bias(masked, rows)
        # min_tokens gives way in a row where it would leave no token (a grammar or allowed_token_ids that allow only
        # a stop token now): the request ends there rather than sample a token nothing allows. Only such rows can be
        # left with nothing, so only they are checked.
        narrow = [i for i, row in enumerate(rows) if row.num_output_tokens < row.params.min_tokens
                  and (row.params.allowed_token_ids or row.request.grammar is not None)]  # fmt: skip
        if narrow:
            idx = self._tensor(narrow, torch.long)
            stuck = torch.isneginf(out[idx].amax(dim=-1, keepdim=True))
            unmasked = self._apply_logit_bias(logits, rows)[idx]
            out = out.index_copy(0, idx, torch.where(stuck, unmasked, out[idx]))
        return out, nonfinite, raw_logprobs

    def _greedy_pick(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every row greedy with nothing that changes its logits (penalties, logit_bias, min_tokens still to reach):
        (first-maximum index, non-finite flag) per row from one kernel over the logits in the model's dtype (CPU: C,
        aserve/kernels/cpu.py; CUDA: Triton, aserve/kernels/greedy.py); None otherwise."""
        if self._greedy_kernel is None or logits.device.type != self.device.type:
            return None
        for row in rows:
            p = row.params
            if not p.greedy or p.needs_penalties or p.needs_logit_bias or row.num_output_tokens < p.min_tokens:
                return None
        supports, pick = self._greedy_kernel
        return pick(logits) if supports(logits) else None

    def first_max(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum (the greedy kernel where it applies)."""
        if self._greedy_kernel is not None and self._greedy_kernel[0](logits):
            return self._greedy_kernel[1](logits)[0]
        return logits.max(dim=-1).indices

    def _candidates(self, logits, rows, drafts, draft_probs, argmax: torch.Tensor | None = None):
        """-> (candidate token per row, whether each row's draft is accepted (None without drafts)). `argmax`: the
        rows' first-maximum indices, where the caller has them already."""
        greedy = [row.params.greedy for row in rows]
        # max(dim).indices: the same first-maximum index as argmax, ~35 % faster on CPU ([64, 49152] float32:
        # 1.8 vs 2.8 ms, docs/benchmarks.md)
        if argmax is None:
            argmax = logits.max(dim=-1).indices
        has_drafts = any(drafts)
        if all(greedy):
            if not has_drafts:
                return argmax, None
            draft_ids = self._draft_ids(drafts, logits.device)
            return argmax, argmax == draft_ids
        dev = logits.device
        greedy_t = self._tensor(greedy)
        p = self.probs(logits, rows)
        u = self.uniforms(rows, 2 if has_drafts else 1)
        if not has_drafts:
            return torch.where(greedy_t, argmax, self.draw(p, u[:, 0])), None
        # Draft rows: q is one-hot (n-gram) or the draft model's distribution; the last row of each request has
        # no draft and samples from p itself (the bonus token).
        draft_ids = self._draft_ids(drafts, dev)
        is_draft = draft_ids >= 0
        safe_ids = draft_ids.clamp(min=0).unsqueeze(1)
        q = torch.zeros_like(p)
        q.scatter_(1, safe_ids, 1.0)
        if draft_probs is not None and any(dp is not None for dp in draft_probs):
            base = 0
            for d, dp in zip(drafts, draft_probs):
                if dp is not None and len(d):
                    q[base : base + len(d)] = dp
                base += len(d) + 1
        q = q * is_draft.unsqueeze(1)
        p_d = p.gather(1, safe_ids).squeeze(1)
        q_d = q.gather(1, safe_ids).squeeze(1)
        accept_sampled = u[:, 0] * q_d < p_d
        residual = torch.where(is_draft.unsqueeze(1), (p - q).clamp_(min=0.0), p)
        sampled = self.draw(residual, u[:, 1])
        candidates = torch.where(greedy_t, argmax, sampled)
        accepted = torch.where(greedy_t, argmax == draft_ids, accept_sampled) & is_draft
        return candidates, accepted

    @staticmethod
    def _draft_ids(drafts: list[list[int]], device) -> torch.Tensor:
        """The draft token each row verifies (-1 for the bonus rows). Copied without a blocking copy: one would wait
        for the whole stream (the verification's forward) before the host issues the rest of the sampling."""
        return list_to_device([t for d in drafts for t in (*d, -1)], device, torch.long)

    # -- logprobs ---------------------------------------------------------------------------------------------

    def _gather_logprobs(self, raw_logprobs, requests, token_ids, emitted_rows) -> list:
        max_n = max(r.sampling_params.logprobs or 0 for r in requests)
        flat_rows = [row for rows in emitted_rows for row in rows]
        flat_tokens = [t for tokens in token_ids for t in tokens]
        rows_t = list_to_device(flat_rows, raw_logprobs.device)
        lp = raw_logprobs[rows_t]
        tok = list_to_device(flat_tokens, lp.device).unsqueeze(1)
        chosen = lp.gather(1, tok)
        ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
        chosen = chosen.squeeze(1).tolist()
        top_lp, top_ids = lp.topk(max_n, dim=-1) if max_n else (None, None)
        top_lp = top_lp.tolist() if max_n else None
        top_ids = top_ids.tolist() if max_n else None
        out: list = []
        i = 0
        for r, tokens in zip(requests, token_ids):
            n = r.sampling_params.logprobs
            if n is None:
                out.append(None)
                i += len(tokens)
                continue
            entries = []
            for t in tokens:
                entries.append(SampledLogprobs.of(t, chosen[i], ranks[i], top_ids[i] if n else [],
                                                  top_lp[i] if n else [], n))  # fmt: skip
                i += 1
            out.append(entries)
        return out
