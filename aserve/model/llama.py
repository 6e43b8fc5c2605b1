"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over flat token batches.

The forward takes tensors and an explicit AttentionMetadata; it knows nothing of requests, padding or scheduling.
q/k/v and gate/up projections are fused into one matmul each; `load_weights` maps HF checkpoint names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from aserve.model.attention import AttentionBackend, AttentionMetadata
from aserve.model.layers import RMSNorm, RotaryEmbedding, rope_parameters, silu_and_mul

# HF name fragment -> (fused parameter fragment, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class Attention(nn.Module):
    def __init__(self, cfg, rotary: RotaryEmbedding, backend: AttentionBackend, qkv_bias: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False))
        self.rotary = rotary
        self.backend = backend

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v.contiguous(), kv_cache, meta)
        return self.o_proj(out.view(-1, self.q_size))

    def load_shard(self, param: nn.Parameter, shard: str, tensor: torch.Tensor) -> None:
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        size = self.q_size if shard == "q" else self.kv_size
        param.data[start : start + size].copy_(tensor)


class MLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        bias = getattr(cfg, "mlp_bias", False)
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))

    def load_shard(self, param: nn.Parameter, shard: int, tensor: torch.Tensor) -> None:
        n = self.intermediate_size
        param.data[shard * n : (shard + 1) * n].copy_(tensor)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, rotary, backend, qkv_bias: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary, backend, qkv_bias)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM and Qwen2ForCausalLM (which adds a q/k/v bias)."""

    def __init__(self, cfg, backend: AttentionBackend, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        qkv_bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta, scaling = rope_parameters(cfg)
        self.rotary = RotaryEmbedding(head_dim, max_position, theta, scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary, backend, qkv_bias) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_word_embeddings = getattr(cfg, "tie_word_embeddings", False)
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, positions, kv_caches: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions [T]; kv_caches [num_layers, 2, num_blocks, block_size, Hkv, D] -> hidden [T, hidden]
        (before the final norm)."""
        x = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, kv_caches[i], meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] of the positions that sample -> float32 logits [N, vocab]."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(self.norm(hidden), weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the (fused) parameters. Returns the names of parameters it filled."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied to the embedding
            for fragment, (fused, shard) in _STACKED.items():
                if fragment in name:
                    target = name.replace(fragment, fused)
                    owner = self.get_submodule(target.rsplit(".", 2)[0])
                    owner.load_shard(params[target], shard, tensor)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add(name)
        return loaded


ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
