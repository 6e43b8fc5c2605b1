"""Gemma 2 (`Gemma2ForCausalLM`): the Llama decoder's projections, rotary and attention backends, with Gemma's
differences, each as transformers computes it:

    embeddings         multiplied by sqrt(hidden_size), rounded to the model's dtype first
    RMSNorm            x / rms(x) * (1 + w), in float32 (GemmaRMSNorm); the checkpoint's w is stored as it is
    decoder layer      x = x + post_attention_norm(attn(input_norm(x)))
                       x = x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))
    MLP                GeGLU: gelu_tanh(gate) * up
    attention          scale query_pre_attn_scalar ** -0.5; scores soft-capped at attn_logit_softcapping; the layers
                       config.layer_types marks "sliding_attention" (every other one) see the last sliding_window keys
    logits             soft-capped at final_logit_softcapping; lm_head tied to the embeddings

The scale, window and soft-cap are each layer's AttentionParams, which every attention backend takes. The norms and
GeGLU run through Gemma ops chosen once with the model's element-wise ops (gemma_ops): on a GPU the Triton kernels of
aserve/kernels/gemma.py (a layer's post-attention norm, residual add and pre-feed-forward norm in one launch, the
post-feed-forward norm and residual add in another), elsewhere the torch functions below. In deterministic mode,
use_batch_invariant() (called by aserve/layers/batch_invariant.py use_batch_invariant_linears on the model built on
the meta device) swaps the torch ones and the logit soft-cap for that file's batch-invariant functions; the Triton
ones stay (one program per row, or per element: nothing depends on the other rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aserve.layers import batch_invariant
from aserve.layers.attention.backend import AttentionParams
from aserve.models.llama import MLP, Attention, LlamaForCausalLM


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm over the last dimension: float32 throughout, (1 + weight), rounded to x's dtype at the end."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class GemmaTorchOps:
    """Gemma's norms and GeGLU in torch, from `norm` (x, weight, eps) and `act_and_mul` (gate_up): the functions
    above, or batch_invariant's in deterministic mode. The reference of aserve/kernels/gemma.py."""

    def __init__(self, norm=gemma_rms_norm, act_and_mul=gelu_tanh_and_mul) -> None:
        self.norm, self.gelu_and_mul = norm, act_and_mul

    def add_norm(self, h, x, w_post, eps: float, w_pre=None):
        """x' = x + norm(h; w_post) -> x', or with w_pre (norm(x'; w_pre), x')."""
        x = x + self.norm(h, w_post, eps)
        return x if w_pre is None else (self.norm(x, w_pre, eps), x)

    def head_norm(self, qkv, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int, head_dim: int):
        """The norm over each head of q and of k in a fused qkv row -> the row (v as it was)."""
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = self.norm(q.reshape(-1, num_heads, head_dim), q_weight, eps)
        k = self.norm(k.reshape(-1, num_kv_heads, head_dim), k_weight, eps)
        return torch.cat([q.flatten(1), k.flatten(1), v], dim=-1)


class GemmaTritonOps:
    """The same in one Triton launch each (aserve/kernels/gemma.py)."""

    def __init__(self) -> None:
        from aserve.kernels import gemma  # Triton: optional, imported once it is chosen

        self.norm, self.add_norm, self.gelu_and_mul = gemma.gemma_norm, gemma.gemma_add_norm, gemma.gelu_tanh_and_mul
        self.head_norm = gemma.gemma_head_norm_


def gemma_ops(ops) -> GemmaTorchOps | GemmaTritonOps:
    """Gemma's ops to go with the model's element-wise ops (aserve/layers/elementwise.py): Triton with Triton's."""
    return GemmaTritonOps() if ops.kind == "triton" else GemmaTorchOps()


def batch_invariant_gemma_ops(current: GemmaTorchOps | GemmaTritonOps) -> GemmaTorchOps | GemmaTritonOps:
    """Deterministic mode's Gemma ops in place of `current`: Triton's as they are (one program per row, or per
    element: nothing depends on the other rows), batch_invariant's functions in place of torch's."""
    if isinstance(current, GemmaTritonOps):
        return current
    return GemmaTorchOps(batch_invariant.gemma_rms_norm, batch_invariant.gelu_tanh_and_mul)


class GemmaRMSNorm(nn.Module):
    """A Gemma norm's weight and epsilon; the Gemma ops of the module that holds it apply it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps


class GemmaMLP(MLP):
    hidden_act = "gelu_pytorch_tanh"

    def __init__(self, cfg, ops, quant_config, prefix: str) -> None:
        super().__init__(cfg, ops, quant_config, prefix)
        self.gemma_ops = gemma_ops(ops)

    def use_batch_invariant(self) -> None:
        self.gemma_ops = batch_invariant_gemma_ops(self.gemma_ops)

    def forward(self, x):
        return self.down_proj(self.gemma_ops.gelu_and_mul(self.gate_up_proj(x)))


class Gemma2Attention(Attention):
    def __init__(self, cfg, backend, ops, qkv_bias: bool, quant_config, prefix: str) -> None:
        super().__init__(cfg, backend, ops, qkv_bias, quant_config, prefix)
        softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.attn_params = AttentionParams(scale=cfg.query_pre_attn_scalar**-0.5, softcap=softcap)


class Gemma2DecoderLayer(nn.Module):
    attention_cls = Gemma2Attention
    rotary_index = 0  # which of the model's rotary tables the layer's positions use (models/gemma3.py has two)

    def __init__(self, cfg, backend, ops, qkv_bias: bool, quant_config, prefix: str) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, backend, ops, qkv_bias, quant_config, f"{prefix}.self_attn")
        self.mlp = GemmaMLP(cfg, ops, quant_config, f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gemma_ops, self.eps = gemma_ops(ops), cfg.rms_norm_eps

    def use_batch_invariant(self) -> None:
        self.gemma_ops = batch_invariant_gemma_ops(self.gemma_ops)

    def forward(self, rotary_cos_sin, x, kv_cache, meta) -> torch.Tensor:
        g, eps = self.gemma_ops, self.eps
        h = self.self_attn(rotary_cos_sin, g.norm(x, self.input_layernorm.weight, eps), kv_cache, meta)
        y, x = g.add_norm(h, x, self.post_attention_layernorm.weight, eps, self.pre_feedforward_layernorm.weight)
        return g.add_norm(self.mlp(y), x, self.post_feedforward_layernorm.weight, eps)


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma2DecoderLayer
    one_token_path = False  # the CPU one-token forward knows the Llama layer only
    supports_kv_groups = True  # each layer reads its group's metadata and its slot of the cache (set_kv_layout)
    soft_cap = staticmethod(soft_cap)  # the final logits' (x, cap); batch_invariant's in deterministic mode

    def __init__(self, cfg, backend, ops, quant_config, max_position: int) -> None:
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__} with use_bidirectional_attention is not supported (causal only)")
        super().__init__(cfg, backend, ops, quant_config, max_position)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # sqrt(hidden) as the model's dtype holds it (bf16: sqrt(3072) = 55.4256 becomes 55.5), as in transformers
        dtype = self.embed_tokens.weight.dtype
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype, device="cpu"))
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)
        self.gemma_ops = gemma_ops(ops)  # the final norm's
        self.set_kv_layout(None)

    def set_kv_layout(self, layout) -> None:
        """Each layer's group of block tables and slot of the KV cache tensor, from `layout` (a KVCacheLayout of
        aserve/core/kv_cache_groups.py; None: group 0, the slot of its index)."""
        for i, layer in enumerate(self.layers):
            layer.kv_group, layer.kv_slot = (0, i) if layout is None else (layout.layer_groups[i],
                                                                           layout.layer_slots[i])  # fmt: skip

    def use_batch_invariant(self) -> None:
        self.soft_cap = batch_invariant.soft_cap
        self.gemma_ops = batch_invariant_gemma_ops(self.gemma_ops)

    def forward(self, input_ids, positions, kv_caches: torch.Tensor, meta, num_layers: int | None = None,
                start_layer: int = 0, start_hidden: torch.Tensor | None = None):  # fmt: skip
        """As LlamaForCausalLM.forward: -> hidden [T, hidden] before the final norm."""
        x = self.embed_tokens(input_ids) * self.embed_scale if start_hidden is None else start_hidden
        tables = self.rotary_tables(positions, x.dtype)
        metas = (meta, *meta.groups)
        for layer in self.layers[start_layer:num_layers]:
            x = layer(tables[layer.rotary_index], x, kv_caches[layer.kv_slot], metas[layer.kv_group])
        return x

    def rotary_tables(self, positions, dtype) -> tuple:
        """(cos, sin) of the step's positions for each rotary table the layers use."""
        return (self.rotary(positions, dtype),)

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32,
                       lm_head: nn.Module | None = None) -> torch.Tensor:  # fmt: skip
        head = self.lm_head if lm_head is None else lm_head
        logits = head(self.gemma_ops.norm(hidden, self.norm.weight, self.norm.eps))
        if self.final_logit_softcapping is not None:
            logits = self.soft_cap(logits, self.final_logit_softcapping)
        return logits if dtype is None else logits.to(dtype)
