"""Token-level perplexity of a model on a text, computed with aserve's own model forward (so an AWQ checkpoint is
measured through the path that serves it: the loader, the fused int4 layers, their dequantisation).

The text is tokenised once and cut into consecutive windows of `window` tokens; each window is one fresh causal
sequence (no context carried over), and every token after a window's first is scored:

    ppl = exp(-(1 / N) * sum log p(token_i | window tokens before i))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from aserve.entrypoints.llm import LLM
from aserve.layers.attention.backend import AttentionMetadata


def window_ids(tokenizer, text: str, window: int, max_windows: int | None = None) -> list[list[int]]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]
    return windows[:max_windows] if max_windows is not None else windows


def _prefill_meta(num_tokens: int, block_size: int) -> AttentionMetadata:
    """One request, no context, its KV in blocks 0, 1, ..."""
    num_blocks = -(-num_tokens // block_size)
    return AttentionMetadata(
        num_tokens=num_tokens,
        num_decodes=0,
        slot_mapping=torch.arange(num_tokens),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32).view(1, -1),
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[num_tokens],
        max_seq_len=num_tokens,
        max_query_len=num_tokens,
    )


@torch.inference_mode()
def model_nll(model, windows: list[list[int]], block_size: int = 16, kv_dtype=None) -> tuple[float, int]:
    """-> (summed negative log-likelihood, number of scored tokens) of aserve model `model` (CPU) on `windows`.
    `kv_dtype`: the KV cache's element type, as the engine's runner has it (`kv_dtype`; None: the model's dtype)."""
    attn = model.layers[0].self_attn
    window = max(len(w) for w in windows)
    dtype = model.embed_tokens.weight.dtype
    num_blocks = -(-window // block_size)
    kv = torch.zeros(len(model.layers), 2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim,
                     dtype=kv_dtype or dtype)  # fmt: skip
    total, count = 0.0, 0
    for ids in windows:
        meta = _prefill_meta(len(ids), block_size)
        attn.backend.prepare(meta, block_size)
        tokens = torch.tensor(ids)
        hidden = model(tokens, torch.arange(len(ids)), kv, meta)
        logits = model.compute_logits(hidden[:-1])
        total += F.cross_entropy(logits, tokens[1:], reduction="sum").item()
        count += len(ids) - 1
    return total, count


def perplexity(model: str | None, text: str, window: int = 512, max_windows: int | None = None,
               dtype: str = "bfloat16") -> tuple[float, int]:  # fmt: skip
    """-> (perplexity, scored tokens) of the model directory (float or AWQ) on `text`, on CPU."""
    llm = LLM(model, dtype=dtype, device="cpu", max_model_len=window, max_num_seqs=1, enforce_eager=True,
              kv_cache_memory_gb=0.05, enable_prefix_caching=False)  # fmt: skip
    windows = window_ids(llm.get_tokenizer(), text, window, max_windows)
    if not windows:
        raise ValueError(f"the text is shorter than one window of {window} tokens")
    total, count = model_nll(llm.engine.core.runner.model, windows)
    return math.exp(total / count), count
