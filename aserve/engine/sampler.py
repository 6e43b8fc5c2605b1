"""Turns the logits of the positions that sample into tokens.

Order (as vLLM v1): raw logprobs (if asked) -> min_tokens masking -> repetition/presence/frequency penalties ->
greedy argmax, or temperature -> min-p -> top-k -> top-p -> sample. Sampling inverts the CDF with one uniform
number per request; a seeded request draws it from its own generator, so its samples do not depend on what else is
in the batch. One host sync per step: reading the chosen tokens (and logprobs when asked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aserve.engine.request import Request


@dataclass(slots=True)
class SampledLogprobs:
    """For one sampled token: the ids and logprobs of the sampled token (first) and the top-n alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[SampledLogprobs | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        params = [r.sampling_params for r in requests]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        logits = self._mask_min_tokens(logits, requests)
        if any(p.needs_penalties for p in params):
            logits = self._apply_penalties(logits, requests)

        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests)

        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_list, [None] * len(requests))
        return SamplerOutput(token_list, self._gather_logprobs(raw_logprobs, tokens, token_list, params))

    # -- logits processing ------------------------------------------------------------------------------------

    def _mask_min_tokens(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows, cols = [], []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                stop_ids = list(p.stop_token_ids)
                if r.eos_token_id is not None and not p.ignore_eos:
                    stop_ids.append(r.eos_token_id)
                rows += [i] * len(stop_ids)
                cols += stop_ids
        if rows:
            logits = logits.clone()
            logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        logits = logits.clone()
        vocab = logits.shape[1]
        for i, r in enumerate(requests):
            p = r.sampling_params
            if not p.needs_penalties:
                continue
            row = logits[i]
            output_ids = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(output_ids, minlength=vocab)[:vocab].to(row.dtype)
            if p.repetition_penalty != 1:
                seen = counts > 0
                seen[torch.tensor(r.prompt_token_ids, dtype=torch.long, device=logits.device)] = True
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, penalised, row))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        dev = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        argmax = logits.argmax(dim=-1)
        logits = logits / temperature.unsqueeze(1)

        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
            probs = logits.softmax(dim=-1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(p.top_k > 0 for p in params):
            vocab = logits.shape[1]
            k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=dev)
            sorted_logits, order = logits.sort(dim=-1, descending=False)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1 - top_p).unsqueeze(1)
            drop[:, -1] = False  # always keep the most likely token
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))

        # Inverse-CDF sampling: one uniform number per row (cheap, unlike per-token noise on CPU); a seeded
        # request draws its number from its own generator.
        probs = logits.softmax(dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = torch.rand(len(requests), 1, generator=self.generator, device=dev)
        for i, r in enumerate(requests):
            if r.sampling_params.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=dev)
                    r.generator.manual_seed(r.sampling_params.seed)
                u[i] = torch.rand(1, generator=r.generator, device=dev)
        sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        return torch.where(greedy, argmax, sampled)

    # -- logprobs ---------------------------------------------------------------------------------------------

    def _gather_logprobs(self, raw_logprobs, tokens, token_list, params) -> list[SampledLogprobs | None]:
        max_n = max(p.logprobs or 0 for p in params)
        sampled_lp = raw_logprobs.gather(1, tokens.unsqueeze(1))
        ranks = (raw_logprobs > sampled_lp).sum(dim=1) + 1
        top_lp, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n else (None, None)
        sampled_lp, ranks = sampled_lp.squeeze(1).tolist(), ranks.tolist()
        top_lp = top_lp.tolist() if max_n else None
        top_ids = top_ids.tolist() if max_n else None
        out: list[SampledLogprobs | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            n = p.logprobs
            ids = [token_list[i]] + (top_ids[i][:n] if n else [])
            lps = [sampled_lp[i]] + (top_lp[i][:n] if n else [])
            out.append(SampledLogprobs(ids, lps, ranks[i]))
        return out
