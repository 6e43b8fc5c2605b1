"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over flat token batches.

The forward takes tensors and an explicit AttentionMetadata; it knows nothing of requests, padding or scheduling.
q/k/v and gate/up projections are fused into one matmul each; `load_weights` maps HF checkpoint names onto them.
Everything that depends on the device or the checkpoint's format is chosen before the forward runs: the attention
backend and the element-wise ops when the model is built, each linear's quantisation method at construction and its
kernel in process_weights_after_loading.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from aserve import envs
from aserve.layers.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionMetadata,
    kv_scale_of,
    scale_value,
)
from aserve.layers.elementwise import ElementwiseOps, RMSNorm
from aserve.layers.linear import Linear
from aserve.layers.quantization.base import QuantizationConfig
from aserve.layers.rotary import RotaryEmbedding, rope_attention_factor, rope_parameters, rotary_dim
from aserve.models.cpu_one_token import OneTokenForward

# HF name fragment -> (fused parameter fragment, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sliding_windows(cfg) -> list[int | None]:
    """Each layer's sliding window as transformers applies it (None: full attention): config.sliding_window on the
    layers config.layer_types marks "sliding_attention" (Gemma 2/3, Qwen2/3 with use_sliding_window), on every layer
    of a config without layer_types (Mistral, Mixtral, Phi-3); never for Llama, whose attention has no window."""
    window = getattr(cfg, "sliding_window", None)
    if not window or not getattr(cfg, "use_sliding_window", True) or cfg.model_type == "llama":
        return [None] * cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


class Attention(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, ops: ElementwiseOps, qkv_bias: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:  # fmt: skip
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            cfg.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=qkv_bias,
            quant_config=quant_config,
            checkpoint_names=[f"{prefix}.{p}_proj" for p in "qkv"],
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False),
                             quant_config=quant_config, checkpoint_names=[f"{prefix}.o_proj"])  # fmt: skip
        self.backend = backend
        self.ops = ops
        # Scale, sliding window, soft-capping: the model sets the window per layer (sliding_windows)
        self.attn_params = FULL_ATTENTION
        # Triton on both sides (GPU): rotary and the cache write in one kernel, then attention.
        self.rotates_into_cache = backend.writes_rotated_kv and ops.kind == "triton"

    def forward(self, rotary_cos_sin, x, kv_cache, meta: AttentionMetadata):
        return self.attend(rotary_cos_sin, self.qkv_proj(x), kv_cache, meta)

    def attend(self, rotary_cos_sin, qkv, kv_cache, meta: AttentionMetadata, **rotate_kwargs):
        """The fused q/k/v projection's output [T, (H + 2 Hkv) D] -> rotary, cache write, attention, o_proj.
        rotate_kwargs: what the backend's rotate_and_write takes beyond the rest (qk_norm where it fuses_qk_norm)."""
        if self.rotates_into_cache:
            q, k_new, v_new = self.backend.rotate_and_write(
                qkv, *rotary_cos_sin, kv_cache, meta, self.num_heads, self.head_dim, self.attn_params, **rotate_kwargs
            )
            out = self.backend.attend(q, k_new, v_new, kv_cache, meta, self.attn_params)
        else:
            q, k, v = self.ops.split_rotate_qkv(qkv, *rotary_cos_sin, self.num_heads, self.num_kv_heads, self.head_dim)
            out = self.backend.forward(q, k, v, kv_cache, meta, self.attn_params)
        return self.o_proj(out.view(-1, self.q_size))

    def load_shard(self, param: nn.Parameter, shard: str, tensor: torch.Tensor) -> None:
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        size = self.q_size if shard == "q" else self.kv_size
        self.qkv_proj.load_output_slice(param, start, size, tensor)

    def load_kv_scale(self, which: str, value: float) -> None:
        """A checkpoint's per-tensor scale of this layer's keys ("k"), values ("v") or both ("kv") in an FP8 KV
        cache (aserve/layers/attention/backend.py)."""
        scales = {f"{part}_scale": value for part in which}
        self.attn_params = replace(self.attn_params, **scales)


class MLP(nn.Module):
    hidden_act = "silu"  # the activation of the gate half this class applies (models/gemma2.py: gelu_pytorch_tanh)

    def __init__(self, cfg, ops: ElementwiseOps, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.ops = ops
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
        if act != self.hidden_act:
            raise ValueError(f"hidden_act {act!r} is not supported here (only {self.hidden_act})")
        bias = getattr(cfg, "mlp_bias", False)
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias, quant_config=quant_config,
                                   checkpoint_names=[f"{prefix}.gate_proj", f"{prefix}.up_proj"])  # fmt: skip
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias, quant_config=quant_config,
                                checkpoint_names=[f"{prefix}.down_proj"])  # fmt: skip

    def forward(self, x):
        # SiLU·mul inside a linear's kernel where its method takes this input (layers/linear.py): the
        # gate/up GEMV's epilogue (AWQ on a GPU, small decode batches) or the down projection's prologue (GPU,
        # batch-1 decode).
        if self.gate_up_proj.fuses_silu_mul_out(x):
            return self.down_proj(self.gate_up_proj.forward_silu_mul_out(x))
        gate_up = self.gate_up_proj(x)
        if self.down_proj.fuses_silu_mul_in(gate_up):
            return self.down_proj.forward_silu_mul_in(gate_up)
        return self.down_proj(self.ops.silu_and_mul(gate_up))

    def load_shard(self, param: nn.Parameter, shard: int, tensor: torch.Tensor) -> None:
        n = self.intermediate_size
        self.gate_up_proj.load_output_slice(param, shard * n, n, tensor)


class DecoderLayer(nn.Module):
    attention_cls = Attention  # a model family with another attention names its own (models/qwen3.py)

    def __init__(self, cfg, backend: AttentionBackend, ops: ElementwiseOps, qkv_bias: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:  # fmt: skip
        super().__init__()
        self.self_attn = self.attention_cls(cfg, backend, ops, qkv_bias, quant_config, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(cfg, ops, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def make_mlp(self, cfg, ops: ElementwiseOps, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """The feed-forward block; a mixture-of-experts family builds its own (models/mixtral.py)."""
        return MLP(cfg, ops, quant_config, prefix)

    def forward(self, rotary_cos_sin, x, residual, kv_cache, meta):
        # (Fusing the add + RMSNorm into the next GEMV's prologue measured slower on the H200: every program of the
        # GEMV then reads the whole row and reduces it before streaming its weights. docs/benchmarks.md.)
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rotary_cos_sin, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM and Qwen2ForCausalLM (which adds a q/k/v bias), with their sliding windows."""

    layer_cls = DecoderLayer
    one_token_path = True  # the CPU one-token forward (cpu_one_token.py) knows this family's layers
    # Can the layers read different block tables (a hybrid KV layout: aserve/core/kv_cache_groups.py)? Here every
    # layer reads meta's and the cache's slot of its index.
    supports_kv_groups = False
    # Does the family order q / k for a partial rotary at load (models/phi3.py)? Here: every dimension turns.
    supports_partial_rotary = False

    def __init__(self, cfg, backend: AttentionBackend, ops: ElementwiseOps, quant_config: QuantizationConfig | None,
                 max_position: int) -> None:  # fmt: skip
        super().__init__()
        self.config = cfg
        qkv_bias = getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2"
        theta, scaling = rope_parameters(cfg)
        if rotary_dim(head_dim_of(cfg), scaling) != head_dim_of(cfg) and not self.supports_partial_rotary:
            raise ValueError(f"partial_rotary_factor {scaling['partial_rotary_factor']} is not supported for "
                             f"{type(self).__name__}")  # fmt: skip
        self.backend = backend
        self.ops = ops
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_position, theta, scaling,
                                      rope_attention_factor(scaling, cfg.max_position_embeddings))  # fmt: skip
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, backend, ops, qkv_bias, quant_config, f"model.layers.{i}")
            for i in range(cfg.num_hidden_layers)
        )
        for layer, window in zip(self.layers, sliding_windows(cfg)):
            layer.self_attn.attn_params = replace(layer.self_attn.attn_params, sliding_window=window)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.tie_word_embeddings = getattr(cfg, "tie_word_embeddings", False)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # unquantised, as AutoAWQ leaves it
        self.tie_weights()
        # CPU: steps of one token through aserve/models/cpu_one_token.py (set by process_weights_after_loading)
        self.cpu_one_token: OneTokenForward | None = None

    def tie_weights(self) -> None:
        """lm_head shares the embedding matrix when the config says so (again after moving off the meta device,
        which unties parameters)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def process_weights_after_loading(self) -> None:
        """Once the weights are in, on their device (the loader calls it; call it again after changing weights):
        every linear's method prepares its weights and picks its kernel (aserve/layers/quantization), then the CPU
        one-token path is set up where it applies (ASERVE_CPU_ONE_TOKEN=0: never)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        self.cpu_one_token = None
        if envs.ASERVE_CPU_ONE_TOKEN and self.one_token_path and OneTokenForward.applies(self):
            self.cpu_one_token = OneTokenForward(self)

    def forward(
        self, input_ids, positions, kv_caches: torch.Tensor, meta: AttentionMetadata, num_layers: int | None = None,
        start_layer: int = 0, start_hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """input_ids/positions [T]; kv_caches [num_layers, 2, num_blocks, block_size, Hkv, D] -> hidden [T, hidden]
        (before the final norm). `num_layers` runs only the first layers (layer-skip self-speculation);
        `start_hidden`: the hidden states a forward with num_layers = `start_layer` returned for the same tokens,
        from which this one goes on (the layers before it and their KV are not computed again)."""
        x = self.embed_tokens(input_ids) if start_hidden is None else start_hidden
        rotary_cos_sin = self.rotary(positions, x.dtype, meta)
        if self.cpu_one_token is not None and x.shape[0] == 1 and start_hidden is None:
            return self.cpu_one_token(x, *rotary_cos_sin, kv_caches, meta, num_layers)
        residual = None
        for i in range(start_layer, len(self.layers) if num_layers is None else num_layers):
            x, residual = self.layers[i](rotary_cos_sin, x, residual, kv_caches[i], meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32,
                       lm_head: nn.Module | None = None) -> torch.Tensor:  # fmt: skip
        """hidden [N, hidden] of the positions that sample -> logits [N, vocab] in `dtype` (None: the model's).
        `lm_head`: another head over the same vocabulary (a drafter's)."""
        logits = (self.lm_head if lm_head is None else lm_head)(self.norm(hidden)[0])
        return logits if dtype is None else logits.to(dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the (fused) parameters. Returns the names of parameters it filled."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied to the embedding
            if (kv_scale := kv_scale_of(name)) is not None:  # FP8 KV-cache scales: the layer's AttentionParams
                self.get_submodule(kv_scale[0]).load_kv_scale(kv_scale[1], scale_value(name, tensor))
                continue
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
