"""Model-based drafting, run by the model runner right after the target's step.

layer_skip   the target's first L layers, its final norm and lm_head are the draft model. Its KV cache is the
             target's own (layers 0..L-1): for accepted tokens the target wrote exactly what the draft would, so
             there is nothing to keep in sync.
draft_model  a separate small model with its own KV cache tensor, indexed by the same block ids (the target's block
             tables and slots serve both). It "mirrors" every target step over the same tokens to keep its KV
             complete.

Drafting k tokens for a request takes k one-token forward passes, batched over requests, at the positions after
the step's last emitted token; the KV slots were allocated as lookahead by the scheduler. They are launched from the
step's sampling on the device, before its results reach the host (ModelDrafter.launch). Drafts of sampling
requests are drawn from the draft's distribution q (kept for the rejection test); greedy requests take its argmax.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from aserve.layers.attention import select_attention_backend
from aserve.layers.attention.backend import AttentionMetadata
from aserve.models.loader import build_model
from aserve.models.model_path import resolve_model
from aserve.spec.config import SpeculativeConfig
from aserve.worker.cuda_graphs import StepGraphs
from aserve.worker.model_runner import allocate_kv_cache, kv_bytes_per_block
from aserve.worker.sampler import SampleRow


class ModelDrafter:
    def __init__(self, runner, config: SpeculativeConfig, seed: int) -> None:
        self.runner = runner
        self.config = config
        target = runner.model
        if config.method == "layer_skip":
            if not 1 <= config.num_layers < len(target.layers):
                raise ValueError(
                    f"layer_skip num_layers must be in [1, {len(target.layers) - 1}] for this model, "
                    f"got {config.num_layers}"
                )
            self.model, self.num_layers, self.backend = target, config.num_layers, runner.backend
            self.needs_mirror = False
            self.kv_bytes_per_block = 0
            self.cost_fraction = config.num_layers / len(target.layers)
        else:
            from transformers import AutoConfig  # heavy: only for a separate draft model

            model_dir, _ = resolve_model(config.model)
            hf_config = AutoConfig.from_pretrained(model_dir)
            if hf_config.vocab_size != target.config.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({hf_config.vocab_size}) differs from the target's "
                    f"({target.config.vocab_size}): it must use the same tokenizer"
                )
            self.backend = select_attention_backend(runner.attention_backend, hf_config, runner.dtype,
                                                    runner.max_num_seqs, runner.device)  # fmt: skip
            self.model = build_model(
                hf_config, model_dir, runner.dtype, runner.device, runner.max_model_len, self.backend, "auto", seed
            )
            self.num_layers = None
            self.needs_mirror = True
            self.kv_bytes_per_block = kv_bytes_per_block(self.model, runner.block_size, runner.dtype)
            target_params = sum(p.numel() for p in target.parameters())
            self.cost_fraction = sum(p.numel() for p in self.model.parameters()) / target_params
        self._own_kv: torch.Tensor | None = None
        self.graphs: StepGraphs | None = None  # CUDA graphs of the drafting steps (capture_cuda_graphs)
        # Host tensors the drafting inputs are copied from (pinned on a GPU): the model runner's own host buffers
        # may still be read by the step's copies, which drafting does not wait for. Per request: known tokens, drafts
        # wanted, first sampler row, drafts verified; and its block table row.
        pin = runner.device.type == "cuda"
        self._host = {
            "info": torch.zeros(4, runner.max_num_seqs, dtype=torch.int64, pin_memory=pin),
            "blocks": torch.zeros(runner.max_num_seqs, runner.max_blocks_per_seq, dtype=torch.int32, pin_memory=pin),
        }
        self._host_np = {name: t.numpy() for name, t in self._host.items()}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.needs_mirror:
            r = self.runner
            self._own_kv = allocate_kv_cache(self.model, num_blocks, r.block_size, r.dtype, r.device)

    @property
    def kv_caches(self) -> torch.Tensor:
        return self._own_kv if self.needs_mirror else self.runner.kv_caches

    def mirror_graph(self, key: tuple[int, int]) -> bool:
        """Mirrors a step the target ran as the CUDA graph `key` (its padded inputs still in the device buffers) by
        replaying the draft model's graph of the same shape. -> False where there is none."""
        if self.graphs is None or key not in self.graphs.graphs:
            return False
        self.graphs.run(key)
        return True

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        meta = dataclasses.replace(meta, state=None)  # the draft model's backend builds its own
        self.backend.prepare(meta, self.runner.block_size)
        self.model(input_ids, positions, self.kv_caches, meta)

    def capture_cuda_graphs(self, pool) -> None:
        """Graphs of the drafter's one-token steps at every decode batch size, in the target's pool."""
        r = self.runner
        if self.needs_mirror and not self.backend.supports_cuda_graphs:
            return

        def forward(input_ids, positions, meta):
            return self.model(input_ids, positions, self.kv_caches, meta, num_layers=self.num_layers)

        # A draft model also mirrors the target's steps: its graphs cover the target's verification shapes too.
        max_query_len = r.graphs.max_query_len if self.needs_mirror else 1
        self.graphs = StepGraphs(r, forward, self.backend, r.max_num_seqs, max_query_len)
        self.graphs.capture(pool)

    @torch.inference_mode()
    def launch(self, sampled, verified: list[list[int]], candidates: torch.Tensor, accepted: torch.Tensor | None):
        """Launches the drafting of the sampled requests that want drafts, from the step's sampling as it stands on
        the device (the sampler's rows: each request's verified drafts, then its bonus row; `candidates` the token
        each row emits if the run stops there, `accepted` whether each row's draft is accepted, None without
        drafts), before the host has its results. -> PendingDrafts.

        The active requests draft together, most drafts first, for as many one-token steps as the most any of
        them wants; a request past its own count keeps drafting at its last draft position without writing KV
        (slot -1) and that output is dropped. So every step has the same rows; their inputs (the last emitted
        token, positions after the accepted run, slots, lengths) are computed on the device, each step's tokens
        feed the next there, and the drafts reach the host with the step's own results, in the same wait."""
        active = sorted((i for i, s in enumerate(sampled) if s.num_draft_next > 0),
                        key=lambda i: -sampled[i].num_draft_next)  # fmt: skip
        if not active:
            return PendingDrafts(len(sampled), [], [], [], None, [])
        r, n = self.runner, len(active)
        dev = r.buffers.device
        first_row = np.zeros(len(sampled) + 1, dtype=np.int64)
        np.cumsum([len(d) + 1 for d in verified], out=first_row[1:])
        # Per active request: known tokens before the step (the last emitted token sits at that position plus the
        # accepted drafts), drafts wanted, its first sampler row, drafts verified; and its block table row.
        host, host_np = self._host, self._host_np
        host_np["info"][:, :n] = np.array(
            [(s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids), s.num_draft_next, first_row[i],
              len(verified[i])) for i, s in ((i, sampled[i]) for i in active)], dtype=np.int64,
        ).T  # fmt: skip
        for row, i in enumerate(active):
            block_ids = sampled[i].block_ids
            host_np["blocks"][row, : len(block_ids)] = block_ids
        width = max(len(sampled[i].block_ids) for i in active)
        info = host["info"][:, :n].to(r.device, non_blocking=True)
        dev["block_tables"][:n, :width].copy_(host["blocks"][:n, :width], non_blocking=True)
        known, counts, first, num_verified = info
        k_max = sampled[active[0]].num_draft_next
        run = torch.zeros(n, dtype=torch.int64, device=r.device)
        kv_max = max(len(verified[i]) for i in active)
        if accepted is not None and kv_max:
            j = torch.arange(kv_max, device=r.device)
            rows_of = (first[:, None] + j[None, :]).clamp_(max=accepted.shape[0] - 1)
            ok = accepted[rows_of] & (j[None, :] < num_verified[:, None])
            run = ok.long().cumprod(dim=1).sum(dim=1)  # accepted drafts before the first rejection
        steps = torch.arange(k_max, device=r.device)[:, None]
        positions = (known + run)[None, :] + torch.minimum(steps, counts[None, :] - 1)  # [k_max, n]
        bs = r.block_size
        blocks = dev["block_tables"][:n].long().gather(1, (positions // bs).T).T
        slots = torch.where(steps < counts[None, :], blocks * bs + positions % bs, -1)

        key = self.graphs.key_for(n, n, 1) if self.graphs is not None else None
        rows = n if key is None else key[0]  # the graph's rows: n, then padding
        dev["input_ids"][:n].copy_(candidates[first + run])
        for name, value in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1), ("seq_lens", 0)):
            dev[name][n:rows].fill_(value)
        dev["query_start_loc"][: rows + 1].copy_(torch.arange(rows + 1, device=r.device).clamp_(max=n))

        requests = [sampled[i].request for i in active]
        greedy = [q.sampling_params.greedy for q in requests]
        sample_rows = [SampleRow(q, []) for q in requests]
        greedy_t = None if all(greedy) else torch.tensor(greedy, device=r.device)
        sampler = r.sampler
        chosen = torch.empty(k_max, n, dtype=torch.int64, device=r.device)
        step_probs = []
        for j in range(k_max):
            dev["positions"][:n].copy_(positions[j])
            dev["slot_mapping"][:n].copy_(slots[j])
            dev["seq_lens"][:n].copy_(positions[j] + 1)
            if j:
                dev["input_ids"][:n].copy_(chosen[j - 1])
            hidden = self.graphs.run(key)[:n] if key is not None else self._forward_eager(n, width, positions[j] + 1)
            if greedy_t is None:
                chosen[j] = self.model.compute_logits(hidden, None).argmax(dim=-1)
                continue
            logits = self.model.compute_logits(hidden)
            p = sampler.probs(logits, sample_rows)
            u = torch.rand(n, generator=sampler.generator, device=logits.device)
            chosen[j] = torch.where(greedy_t, logits.argmax(dim=-1), sampler.draw(p, u))
            step_probs.append(p)
        return PendingDrafts(len(sampled), active, [sampled[i].num_draft_next for i in active], greedy, chosen,
                             step_probs)  # fmt: skip

    def _forward_eager(self, n: int, width: int, seq_lens: torch.Tensor) -> torch.Tensor:
        """One token per request over the device buffers as set -> hidden [n, hidden]. (The host needs the lengths:
        on a GPU, a wait; the graphs, which need none, cover every batch they can.)"""
        r = self.runner
        dev = r.buffers.device
        lengths = seq_lens.tolist()
        meta = AttentionMetadata(
            num_tokens=n,
            num_decodes=n,
            slot_mapping=dev["slot_mapping"][:n],
            query_start_loc=dev["query_start_loc"][: n + 1],
            seq_lens=dev["seq_lens"][:n],
            block_tables=dev["block_tables"][:n, :width],
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=lengths,
            max_seq_len=max(lengths),
            max_query_len=1,
        )
        self.backend.prepare(meta, r.block_size)
        return self.model(dev["input_ids"][:n], dev["positions"][:n], self.kv_caches, meta, num_layers=self.num_layers)


class PendingDrafts:
    """Drafts launched on the device; result() -> (drafts, draft distributions) per sampled request (None where
    none are wanted), in one copy to the host."""

    def __init__(self, num_sampled: int, active: list[int], counts: list[int], greedy: list[bool], chosen,
                 step_probs: list[torch.Tensor]) -> None:  # fmt: skip
        self.num_sampled, self.active, self.counts, self.greedy = num_sampled, active, counts, greedy
        self.chosen, self.step_probs = chosen, step_probs

    def result(self):
        drafts: list[list[int] | None] = [None] * self.num_sampled
        probs: list[torch.Tensor | None] = [None] * self.num_sampled
        if not self.active:
            return drafts, probs
        host = self.chosen.T.tolist()
        q_all = torch.stack(self.step_probs, dim=1) if self.step_probs else None  # [n, k_max, vocab]
        for row, i in enumerate(self.active):
            drafts[i] = host[row][: self.counts[row]]
            if not self.greedy[row]:
                probs[i] = q_all[row, : self.counts[row]]
        return drafts, probs
