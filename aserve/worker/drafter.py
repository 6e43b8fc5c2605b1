"""Model-based drafting, run by the model runner right after the target's step.

layer_skip   the target's first L layers, its final norm and lm_head (or an int8 copy of the head: "draft_head")
             are the draft model. Its KV cache is the target's own (layers 0..L-1). The verification does not
             compute those layers again: drafting runs them over each request's last draft too (one pass more,
             without the head) and keeps every pass's hidden states, and the verification step resumes the target
             from them at layer L (`resume_sources`; the KV of layers 0..L-1 is the drafting's). So the target
             sees, for its first L layers, exactly what the draft saw: where the layers after L add nothing, every
             draft is accepted, instead of a few being lost where one-row and multi-row kernels round apart.
draft_model  a separate small model with its own KV cache tensor, indexed by the same block ids (the target's block
             tables and slots serve both). It "mirrors" every target step over the same tokens to keep its KV
             complete.

Drafting k tokens for a request takes k one-token forward passes, batched over requests, at the positions after
the step's last emitted token; the KV slots were allocated as lookahead by the scheduler. Drafts of sampling
requests are drawn from the draft's distribution q (kept for the rejection test); greedy requests take its argmax.

The drafts travel to the host while the engine goes on: `propose` returns DraftTokens (aserve/worker/draft_tokens.py)
whose length is known at once and whose values the verification step's inputs take on the device. So the update from
the step, the scheduling of the step that verifies the drafts and its launch run while the device still computes
them; the host reads their values (waiting for the device's copy) when the verification's sampler needs them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from aserve.layers.attention import select_attention_backend
from aserve.layers.attention.backend import AttentionMetadata
from aserve.layers.quantization.lm_head import int8_copy
from aserve.models.loader import build_model
from aserve.models.model_path import resolve_model
from aserve.spec.config import SpeculativeConfig
from aserve.worker.cuda_graphs import StepGraphs
from aserve.worker.draft_tokens import DraftTokens, PendingDrafts
from aserve.worker.model_runner import allocate_kv_cache, kv_bytes_per_block
from aserve.worker.sampler import SampleRow, list_to_device


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
            # Deterministic mode recomputes those layers: a token's numbers then do not depend on the drafting.
            self.resumes = not runner.deterministic
            self.lm_head = int8_copy(target.lm_head) if config.draft_head == "int8" else None
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
            self.num_layers, self.lm_head = None, None
            self.resumes = False
            self.needs_mirror = True
            self.kv_bytes_per_block = kv_bytes_per_block(self.model, runner.block_size, runner.dtype)
            target_params = sum(p.numel() for p in target.parameters())
            self.cost_fraction = sum(p.numel() for p in self.model.parameters()) / target_params
        self._own_kv: torch.Tensor | None = None
        self.graphs: StepGraphs | None = None  # CUDA graphs of the drafting steps (capture_cuda_graphs)
        # layer_skip: graphs of the target's verification steps from layer L on, and their input hidden states
        self.resume_graphs: StepGraphs | None = None
        self.resume_in: torch.Tensor | None = None

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
        pool = self.graphs.capture(pool)
        if self.resumes and r.graphs.max_query_len > 1:

            def resume(input_ids, positions, meta):
                hidden, first = self.resume_in[: input_ids.shape[0]], self.num_layers
                return r.model(input_ids, positions, r.kv_caches, meta, start_layer=first, start_hidden=hidden)

            self.resume_graphs = StepGraphs(r, resume, self.backend, r.max_num_seqs, r.graphs.max_query_len, False)
            rows = max(t for _, t in self.resume_graphs.keys)
            self.resume_in = torch.zeros(rows, r.hf_config.hidden_size, dtype=r.dtype, device=r.device)
            self.resume_graphs.capture(pool)

    def resume_sources(self, order) -> tuple[torch.Tensor, list[int]] | None:
        """Where a step's hidden states at layer L come from when every request in it (`order`: the flat batch's)
        verifies drafts of one propose() over all its query tokens (its last token, then those drafts): -> (that
        drafting's hidden states [passes * requests, hidden], the row of each of the step's tokens); else None."""
        if not self.resumes:
            return None
        exits, rows = None, []
        for s in order:
            spec = s.spec_token_ids
            if not isinstance(spec, DraftTokens) or s.num_new_tokens != len(spec) + 1:
                return None
            source, column = spec.exit_source()
            if source is None or (exits is not None and source is not exits):
                return None
            exits = source
            rows.extend(j * source.shape[1] + column for j in range(s.num_new_tokens))
        return exits.view(-1, exits.shape[-1]), rows

    def resume_rows(self, sources: tuple[torch.Tensor, list[int]], graph: bool) -> torch.Tensor:
        """The step's hidden states at layer L (`sources`: resume_sources'), gathered on the device: into the input
        buffer of resume_graphs (`graph`) or a new tensor."""
        exits, rows = sources
        index = list_to_device(rows, exits.device)
        return torch.index_select(exits, 0, index, out=self.resume_in[: len(rows)] if graph else None)

    @torch.inference_mode()
    def propose(self, sampled, accepted: torch.Tensor, last: torch.Tensor):
        """-> (drafts, draft distributions) per sampled request (None where none are wanted). `accepted`, `last`:
        per sampled request, on the device, its number of accepted drafts and the last token it emitted in the step
        (Sampler's on_emitted), so that the drafts are launched without waiting for the step's results.

        The active requests draft together, most drafts first, for as many one-token steps as the most any of
        them wants (layer_skip: one more, over each request's last draft, without the head); a request past its
        own count keeps drafting at its last position without writing KV (slot -1) and that output is dropped. So
        every step has the same rows, its inputs (positions, slots, lengths) are staged on the device for all
        steps at once, each step's tokens feed the next on the device, and the drafts reach the host in one copy
        at the end."""
        active = sorted((i for i, s in enumerate(sampled) if s.num_draft_next > 0),
                        key=lambda i: -sampled[i].num_draft_next)  # fmt: skip
        drafts: list[list[int] | None] = [None] * len(sampled)
        probs: list[torch.Tensor | None] = [None] * len(sampled)
        if not active:
            return drafts, probs
        r, n = self.runner, len(active)
        counts = np.fromiter((sampled[i].num_draft_next for i in active), np.int64, n)
        k_max = int(counts[0])
        passes = k_max + self.resumes
        key = self.graphs.key_for(n, n, 1) if self.graphs is not None else None
        rows = n if key is None else key[0]  # the graph's rows: n, then padding
        # The last emitted token sits at position N + accepted, N = known tokens before the step (its first row).
        first = np.fromiter(
            (sampled[i].num_computed_tokens + sampled[i].num_new_tokens - len(sampled[i].spec_token_ids)
             for i in active), np.int64, n,
        )  # fmt: skip
        steps = np.arange(passes)[:, None]
        host = np.empty((3, passes, n), dtype=np.int64)
        final = counts[None, :] - 1 + self.resumes  # each request's last pass that computes a new position
        host[0] = first[None, :] + np.minimum(steps, final)  # positions, less the accepted drafts
        host[1] = steps <= final  # whether the step writes KV
        host[2] = active  # the request's index among `sampled`
        buf = r.buffers.np
        # One group of layers: a model drafter runs on engines whose layers share one block table
        width = max(len(sampled[i].block_ids[0]) for i in active)
        table = buf["block_tables"][0]
        for row, i in enumerate(active):
            blocks = sampled[i].block_ids[0]
            table[row, : len(blocks)] = blocks
        buf["input_ids"][:rows] = 0
        buf["query_start_loc"][: rows + 1] = np.minimum(np.arange(rows + 1), n)
        dev = r.buffers.device
        r.buffers.to_device("input_ids", rows)
        r.buffers.to_device("query_start_loc", rows + 1)
        table_dev = r.buffers.to_device("block_tables", n, width)[0]
        host_dev = list_to_device(host, r.device)
        index = host_dev[2, 0]
        dev["input_ids"][:n].copy_(last[index])
        # Per step: positions, slots, sequence lengths (padding rows: position 0, slot -1, length 0)
        stage = torch.zeros((passes, 3, rows), dtype=torch.int64, device=r.device)
        stage[:, 1, n:] = -1
        positions = stage[:, 0, :n]
        torch.add(host_dev[0], accepted[index], out=positions)
        bs = r.block_size
        blocks_of = torch.gather(table_dev, 1, (positions // bs).T).T
        slots = (blocks_of * bs + positions % bs + 1).mul_(host_dev[1])  # slot + 1, or 0 where the step writes none
        torch.sub(slots, 1, out=stage[:, 1, :n])
        torch.add(positions, 1, out=stage[:, 2, :n])
        seq_lens = stage[:, 2, :n].cpu().numpy() if key is None else None  # an eager forward's host metadata

        requests = [sampled[i].request for i in active]
        greedy = [q.sampling_params.greedy for q in requests]
        sample_rows = [SampleRow(q, []) for q in requests]
        greedy_t = None if all(greedy) else list_to_device(greedy, r.device)
        sampler = r.sampler
        chosen = torch.empty(k_max, n, dtype=torch.int64, device=r.device)
        # layer_skip: every pass's hidden states after the draft layers, which the verification resumes from
        size = (passes, n, self.model.config.hidden_size)
        exits = torch.empty(size, dtype=r.dtype, device=r.device) if self.resumes else None
        step_probs = []
        for j in range(passes):
            dev["positions"][:rows].copy_(stage[j, 0])
            dev["slot_mapping"][0, :rows].copy_(stage[j, 1])
            dev["seq_lens"][:rows].copy_(stage[j, 2])
            if j:
                dev["input_ids"][:n].copy_(chosen[j - 1])
            if key is not None:
                hidden = self.graphs.run(key)[:n]
            else:
                hidden = self._forward_eager(n, width, seq_lens[j])
            if exits is not None:
                exits[j].copy_(hidden)
            if j == k_max:  # layer_skip's pass over the last drafts: their hidden states only
                break
            if greedy_t is None:
                chosen[j] = sampler.first_max(self.model.compute_logits(hidden, None, self.lm_head))
                continue
            logits = self.model.compute_logits(hidden, lm_head=self.lm_head)
            p = sampler.probs(logits, sample_rows)
            u = torch.rand(n, generator=sampler.generator, device=logits.device)
            chosen[j] = torch.where(greedy_t, logits.argmax(dim=-1), sampler.draw(p, u))
            step_probs.append(p)
        pending = PendingDrafts(chosen, exits)
        q_all = torch.stack(step_probs, dim=1) if step_probs else None  # [n, k_max, vocab]
        for row, i in enumerate(active):
            drafts[i] = DraftTokens(pending, row, int(counts[row]))
            if not greedy[row]:
                probs[i] = q_all[row, : counts[row]]
        return drafts, probs

    def _forward_eager(self, n: int, width: int, seq_lens: np.ndarray) -> torch.Tensor:
        """One token per request over the device buffers as staged -> hidden [n, hidden]."""
        r = self.runner
        dev = r.buffers.device
        meta = AttentionMetadata(
            num_tokens=n,
            num_decodes=n,
            slot_mapping=dev["slot_mapping"][0, :n],
            query_start_loc=dev["query_start_loc"][: n + 1],
            seq_lens=dev["seq_lens"][:n],
            block_tables=dev["block_tables"][0, :n, :width],
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=seq_lens.tolist(),
            max_seq_len=int(seq_lens.max()),
            max_query_len=1,
        )
        self.backend.prepare(meta, r.block_size)
        return self.model(dev["input_ids"][:n], dev["positions"][:n], self.kv_caches, meta, num_layers=self.num_layers)
