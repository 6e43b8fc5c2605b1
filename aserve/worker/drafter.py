"""Model-based drafting, run by the model runner right after the target's step.

layer_skip   the target's first L layers, its final norm and lm_head are the draft model. Its KV cache is the
             target's own (layers 0..L-1): for accepted tokens the target wrote exactly what the draft would, so
             there is nothing to keep in sync.
draft_model  a separate small model with its own KV cache tensor, indexed by the same block ids (the target's block
             tables and slots serve both). It "mirrors" every target step over the same tokens to keep its KV
             complete.

Drafting k tokens for a request takes k one-token forward passes, batched over requests, at the positions after
the step's last emitted token; the KV slots were allocated as lookahead by the scheduler. Drafts of sampling
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

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.needs_mirror:
            r = self.runner
            self._own_kv = allocate_kv_cache(self.model, num_blocks, r.block_size, r.dtype, r.device)

    @property
    def kv_caches(self) -> torch.Tensor:
        return self._own_kv if self.needs_mirror else self.runner.kv_caches

    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        meta = dataclasses.replace(meta, state=None)  # the draft model's backend builds its own
        self.backend.prepare(meta, self.runner.block_size)
        self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def propose(self, sampled, emitted: list[list[int]]):
        """-> (drafts, draft distributions) per sampled request (None where none are wanted)."""
        active = [i for i, s in enumerate(sampled) if s.num_draft_next > 0]
        drafts: list[list[int] | None] = [None] * len(sampled)
        probs: list[torch.Tensor | None] = [None] * len(sampled)
        if not active:
            return drafts, probs
        sampler = self.runner.sampler
        for i in active:
            drafts[i] = []
        q_rows: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        # The last emitted token sits at position N + accepted, N = known tokens before the step.
        last_token = {i: emitted[i][-1] for i in active}
        position = {
            i: sampled[i].num_computed_tokens + sampled[i].num_new_tokens - len(sampled[i].spec_token_ids)
            + len(emitted[i]) - 1
            for i in active
        }  # fmt: skip
        k_max = max(sampled[i].num_draft_next for i in active)
        for j in range(k_max):
            batch = [i for i in active if j < sampled[i].num_draft_next]
            tokens = [last_token[i] if j == 0 else drafts[i][-1] for i in batch]
            pos = [position[i] + j for i in batch]
            logits = self._forward(tokens, pos, [sampled[i].block_ids for i in batch])
            rows = [SampleRow(sampled[i].request, []) for i in batch]
            greedy = torch.tensor([row.params.greedy for row in rows], device=logits.device)
            p = sampler.probs(logits, rows)
            u = torch.rand(len(batch), generator=sampler.generator, device=logits.device)
            chosen = torch.where(greedy, logits.argmax(dim=-1), sampler.draw(p, u)).tolist()
            for n, i in enumerate(batch):
                drafts[i].append(chosen[n])
                if not rows[n].params.greedy:
                    q_rows[i].append(p[n])
        for i in active:
            if q_rows[i]:
                probs[i] = torch.stack(q_rows[i])
        return drafts, probs

    def _forward(self, tokens: list[int], positions: list[int], block_lists: list[list[int]]) -> torch.Tensor:
        """One token per request at the given positions -> logits [n, vocab]."""
        r = self.runner
        buf = r.buffers.np
        bs = r.block_size
        n = len(tokens)
        pos = np.asarray(positions, dtype=np.int64)
        width = max(len(b) for b in block_lists)
        for row, blocks in enumerate(block_lists):
            buf["block_tables"][row, : len(blocks)] = blocks
        block_of = buf["block_tables"][np.arange(n), pos // bs].astype(np.int64)
        buf["input_ids"][:n] = tokens
        buf["positions"][:n] = pos
        buf["slot_mapping"][:n] = block_of * bs + pos % bs
        buf["query_start_loc"][: n + 1] = np.arange(n + 1)
        buf["seq_lens"][:n] = pos + 1
        meta = AttentionMetadata(
            num_tokens=n,
            num_decodes=n,
            slot_mapping=r.buffers.to_device("slot_mapping", n),
            query_start_loc=r.buffers.to_device("query_start_loc", n + 1),
            seq_lens=r.buffers.to_device("seq_lens", n),
            block_tables=r.buffers.to_device("block_tables", n, width),
            query_start_loc_cpu=list(range(n + 1)),
            seq_lens_cpu=(pos + 1).tolist(),
            max_seq_len=int(pos.max()) + 1,
            max_query_len=1,
        )
        self.backend.prepare(meta, bs)
        hidden = self.model(
            r.buffers.to_device("input_ids", n), r.buffers.to_device("positions", n), self.kv_caches, meta,
            num_layers=self.num_layers,
        )  # fmt: skip
        return self.model.compute_logits(hidden)
