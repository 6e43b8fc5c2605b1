"""Megatron-style tensor parallelism as a transform of a model built on the meta device: the model files know nothing
of it. After `apply`, a rank's model is the model with 1/N of the attention heads and of the MLP width, plus the
all-reduces that sum the ranks' partial outputs; `weights` cuts each checkpoint tensor down to this rank's slice as it
loads.

    qkv_proj       column-parallel: this rank's q heads, and its KV heads (H_kv / N of them, or, with fewer KV heads
                   than ranks, the one its q heads read, replicated on N / H_kv ranks); Qwen2's q/k/v biases likewise
    o_proj         row-parallel: the inputs of this rank's heads; the attention block's output is all-reduced
    gate_up_proj   column-parallel: this rank's 1/N of the gate rows and of the up rows ([gate_r | up_r])
    down_proj      row-parallel: the matching inputs; the MLP block's output is all-reduced
    experts        a mixture-of-experts block's experts (16-bit, FP8, int4) as MLPs: each expert's 1/N of the gate
                   and up rows (w13) and the matching columns of its down projection (w2), per-expert or stacked
                   tensors; the router replicated (every rank routes alike); the block's output is all-reduced
    embeddings     vocab-parallel, lm_head too (vocab.py); its logits gathered on rank 0
    norms          replicated (q/k norms act per head, so they are whole on every rank)

A row-parallel layer's bias is added once: rank 0 loads it, the others load zeros. Quantised layers split the same
way, each parameter along whichever dimension its method lays out the outputs (column) or inputs (row), found by
comparing its shape before and after the split: AWQ / GPTQ packed weights, zero points and scales, FP8 / INT8 scales
(a checkpoint tensor's single scale, weight or static input, goes whole to every rank).
FP8 and AWQ / GPTQ experts split as 16-bit ones do, their scales, zero points and group indices with them
(`_expert_slice`). What cannot split (quantisation groups or FP8 scale tiles that would straddle two ranks, GPTQ act
order) is refused by `check_shardable` before any process starts.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from aserve.distributed.group import TensorParallelGroup
from aserve.distributed.vocab import GatherLogits, VocabParallelEmbedding, rows_per_rank
from aserve.layers.moe import FusedMoE
from aserve.layers.quantization.base import QuantizationConfig
from aserve.models.llama import MLP, Attention, head_dim_of
from aserve.models.registry import architecture_of

_ROW = ("o_proj", "down_proj")
# a checkpoint linear of a column-parallel layer -> (the model's layer, how the checkpoint tensor's outputs split):
# q (this rank's 1/N), kv (KV heads: split or replicated), even (1/N), qkv / halves (fused in the checkpoint: each part)
_COLUMN = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "kv"), "v_proj": ("qkv_proj", "kv"),
           "qkv_proj": ("qkv_proj", "qkv"), "gate_proj": ("gate_up_proj", "even"),
           "up_proj": ("gate_up_proj", "even"), "gate_up_proj": ("gate_up_proj", "halves")}  # fmt: skip
_PACK = 8  # int4 values per int32 of AWQ / GPTQ
# AWQ's qweight [K, N / 8], GPTQ's [K / 8, N]; both formats' qzeros [K / g, N / 8], scales [K / g, N]; g_idx [K]
_INT4_PARAMS = ("qweight", "qzeros", "scales", "g_idx")
# an expert's checkpoint projections: gate / up (rows split: column-parallel), down (columns split: row-parallel)
_EXPERT_ROWS, _EXPERT_COLUMNS = ("w1", "w3", "gate_proj", "up_proj"), ("w2", "down_proj")
# quantisations whose experts split: FP8 (a scale per tensor, row or tile), AWQ / GPTQ int4 (groups along the inputs)
_SPLIT_EXPERTS = ("fp8", "compressed-tensors", "awq", "gptq")


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    return num_kv_heads // size if num_kv_heads >= size else 1


def check_shardable(hf_config, size: int, quant_config: QuantizationConfig | None) -> None:
    """ValueError naming the reason where a model cannot split across `size` ranks."""
    arch = architecture_of(hf_config)
    if getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None):
        if quant_config is not None and quant_config.name not in _SPLIT_EXPERTS:
            raise ValueError(f"{arch} with {quant_config.name} experts cannot split across ranks (16-bit, FP8, AWQ "
                             "and GPTQ experts only): run it with tensor_parallel_size 1")  # fmt: skip
        expert_inter = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
        if expert_inter % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the experts' intermediate size "
                             f"{expert_inter}")  # fmt: skip
        group = getattr(quant_config, "group_size", 0)
        per_rank = expert_inter // size
        if group and ((group > 0 and per_rank % group) or per_rank % _PACK):
            raise ValueError(f"{quant_config.name.upper()} experts: tensor_parallel_size {size} gives each rank "
                             f"{per_rank} of an expert's intermediate width, not a whole number of quantisation "
                             f"groups of {group} and of the {_PACK} packed in each int32")  # fmt: skip
        for bn, bk in _fp8_blocks(quant_config):
            if per_rank % bn or per_rank % bk:
                raise ValueError(f"FP8 experts with {bn} x {bk} scale tiles: tensor_parallel_size {size} "
                                 f"gives each rank {per_rank} of an expert's intermediate width, not a "
                                 "whole number of tiles (a tile must not straddle two ranks)")  # fmt: skip
    heads, kv_heads = hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None)
    kv_heads = kv_heads or heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {kv_heads} KV heads or be a multiple "
                         "of them (to replicate each on the ranks that share it)")  # fmt: skip
    inter = hf_config.intermediate_size
    if inter % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the MLP's intermediate size {inter}")
    head_dim = head_dim_of(hf_config)
    rows = (heads * head_dim // size, local_kv_heads(kv_heads, size) * head_dim, inter // size)  # column-parallel
    for bn, bk in _fp8_blocks(quant_config):
        if any(n % bn for n in rows) or any(n % bk for n in (heads * head_dim // size, inter // size)):
            raise ValueError(f"FP8 {bn} x {bk} scale tiles: tensor_parallel_size {size} gives a rank a part of a "
                             "linear's outputs or inputs that is not a whole number of tiles (a tile must not "
                             "straddle two ranks)")  # fmt: skip
    if quant_config is None or not hasattr(quant_config, "group_size"):
        return
    name = quant_config.name.upper()
    if getattr(quant_config, "lm_head", False):
        raise ValueError(f"{name} with a quantised lm_head cannot split across ranks: run it with "
                         "tensor_parallel_size 1")  # fmt: skip
    if getattr(quant_config, "desc_act", False):
        raise ValueError(f"{name} with act order (desc_act) cannot split across ranks: run it with "
                         "tensor_parallel_size 1")  # fmt: skip
    group = quant_config.group_size
    for layer, inputs in (("o_proj", heads * head_dim // size), ("down_proj", inter // size)):
        if group > 0 and inputs % group:
            raise ValueError(
                f"{name}: tensor_parallel_size {size} gives each rank {inputs} of {layer}'s inputs, which is not a "
                f"whole number of quantisation groups of {group} (a group must not straddle two ranks); use a "
                "tensor_parallel_size that keeps the groups whole"
            )
    outputs = {"q_proj": heads * head_dim // size, "k_proj / v_proj": local_kv_heads(kv_heads, size) * head_dim,
               "gate_proj / up_proj": inter // size}  # fmt: skip
    for layer, n in outputs.items():
        if n % _PACK:
            raise ValueError(f"{name}: tensor_parallel_size {size} gives each rank {n} of {layer}'s outputs, not a "
                             f"multiple of the {_PACK} packed in each int32")  # fmt: skip


def _fp8_blocks(quant_config: QuantizationConfig | None) -> list[tuple[int, int]]:
    """The block-wise scale tiles (bn, bk) of an FP8 checkpoint's schemes (fp8_config.py, compressed_tensors.py)."""
    schemes = [getattr(quant_config, "scheme", None)] + [scheme for _, scheme in getattr(quant_config, "groups", ())]
    return [s.block for s in schemes if s is not None and s.block is not None]


def rank_attention_config(hf_config, size: int):
    """A copy of the config with one rank's share of the heads (for the attention backend, which sizes its work by
    them)."""
    local = copy.copy(hf_config)
    local.head_dim = head_dim_of(hf_config)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    local.num_attention_heads = hf_config.num_attention_heads // size
    local.num_key_value_heads = local_kv_heads(kv_heads, size)
    return local


def _resize(linear: nn.Module, in_features: int, out_features: int) -> None:
    """The layer's parameters again, at this rank's size, by its own quantisation method (on the meta device)."""
    with torch.device("meta"):
        linear.quant_method.create_weights(linear, in_features, out_features, linear.bias is not None,
                                           torch.get_default_dtype())  # fmt: skip
    linear.in_features, linear.out_features = in_features, out_features


def _part(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    n = t.shape[dim]
    assert n % parts == 0, f"{tuple(t.shape)} does not split in {parts} along dimension {dim}"
    return t.narrow(dim, index * (n // parts), n // parts)


class TensorParallelSharding:
    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.dims: dict[str, int | None] = {}  # parameter -> the dimension it is split along (None: replicated)
        self.num_heads = self.num_kv_heads = self.vocab_rows = 0

    def apply(self, model: nn.Module) -> None:
        """Splits a model just built on the meta device (and under its dtype as the default: the loader calls it
        there), before its parameters are materialised."""
        full = {name: tuple(p.shape) for name, p in model.named_parameters()}
        for layer in model.layers:
            if not isinstance(layer.self_attn, Attention) or not isinstance(layer.mlp, (MLP, FusedMoE)):
                raise ValueError(f"{type(model).__name__}'s {type(layer.mlp).__name__} blocks cannot split across "
                                 "ranks: run it with tensor_parallel_size 1")  # fmt: skip
            self._split_attention(layer.self_attn)
            (self._split_moe if isinstance(layer.mlp, FusedMoE) else self._split_mlp)(layer.mlp)
        self._split_vocab(model)
        model.one_token_path = False  # the CPU one-token forward has no all-reduce
        for name, p in model.named_parameters():
            differ = [d for d, (a, b) in enumerate(zip(full.get(name, p.shape), p.shape)) if a != b]
            assert len(differ) <= 1, f"{name} split along more than one dimension"
            self.dims[name] = differ[0] if differ else None

    def _all_reduce_output(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(output)

    def _split_attention(self, attn: Attention) -> None:
        size = self.group.size
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        heads, kv_heads, d = attn.num_heads // size, local_kv_heads(attn.num_kv_heads, size), attn.head_dim
        _resize(attn.qkv_proj, attn.qkv_proj.in_features, (heads + 2 * kv_heads) * d)
        _resize(attn.o_proj, heads * d, attn.o_proj.out_features)
        attn.num_heads, attn.num_kv_heads, attn.q_size, attn.kv_size = heads, kv_heads, heads * d, kv_heads * d
        attn.register_forward_hook(self._all_reduce_output)

    def _split_mlp(self, mlp: MLP) -> None:
        inter = mlp.intermediate_size // self.group.size
        hidden = mlp.gate_up_proj.in_features
        _resize(mlp.gate_up_proj, hidden, 2 * inter)
        _resize(mlp.down_proj, inter, hidden)
        mlp.intermediate_size = inter
        mlp.register_forward_hook(self._all_reduce_output)

    def _split_moe(self, moe: FusedMoE) -> None:
        moe.intermediate_size //= self.group.size
        with torch.device("meta"):
            moe.quant_method.create_weights(moe, moe.gate.in_features)
        moe.register_forward_hook(self._all_reduce_output)

    def _split_vocab(self, model: nn.Module) -> None:
        vocab, hidden = model.embed_tokens.weight.shape
        self.vocab_rows = rows_per_rank(vocab, self.group.size)
        model.embed_tokens = VocabParallelEmbedding(vocab, hidden, self.group)
        _resize(model.lm_head, hidden, self.vocab_rows)
        model.lm_head.register_forward_hook(GatherLogits(vocab, self.group))

    # -- loading ----------------------------------------------------------------------------------------------

    def weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors (HF names) -> this rank's slice of each, under the same names."""
        for name, tensor in weights:
            yield name, self._slice(name.removeprefix("model."), tensor)

    def _slice(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return self._vocab_rows(t)
        if "." not in name:
            return t
        module, param = name.rsplit(".", 1)
        parent, _, leaf = module.rpartition(".")
        rank, size = self.group.rank, self.group.size
        if param.endswith(("_scale", "_scale_inv")) and t.numel() == 1:
            return t  # an FP8 tensor's one scale (weight or static input): every rank's slice has it
        if ".experts" in module or leaf == "experts":
            return self._expert_slice(leaf, param, t)
        if leaf in _ROW:
            if param == "bias":  # added once, after the all-reduce
                return t if rank == 0 else torch.zeros_like(t)
            dim = self.dims.get(name)
            if dim is None:
                return t
            part = _part(t, dim, size, rank).contiguous()
            return part - part.min() if param == "g_idx" else part  # GPTQ: this rank's groups, numbered from 0
        if leaf not in _COLUMN:
            return t
        fused, split = _COLUMN[leaf]
        dim = self.dims.get(f"{parent}.{fused}.{param}")
        if dim is None:
            return t
        if split == "qkv":  # Phi-3: q | k | v in one tensor
            unit = t.shape[dim] // (self.num_heads + 2 * self.num_kv_heads)
            q, k, v = t.split([self.num_heads * unit, self.num_kv_heads * unit, self.num_kv_heads * unit], dim)
            return torch.cat([self._column(q, dim, "q"), self._column(k, dim, "kv"), self._column(v, dim, "kv")], dim)
        if split == "halves":  # Phi-3: gate | up in one tensor
            return torch.cat([self._column(half, dim, "even") for half in t.chunk(2, dim)], dim)
        return self._column(t, dim, split).contiguous()

    def _expert_slice(self, leaf: str, param: str, t: torch.Tensor) -> torch.Tensor:
        """An expert's projection ([I, H] gate / up, [H, I] down), or all experts' stacked (experts.gate_up_proj
        [E, 2 I, H], experts.down_proj [E, H, I]): this rank's 1/N of the intermediate dimension. An FP8 expert's
        weight scale goes with it: one per tensor on every rank; per output row ([I, 1]) with gate / up's rows,
        whole with down's (its rows are not split); per tile ([I / bn, H / bk], [H / bn, I / bk]) along the same
        dimension as the weight. (Static input scales, one per tensor, stay whole: `_slice`.)"""
        rank, size = self.group.rank, self.group.size
        if leaf == "experts" and param == "gate_up_proj":
            return torch.cat([_part(half, 1, size, rank) for half in t.chunk(2, 1)], 1).contiguous()
        if leaf == "experts" and param == "down_proj":
            return _part(t, 2, size, rank).contiguous()
        if param in _INT4_PARAMS:  # [inputs (packed), outputs (packed)]: the outputs along 1, the inputs along 0
            if leaf in _EXPERT_ROWS:
                return t if param == "g_idx" else _part(t, 1, size, rank).contiguous()
            if leaf in _EXPERT_COLUMNS:
                if param in ("qzeros", "scales") and t.shape[0] == 1:
                    return t  # one group over all the inputs (group size -1): every rank's share uses it
                part = _part(t, 0, size, rank).contiguous()
                return part - part.min() if param == "g_idx" else part  # GPTQ: this rank's groups, from 0
            return t
        if leaf in _EXPERT_ROWS:
            return _part(t, 0, size, rank).contiguous()
        if leaf in _EXPERT_COLUMNS:
            if param != "weight" and (t.dim() < 2 or t.shape[1] == 1):
                return t  # per-row scales of down's rows
            return _part(t, 1, size, rank).contiguous()
        return t

    def _column(self, t: torch.Tensor, dim: int, split: str) -> torch.Tensor:
        rank, size = self.group.rank, self.group.size
        if split == "kv":
            parts = min(size, self.num_kv_heads)  # fewer KV heads than ranks: rank r reads head r * H_kv // N
            return _part(t, dim, parts, rank * parts // size)
        return _part(t, dim, size, rank)

    def _vocab_rows(self, t: torch.Tensor) -> torch.Tensor:
        start = self.group.rank * self.vocab_rows
        rows = t[start : start + self.vocab_rows]
        if rows.shape[0] < self.vocab_rows:  # the last rank's padding past the vocabulary
            pad = t.new_zeros(self.vocab_rows - rows.shape[0], *t.shape[1:])
            rows = torch.cat([rows, pad])
        return rows
